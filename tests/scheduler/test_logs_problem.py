"""The log store's problem as people see it: a full spool disk shows in `GET /v1/cluster` and as
`logs.problem` events, once when it starts and once when it clears, while jobs run on."""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

from tests.conftest import add_sshd_node, wait_for, wait_job


def log_problems(c) -> list[str]:
    return [e["detail"]["problem"] for e in c.events(limit=1000) if e["action"] == "logs.problem"]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a tmpfs needs root")
def test_a_full_spool_disk_is_a_cluster_problem_while_jobs_complete(daemon_factory, sshd_factory, tmp_path):
    small = tmp_path / "small"
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(small)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    d = None
    try:
        d = daemon_factory(extra_config=f'\n[logs]\ndir = "{small}/logs"\n')
        node = sshd_factory("n1", d.public_key)
        add_sshd_node(d, node)
        c = d.client()
        big = "head -c 300000 /dev/zero | tr '\\0' x; echo; echo last line"
        job = c.submit({"command": ["sh", "-c", big]})
        wait_job(c, job["id"], "COMPLETED", timeout=30)  # the job does not wait for the daemon's disk
        problem = wait_for(lambda: c.cluster()["problems"], 20, what="the full disk shown")
        assert "cannot store jobs' output" in problem[0] and str(small) in problem[0]
        status = d.cli("daemon", "--status").stdout  # what an operator checks first
        assert "leader" in status and f"problem: {problem[0]}" in status
        subprocess.run(["mount", "-o", "remount,size=4m", str(small)], check=True)
        wait_for(lambda: not c.cluster()["problems"], 30, what="the problem cleared")
        wait_for(lambda: d.cli("logs", str(job["id"])).stdout.endswith("last line\n"), 30,
                 what="the whole output, resent by the node")
        changes = log_problems(c)
        assert changes[0] and changes[-1] == "" and len(changes) == 2
    finally:
        if d is not None:
            d.stop()  # before the unmount: nothing of the daemon's is open there then
        subprocess.run(["umount", str(small)])
