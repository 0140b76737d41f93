"""Real nodes through the real daemon: owners, fences, refusals and crash safety, as users see them."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from tests.conftest import wait_for, wait_job
from tests.nodes.conftest import Node, add_node, job_pids, make_base, start_daemon, tally_dir
from tests.nodes.test_fencing import OPEN_GPUS

USERS_MAP = {"alice": "alice", "bob": "bob"}  # carol has no account; root maps to itself


@pytest.fixture(scope="module")
def cluster(users):
    """A daemon (admin: alice) with two root sshd nodes of 4 fake GPUs sharing one home."""
    base = make_base()
    home = base / "shared-home"
    home.mkdir(mode=0o700)
    d = start_daemon(base, USERS_MAP)
    nodes = [Node(base, f"n{i}", d.public_key, home).start() for i in (1, 2)]
    try:
        for n in nodes:
            add_node(d, n)
        tokens = {u: d.client().create_token(u, "user")["token"] for u in ("bob", "carol", "root")}
        tokens["alice"] = d.token
        yield d, nodes, tokens
    finally:
        d.stop()
        for n in nodes:
            n.stop()
        shutil.rmtree(base, ignore_errors=True)


def submit(d, token: str, *args: str) -> int:
    out = d.cli("submit", "--json", *args, token=token, check=True).stdout
    return json.loads(out)["id"]


def job(d, job_id: int) -> dict:
    return json.loads(d.cli("job", str(job_id), "--json", check=True).stdout)


def ended(d, job_id: int, timeout: float = 30) -> dict:
    done = ("COMPLETED", "FAILED", "CANCELLED", "OUT_OF_MEMORY", "NODE_FAIL", "TIMEOUT")
    wait_job(d.client(), job_id, done, timeout)
    return job(d, job_id)


def logs(d, job_id: int) -> str:
    return d.cli("logs", str(job_id), check=True).stdout


def test_each_users_job_runs_as_their_own_account(cluster):
    d, _, tokens = cluster
    ids = {u: submit(d, tokens[u], "--", "sh", "-c", "id -un; umask") for u in ("alice", "bob")}
    for user, job_id in ids.items():
        assert ended(d, job_id)["state"] == "COMPLETED"
        assert logs(d, job_id) == f"{user}\n0077\n"


def test_a_user_without_an_account_on_the_node_fails_with_the_reason(cluster):
    d, _, tokens = cluster
    done = ended(d, submit(d, tokens["carol"], "--", "touch", "/var/lib/trainyard-tests/carol"))
    assert done["state"] == "FAILED"
    assert "user 'carol' has no account on" in done["reason"]
    assert "map the trainyard user to an existing account in [users]" in done["reason"]


def test_a_job_mapped_to_root_is_refused(cluster):
    d, _, tokens = cluster
    done = ended(d, submit(d, tokens["root"], "--", "touch", "/var/lib/trainyard-tests/as-root"))
    assert done["state"] == "FAILED"
    assert "refusing to run a job as 'root': uid 0 is root" in done["reason"]


def test_a_job_over_its_mem_ends_out_of_memory(cluster):
    d, _, tokens = cluster
    done = ended(d, submit(d, tokens["bob"], "--mem", "64M", "--", "python3", "-c",
                           "x = bytearray(512 * 2**20); print('survived')"))
    assert done["state"] == "OUT_OF_MEMORY"
    assert "memory limit of 64 MiB exceeded" in done["reason"]
    assert "survived" not in logs(d, done["id"])


def test_a_cancelled_job_leaves_no_process_even_a_double_forked_one(cluster):
    d, nodes, tokens = cluster
    job_id = submit(d, tokens["alice"], "--", "sh", "-c",
                    "(setsid sh -c 'sleep 501.5 &' &); exec sleep 502.5")
    running = wait_job(d.client(), job_id, "RUNNING")
    node = next(n for n in nodes if n.name == running["allocation"][0]["node"])
    wait_for(lambda: job_pids(node, "501.5") and job_pids(node, "502.5"), 10, what="both sleeps")
    d.cli("cancel", str(job_id), check=True)
    assert ended(d, job_id)["state"] == "CANCELLED"
    wait_for(lambda: not job_pids(node, "501.5") and not job_pids(node, "502.5"), 10,
             what="every process of the cancelled job to end")


def test_a_job_can_open_only_its_allocated_gpu(cluster):
    d, _, tokens = cluster
    done = ended(d, submit(d, tokens["alice"], "--gpus", "1", "--", "python3", "-c", OPEN_GPUS))
    assert done["state"] == "COMPLETED"
    [mine] = done["allocation"][0]["gpus"]
    # ENXIO: allowed, no driver behind the fake device; EPERM: the devices cgroup said no
    expected = [f"{i} {'ENXIO' if i == mine else 'EPERM'}" for i in range(4)]
    assert logs(d, done["id"]).splitlines() == expected


def test_nodes_json_shows_how_each_node_fences_its_jobs(cluster):
    d, nodes, _ = cluster
    shown = {n["name"]: n for n in json.loads(d.cli("nodes", "--json", check=True).stdout)}
    for node in nodes:
        assert shown[node.name]["fencing"] == {"cgroup": "v1", "devices": True, "memory": True,
                                               "cpu": True, "pids": True, "reason": ""}
        assert shown[node.name]["agent"]["jobs_as_owners"] is True
        assert shown[node.name]["agent"]["root"] == "/var/lib/trainyard"


def test_a_pure_cgroup_v2_node_fences_its_jobs_gpus_and_says_what_it_lacks(users):
    from tests.nodes.test_fencing import unified_controllers

    base = make_base()
    home = base / "shared-home"
    home.mkdir(mode=0o700)
    d = start_daemon(base, USERS_MAP)
    node = Node(base, "v2", d.public_key, home, cgroup="v2").start()
    try:
        add_node(d, node)
        shown = d.cli("node", "show", node.name, check=True).stdout
        missing = [c for c in ("memory", "cpu", "pids") if c not in unified_controllers()]
        fences = "+".join(["dev"] + [w for c, w in (("memory", "mem"), ("cpu", "cpu"), ("pids", "pids"))
                                     if c not in missing])
        assert f"  fencing: v2 {fences}" in shown
        if missing:
            assert f"cgroup v2 without the {', '.join(missing)} controller(s)" in shown
        done = ended(d, submit(d, d.token, "--gpus", "1", "--", "python3", "-c", OPEN_GPUS))
        assert done["state"] == "COMPLETED"
        [mine] = done["allocation"][0]["gpus"]
        assert logs(d, done["id"]).splitlines() == [f"{i} {'ENXIO' if i == mine else 'EPERM'}" for i in range(4)]
        job_id = submit(d, d.token, "--", "sh", "-c", "(setsid sh -c 'sleep 503.5 &' &); exec sleep 504.5")
        wait_job(d.client(), job_id, "RUNNING")
        wait_for(lambda: job_pids(node, "503.5") and job_pids(node, "504.5"), 10, what="both sleeps")
        d.cli("cancel", str(job_id), check=True)
        assert ended(d, job_id)["state"] == "CANCELLED"
        wait_for(lambda: not job_pids(node, "503.5") and not job_pids(node, "504.5"), 10,
                 what="every process of the cancelled job to end")
    finally:
        d.stop()
        node.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_kill_9_of_the_daemon_with_jobs_on_two_nodes_sharing_a_home_loses_nothing(users):
    base = make_base()
    home = base / "shared-home"
    home.mkdir(mode=0o700)
    tally = tally_dir(base)
    d = start_daemon(base, USERS_MAP)
    nodes = [Node(base, f"n{i}", d.public_key, home).start() for i in (1, 2)]
    try:
        for n in nodes:
            add_node(d, n)
        c = d.client()
        bob = c.create_token("bob", "user")["token"]

        def counted(tag: str, body: str) -> list[str]:
            return ["--gpus", "4", "--", "sh", "-c", f'echo "$(id -un)" >> {tally}/{tag}; {body}']

        long = submit(d, d.token, *counted("long", "sleep 6"))
        short = submit(d, bob, *counted("short", "sleep 1; exit 5"))
        running = [wait_job(c, j, "RUNNING") for j in (long, short)]
        assert {r["allocation"][0]["node"] for r in running} == {n.name for n in nodes}
        d.kill9()
        time.sleep(2.5)  # `short` exits while no daemon listens
        d.start()
        assert ended(d, short)["state"] == "FAILED" and job(d, short)["exit_code"] == 5
        assert ended(d, long)["state"] == "COMPLETED" and job(d, long)["exit_code"] == 0
        assert (tally / "long").read_text() == "alice\n"  # ran once, as its owner
        assert (tally / "short").read_text() == "bob\n"
        assert not any(home.iterdir()), "no node keeps its state in the shared home"
    finally:
        d.stop()
        for n in nodes:
            n.stop()
        shutil.rmtree(base, ignore_errors=True)


def test_a_node_without_sftp_comes_up_and_one_whose_agent_cannot_start_says_why(users):
    base = make_base()
    home = base / "shared-home"
    home.mkdir(mode=0o700)
    crashy = base / "crashy-bin"
    crashy.mkdir()
    (crashy / "python3").write_text(
        '#!/bin/sh\ncase "$1" in *.pyz) echo "ImportError: libcuda went away" >&2; exit 1;; esac\n'
        'exec /usr/bin/python3 "$@"\n')
    (crashy / "python3").chmod(0o755)
    d = start_daemon(base, USERS_MAP)
    plain = Node(base, "nosftp", d.public_key, home, sftp=False).start()
    broken = Node(base, "broken", d.public_key, home, path=f"{crashy}:/usr/bin:/bin").start()
    try:
        add_node(d, plain)
        job_id = submit(d, d.token, "--", "id", "-un")
        assert ended(d, job_id)["state"] == "COMPLETED" and logs(d, job_id) == "alice\n"
        add_node(d, broken, up=False)
        c = d.client()
        shown = wait_for(lambda: "ImportError" in (n := c.node(broken.name))["reason"] and n, 30,
                         what="the broken node's reason")
        assert shown["state"] == "DOWN"
        assert shown["reason"].startswith("the agent exited with status 1 before it said hello")
        table = d.cli("nodes", check=True).stdout
        assert "ImportError: libcuda went away" in table
    finally:
        d.stop()
        for n in (plain, broken):
            n.stop()
        shutil.rmtree(base, ignore_errors=True)
