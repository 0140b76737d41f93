"""Jobs run as the people who submitted them, and one user's job cannot touch another's."""

import signal

from scheduler.protocol import PROTOCOL_VERSION
from tests.nodes.conftest import job_pids


def test_the_node_says_how_it_fences_and_whose_jobs_it_runs(node_factory, link_factory):
    node = node_factory()
    hello = link_factory(node).wait_up()
    assert hello["protocol"] == PROTOCOL_VERSION and hello["user"] == "root" and hello["jobs_as_owners"] is True
    assert hello["root"] == "/var/lib/trainyard"
    assert hello["fencing"] == {"cgroup": "v1", "devices": True, "memory": True, "cpu": True,
                                "pids": True, "reason": ""}


def test_each_job_runs_as_its_owner_and_cannot_touch_another_users_job(node_factory, link_factory):
    node = node_factory()
    link = link_factory(node)
    link.wait_up()
    link.send(op="launch", key="1.0", job_id=1, user="alice",
              argv=["sh", "-c", "id -un; id -gn; echo secret > mine; exec sleep 300.1"])
    alice_pid = link.wait_for("started", "1.0")["pid"]
    link.send(op="launch", key="2.0", job_id=2, user="bob", argv=["sh", "-c", f"""
        id -un
        kill -0 {alice_pid} 2>&1 || echo "signal refused"
        cat /var/lib/trainyard/jobs/1.0/work/mine 2>&1 || echo "read refused"
        ls /var/lib/trainyard/jobs/1.0/work 2>&1 || echo "list refused"
        """])
    assert link.wait_for("exited", "2.0")["rc"] == 0
    bob_log = link.request(op="log", key="2.0")["data"]
    assert bob_log.splitlines()[0] == "bob"
    assert "Operation not permitted" in bob_log and "signal refused" in bob_log
    assert "Permission denied" in bob_log and "read refused" in bob_log and "list refused" in bob_log
    assert "secret" not in bob_log
    assert job_pids(node, "300.1"), "bob's job must not have ended alice's"
    assert link.request(op="log", key="1.0")["data"] == "alice\nalice\n"
    owner = node.run("stat -c '%U %a' /var/lib/trainyard/jobs/1.0/work").stdout.split()
    assert owner == ["alice", "700"]
    link.send(op="signal", key="1.0", sig="KILL")
    assert link.wait_for("exited", "1.0")["rc"] == 128 + signal.SIGKILL


def test_a_launch_for_root_a_system_account_or_no_account_is_refused(node_factory, link_factory):
    node = node_factory()
    link = link_factory(node)
    link.wait_up()
    for key, user, reason in (
        ("3.0", "root", "refusing to run a job as 'root': uid 0 is root"),
        ("4.0", "daemon", "uid 1 is a system account (below the minimum uid 1000)"),
        ("5.0", "nobody-here", "user 'nobody-here' has no account on"),
        ("6.0", None, "the launch names no user"),
    ):
        link.send(op="launch", key=key, job_id=int(key[0]), user=user, argv=["touch", "/ran"])
        assert reason in link.wait_for("launch_failed", key)["reason"]
    assert node.run("test -e /ran").returncode != 0
    link.send(op="sync", id=1)
    states = {j["key"]: j["state"] for j in link.wait_for("jobs")["jobs"]}
    assert states == {"3.0": "failed", "4.0": "failed", "5.0": "failed", "6.0": "failed"}


def test_output_files_are_written_as_the_owner_and_the_agent_keeps_its_copy(
        node_factory, link_factory, users):
    node = node_factory()
    link = link_factory(node)
    link.wait_up()
    home = users["alice"].pw_dir
    node.run(f"rm -f {home}/job-7.out {home}/job-7.err")  # left by an earlier run: files append
    link.send(op="launch", key="7.0", job_id=7, user="alice", argv=["sh", "-c", "echo out; echo err >&2"],
              stdout=f"{home}/job-7.out", stderr=f"{home}/job-7.err")
    assert link.wait_for("exited", "7.0")["rc"] == 0
    assert node.run(f"stat -c '%U %a' {home}/job-7.out").stdout.split() == ["alice", "600"]
    assert node.run(f"cat {home}/job-7.out {home}/job-7.err").stdout == "out\nerr\n"
    assert sorted(link.request(op="log", key="7.0")["data"].splitlines()) == ["err", "out"]
    link.send(op="launch", key="8.0", job_id=8, user="bob", argv=["true"], stdout=f"{home}/job-8.out")
    assert link.wait_for("exited", "8.0")["rc"] == 1
    assert "cannot open the stdout file" in link.request(op="log", key="8.0")["data"]
    assert "as bob: Permission denied" in link.request(op="log", key="8.0")["data"]
