"""Terminals in running jobs (`srun --pty`, `salloc`): the WebSocket route, the relay over the node's
link and the agent's ptys, against a real daemon with a real sshd node (as root, jobs run as the
suite's job account)."""

from __future__ import annotations

import json
import os
import pty
import select
import signal
import subprocess
import sys
import time

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from tests.conftest import DaemonProc, SshdNode, add_sshd_node, ensure_job_account, wait_job


@pytest.fixture(scope="module")
def ptyd(tmp_path_factory):
    base = tmp_path_factory.mktemp("ptys")
    d = DaemonProc(base).start()
    node = SshdNode(base, "pty-01", d.public_key)
    try:
        node.start()
        add_sshd_node(d, node, gpus=2)
        d.bob = d.cli("token", "create", "bob", "--role", "user", check=True).stdout.strip()
        d.carol = d.cli("token", "create", "carol", "--role", "user", check=True).stdout.strip()
        yield d
    finally:
        node.stop()
        d.stop()


def pty_url(d: DaemonProc, job_id: int, **params) -> str:
    from urllib.parse import urlencode

    query = urlencode(params, doseq=True)
    return f"ws{d.url.removeprefix('http')}/v1/jobs/{job_id}/pty" + (f"?{query}" if query else "")


def open_pty(d: DaemonProc, job_id: int, token: str, **params):
    return connect(pty_url(d, job_id, **params), additional_headers={"Authorization": f"Bearer {token}"},
                   open_timeout=20)


def read_until_exit(ws, timeout: float = 30) -> tuple[str, dict]:
    """The terminal's output and the daemon's closing message."""
    out = b""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            frame = ws.recv(timeout=max(0.1, end - time.monotonic()))
        except (TimeoutError, ConnectionClosed):
            break
        if isinstance(frame, bytes):
            out += frame
        else:
            msg = json.loads(frame)
            if "exit" in msg:
                return out.decode(errors="replace"), msg
    raise AssertionError(f"no exit message; output so far: {out!r}")


def running_job(d: DaemonProc, token: str, **extra) -> int:
    c = d.client(token)
    job = c.submit({"command": ["sleep", "600"], "name": "holder", **extra})
    wait_job(c, job["id"], "RUNNING", timeout=30)
    return job["id"]


def test_a_terminal_runs_as_the_jobs_user_on_a_pts_with_the_jobs_environment(ptyd):
    d = ptyd
    job_id = running_job(d, d.bob)
    script = "id -un; tty; echo job=$SLURM_JOB_ID; cat /proc/self/cgroup; exit 7"
    with open_pty(d, job_id, d.bob, argv=["sh", "-c", script], rows=33, cols=101) as ws:
        out, end = read_until_exit(ws)
    lines = [line.strip() for line in out.splitlines()]
    account = ensure_job_account() or os.environ.get("USER") or ""
    assert lines[0] == account
    assert lines[1].startswith("/dev/pts/")
    assert f"job={job_id}" in lines
    assert end == {"exit": 7, "reason": ""}
    if (d.client().node("pty-01").get("fencing") or {}).get("cgroup") == "v1":  # fenced: in the job's cgroups
        assert any(line.endswith(f"/trainyard/pty-01/{job_id}.0") for line in lines if ":memory:" in line), out
    events = [e for e in d.client()._call("GET", "/v1/events", params={"limit": 500})
              if e["action"] == "job.pty" and e["target"] == str(job_id)]
    assert [(e["actor"], e["detail"]["node"], e["detail"]["rank"]) for e in events] == [("bob", "pty-01", 0)]
    d.client(d.bob).cancel(job_id)


def test_the_terminal_is_interactive_and_follows_resizes(ptyd):
    d = ptyd
    job_id = running_job(d, d.bob)
    with open_pty(d, job_id, d.bob, argv=["sh"], rows=20, cols=70) as ws:
        ws.send(b"stty size\n")
        seen = b""
        while b"20 70" not in seen:
            seen += ws.recv(timeout=20)
        ws.send(json.dumps({"resize": [40, 132]}))
        ws.send(b"stty size; exit\n")
        out, end = read_until_exit(ws)
    assert "40 132" in out
    assert end["exit"] == 0
    d.client(d.bob).cancel(job_id)


def test_only_the_owner_or_an_operator_opens_a_terminal_and_only_in_a_running_job(ptyd):
    d = ptyd
    job_id = running_job(d, d.bob)
    with pytest.raises(InvalidStatus) as e:
        open_pty(d, job_id, d.carol, argv=["true"])
    assert e.value.response.status_code == 403
    assert f"job {job_id} belongs to bob" in json.loads(e.value.response.body)["detail"]
    with pytest.raises(InvalidStatus) as e:
        open_pty(d, job_id, "not-a-token", argv=["true"])
    assert e.value.response.status_code == 401
    with pytest.raises(InvalidStatus) as e:
        open_pty(d, job_id, d.bob, rank=1, argv=["true"])
    assert e.value.response.status_code == 404
    assert "it has no rank 1" in json.loads(e.value.response.body)["detail"]
    with open_pty(d, job_id, d.token, argv=["true"]) as ws:  # alice, an admin
        assert read_until_exit(ws)[1]["exit"] == 0
    d.client(d.bob).cancel(job_id)

    held = d.client(d.bob).submit({"command": ["sleep", "600"], "hold": True})["id"]
    with pytest.raises(InvalidStatus) as e:
        open_pty(d, held, d.bob, argv=["true"])
    assert e.value.response.status_code == 409
    assert f"job {held} is PENDING; a terminal opens only in a RUNNING job" in \
        json.loads(e.value.response.body)["detail"]
    d.client(d.bob).cancel(held)


def test_the_session_ends_when_the_job_is_cancelled(ptyd):
    d = ptyd
    job_id = running_job(d, d.bob)
    with open_pty(d, job_id, d.bob, argv=["sh", "-c", "echo ready; exec sleep 600"]) as ws:
        first = ws.recv(timeout=20)
        assert b"ready" in first
        d.client(d.bob).cancel(job_id)
        _, end = read_until_exit(ws)
    assert end["exit"] is not None and end["exit"] >= 128  # ended by a signal
    assert end["reason"] in ("", f"job {job_id} ended")
    assert wait_job(d.client(d.bob), job_id, "CANCELLED", timeout=30)["state"] == "CANCELLED"


def in_a_terminal(d: DaemonProc, *args: str, token: str, env: dict | None = None,
                  typed: bytes = b"", timeout: float = 60) -> tuple[int, str]:
    """Run a Slurm command on a pty of its own, as a person at a terminal would; (status, screen)."""
    master, slave = pty.openpty()
    environ = {**d.env, "TRAINYARD_URL": d.url, "TRAINYARD_TOKEN": token, "TERM": "xterm", **(env or {})}
    proc = subprocess.Popen([sys.executable, "-m", "scheduler.slurm.commands_main", *args], env=environ,
                            stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    out = b""
    if typed:
        os.write(master, typed)
    end = time.monotonic() + timeout
    try:
        while time.monotonic() < end:
            r, _, _ = select.select([master], [], [], 0.2)
            if r:
                try:
                    chunk = os.read(master, 4096)
                except OSError:  # EIO: the command and everything on its terminal are gone
                    break
                if not chunk:
                    break
                out += chunk
            elif proc.poll() is not None:
                break
        rc = proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        os.close(master)
    return rc, out.decode(errors="replace")


def test_salloc_grants_runs_the_command_in_the_job_and_relinquishes(ptyd):
    d = ptyd
    rc, screen = in_a_terminal(d, "salloc", "-N1", "--gres=gpu:1", "-J", "poke", "sh", "-c",
                               "echo id=$SLURM_JOB_ID gpus=$SLURM_GPUS_ON_NODE; tty; exit 3",
                               token=d.bob)
    assert rc == 3, screen
    granted = [line for line in screen.splitlines() if "Granted job allocation" in line]
    assert granted, screen
    job_id = int(granted[0].split()[-1])
    assert f"salloc: Pending job allocation {job_id}" in screen
    assert f"id={job_id} gpus=1" in screen and "/dev/pts/" in screen
    assert f"salloc: Relinquishing job allocation {job_id}" in screen
    job = wait_job(d.client(d.bob), job_id, "CANCELLED", timeout=30)
    assert job["name"] == "poke" and job["gpus"] == 1


def test_srun_pty_opens_in_the_allocation_it_is_given(ptyd):
    d = ptyd
    job_id = running_job(d, d.bob)
    rc, screen = in_a_terminal(d, "srun", "--pty", "sh", token=d.bob, env={"SLURM_JOB_ID": str(job_id)},
                               typed=b"echo in-$SLURM_JOB_ID; exit 5\n")
    assert rc == 5, screen
    assert f"in-{job_id}" in screen
    assert d.client(d.bob).job(job_id)["state"] == "RUNNING"  # the allocation is not srun's to end
    rc, screen = in_a_terminal(d, "srun", "--pty", "--jobid", str(job_id), "true", token=d.carol)
    assert rc == 1 and f"srun: error: job {job_id} belongs to bob" in screen
    d.client(d.bob).cancel(job_id)


def test_srun_pty_outside_an_allocation_holds_one_for_the_command(ptyd):
    d = ptyd
    rc, screen = in_a_terminal(d, "srun", "--pty", "-t", "5", "sh", "-c", "echo job=$SLURM_JOB_ID", token=d.bob)
    assert rc == 0, screen
    job_id = int(screen.split("job=")[1].split()[0])
    job = wait_job(d.client(d.bob), job_id, "CANCELLED", timeout=30)
    assert job["time_limit"] == 300 and job["name"] == "sh"


def test_bad_parameters_are_refused_naming_them(ptyd):
    d = ptyd
    with pytest.raises(InvalidStatus) as e:
        open_pty(d, 1, d.bob, rows=0)
    assert e.value.response.status_code == 422
    assert json.loads(e.value.response.body)["detail"].startswith("rows: ")


def test_output_larger_than_the_window_arrives_whole_and_in_order(ptyd):
    d = ptyd
    job_id = running_job(d, d.bob)
    with open_pty(d, job_id, d.bob, argv=["sh", "-c", "stty -onlcr; seq 1 100000"]) as ws:
        out, end = read_until_exit(ws, timeout=60)
    numbers = out.split()
    assert len("\n".join(numbers)) > 8 * 65536  # several windows' worth
    assert numbers == [str(i) for i in range(1, 100001)]
    assert end["exit"] == 0
    d.client(d.bob).cancel(job_id)


def test_salloc_interrupted_while_waiting_revokes_the_allocation(ptyd):
    d = ptyd
    master, slave = pty.openpty()
    env = {**d.env, "TRAINYARD_URL": d.url, "TRAINYARD_TOKEN": d.bob}
    proc = subprocess.Popen([sys.executable, "-m", "scheduler.slurm.commands_main", "salloc", "--hold"],
                            env=env, stdin=slave, stdout=slave, stderr=slave, start_new_session=True)
    os.close(slave)
    screen = b""
    try:
        while b"queued and waiting for resources" not in screen:
            r, _, _ = select.select([master], [], [], 30)
            assert r, screen
            screen += os.read(master, 4096)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        while select.select([master], [], [], 0.5)[0]:
            try:
                screen += os.read(master, 4096)
            except OSError:
                break
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    text = screen.decode()
    job_id = int(text.split("Pending job allocation ")[1].split()[0])
    assert f"salloc: Job allocation {job_id} has been revoked." in text
    assert "Relinquishing" not in text
    assert d.client(d.bob).job(job_id)["state"] == "CANCELLED"


def test_a_background_process_holding_the_terminal_does_not_keep_the_session_open(ptyd):
    d = ptyd
    job_id = running_job(d, d.bob)
    with open_pty(d, job_id, d.bob, argv=["sh", "-c", "sleep 300 & echo started; exit 4"]) as ws:
        out, end = read_until_exit(ws, timeout=20)
    assert "started" in out and end["exit"] == 4
    d.client(d.bob).cancel(job_id)
