"""Crash safety: the daemon killed with -9, nodes lost and regained, host keys that change."""

import subprocess
import time

from tests.conftest import add_sshd_node, shared_dir, wait_for, wait_job

TALLY = shared_dir("tally-")


def runs(tag: str) -> int:
    marker = TALLY / f"runs-{tag}"
    return len(marker.read_text().splitlines()) if marker.exists() else 0


def counted(tag: str, body: str) -> list[str]:
    """A command that records each run (on whichever node), then runs `body`."""
    return ["sh", "-c", f'echo run >> "{TALLY}/runs-{tag}"; {body}']


def test_kill_9_daemon_loses_and_duplicates_nothing(cluster):
    d, nodes = cluster
    c = d.client()
    # `long` outlives the restart however slow the machine is; `short` ends during it
    long = c.submit({"command": counted("long", "sleep 20"), "gpus": 4})
    short = c.submit({"command": counted("short", "sleep 1; exit 5"), "gpus": 4})
    for j in (long, short):
        wait_job(c, j["id"], "RUNNING")
    d.kill9()
    time.sleep(2.5)  # `short` exits while nobody listens
    d.start()
    c = d.client()
    done_short = wait_job(c, short["id"], "FAILED")
    assert done_short["exit_code"] == 5
    assert c.job(long["id"])["state"] == "RUNNING"
    # the new agent learns again which job holds which GPU: its telemetry names `long` on its 4
    node = c.job(long["id"])["allocation"][0]["node"]

    def holders():
        gpus = next(n for n in c.nodes() if n["name"] == node)["telemetry"]["gpus"]
        return sorted(str(g.get("job_id")) for g in gpus if g.get("job_id") is not None)

    assert wait_for(lambda: holders() == [str(long["id"])] * 4 and holders(), 15, what="GPUs held by `long`")
    wait_job(c, long["id"], "COMPLETED", timeout=40)
    assert runs("long") == 1
    assert runs("short") == 1
    # the pending queue survived too
    later = c.submit({"command": ["true"]})
    wait_job(c, later["id"], "COMPLETED")


def test_lost_node_goes_down_and_its_job_is_requeued_elsewhere(daemon_factory, sshd_factory):
    d = daemon_factory(grace=2.0)
    nodes = [sshd_factory(f"n{i}", d.public_key) for i in (1, 2)]
    for n in nodes:
        add_sshd_node(d, n)
    c = d.client()
    job = c.submit({"command": ["sleep", "30"], "gpus": 4, "nodes": 1, "retries": 1})
    running = wait_job(c, job["id"], "RUNNING")
    victim_name = running["allocation"][0]["node"]
    victim = next(n for n in nodes if n.name == victim_name)
    victim.kill()
    down = wait_for(lambda: (n := c.node(victim_name))["state"] == "DOWN" and n, 20, what="node DOWN")
    assert "unreachable" in down["reason"]
    again = wait_job(c, job["id"], "RUNNING", timeout=20)
    assert again["attempt"] == 1 and again["failures"] == 1
    assert again["allocation"][0]["node"] != victim_name
    states = [e["detail"]["state"] for e in c.events(limit=500)
              if e["target"] == str(job["id"]) and e["action"] == "job.state"]
    assert "NODE_FAIL" in states


def test_node_back_within_grace_keeps_its_job(daemon_factory, sshd_factory):
    d = daemon_factory(grace=30.0)
    node = sshd_factory("n1", d.public_key)
    add_sshd_node(d, node)
    c = d.client()
    job = c.submit({"command": ["sh", "-c", "sleep 4; echo survived"], "gpus": 1})
    wait_job(c, job["id"], "RUNNING")
    node.drop_connections()
    wait_for(lambda: not c.node("n1")["connected"], 10, what="link down")
    node.start()
    done = wait_job(c, job["id"], "COMPLETED", timeout=30)
    assert done["attempt"] == 0
    assert c.log(job["id"])[0] == "survived\n"
    assert c.node("n1")["state"] == "UP"


def test_changed_host_key_is_refused_and_shown(daemon_factory, sshd_factory):
    d = daemon_factory(grace=60.0)
    node = sshd_factory("n1", d.public_key)
    add_sshd_node(d, node)
    c = d.client()
    node.kill()
    node.new_host_key()
    node.start()
    shown = wait_for(lambda: "host key verification failed" in (n := c.node("n1"))["reason"] and n, 20,
                     what="host key error")
    assert shown["connected"] is False
    out = d.cli("nodes", check=True).stdout
    assert "host key verification failed" in out


def test_reinstalled_node_comes_back_after_remove_and_add(daemon_factory, sshd_factory):
    d = daemon_factory(grace=60.0)
    node = sshd_factory("n1", d.public_key)
    add_sshd_node(d, node)
    c = d.client()
    job = c.submit({"command": ["sleep", "60"], "gpus": 1, "retries": 1})
    wait_job(c, job["id"], "RUNNING")
    node.kill()
    node.new_host_key()
    node.start()
    r = d.cli("node", "remove", "n1")
    assert r.returncode == 1 and "drain it and wait, or remove with --force" in r.stderr
    d.cli("node", "remove", "n1", "--force", check=True)
    assert c.job(job["id"])["state"] == "PENDING"  # requeued: its run was lost with the node
    add_sshd_node(d, node)
    assert wait_job(c, job["id"], "RUNNING", timeout=20)["attempt"] == 1


def test_link_down_past_grace_fails_over_and_the_stale_run_is_killed_when_the_link_returns(
        daemon_factory, netns_sshd_factory, sshd_factory):
    d = daemon_factory(grace=3.0)
    far = netns_sshd_factory("far", d.public_key)
    add_sshd_node(d, far)
    c = d.client()
    job = c.submit({"command": counted("x", "sleep 60"), "gpus": 4, "retries": 1})
    wait_job(c, job["id"], "RUNNING")
    far.link(False)  # no reset, no FIN: only the SSH keepalives can tell
    down = wait_for(lambda: (n := c.node("far"))["state"] == "DOWN" and n, 20, what="node DOWN")
    assert "unreachable" in down["reason"]
    near = sshd_factory("near", d.public_key)
    add_sshd_node(d, near)
    again = wait_job(c, job["id"], "RUNNING", timeout=20)
    assert again["allocation"][0]["node"] == "near" and again["attempt"] == 1
    far.link(True)
    wait_for(lambda: c.node("far")["state"] == "UP", 30, what="node back UP")
    # the first run was declared NODE_FAIL and rerun elsewhere: it must not keep running
    wait_for(lambda: any(e["action"] == "job.orphan" for e in c.events(limit=1000)), 20,
             what="stale run killed")
    wait_for(lambda: not commands_in(far.netns, b"sleep"), 15, what="stale run gone from the far node")
    assert runs("x") == 2  # once on far (declared NODE_FAIL), once on near; never again on far


def commands_in(netns: str, word: bytes) -> list[str]:
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True).stdout.split()
    out = []
    for pid in pids:
        try:
            cmd = open(f"/proc/{pid}/cmdline", "rb").read()
        except OSError:
            continue
        if word in cmd:
            out.append(cmd.decode(errors="replace"))
    return out
