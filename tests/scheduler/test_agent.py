"""The node agent as a real process speaking JSON lines: detached jobs, exit codes, no reruns."""

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

AGENT = Path(__file__).resolve().parents[2] / "scheduler" / "agent.py"


class Agent:
    def __init__(self, root: Path, sim_gpus: int = 4, extra: tuple[str, ...] = ()):
        env = {**os.environ, "TRAINYARD_SIM_GPUS": str(sim_gpus)}
        self.proc = subprocess.Popen([sys.executable, str(AGENT), "--root", str(root), "--telemetry", "0", *extra],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.hello = self.read()

    def _pump(self):
        for line in self.proc.stdout:
            self.lines.put(json.loads(line))

    def send(self, **msg):
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()

    def read(self, timeout=10.0) -> dict:
        try:
            return self.lines.get(timeout=max(timeout, 0.01))
        except queue.Empty:
            raise AssertionError("the agent said nothing") from None

    def wait_for(self, ev, key=None, timeout=10.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self.read(deadline - time.monotonic())
            if msg.get("ev") == ev and (key is None or msg.get("key") == key):
                return msg
        raise AssertionError(f"no {ev} for {key}")

    def kill9(self):
        self.proc.kill()
        self.proc.wait()

    def close(self):
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(5)


@pytest.fixture
def agent(tmp_path):
    a = Agent(tmp_path / "agent")
    yield a
    a.close()


def test_hello_reports_the_simulated_gpus(agent):
    assert agent.hello["ev"] == "hello"
    assert agent.hello["gpu_source"] == "simulated"
    assert [g["index"] for g in agent.hello["gpus"]] == [0, 1, 2, 3]


def test_job_gets_its_environment_and_exit_code(agent, tmp_path):
    agent.send(op="launch", key="1.0", job_id=1, argv=["sh", "-c", "echo $CUDA_VISIBLE_DEVICES; exit 7"],
               env={"CUDA_VISIBLE_DEVICES": "2,3"}, gpus=[2, 3])
    assert agent.wait_for("exited", "1.0")["rc"] == 7
    agent.send(op="log", id=9, key="1.0")
    assert agent.wait_for("log")["data"] == "2,3\n"


def test_a_repeated_launch_never_runs_the_job_twice(agent, tmp_path):
    marker = tmp_path / "runs"
    cmd = ["sh", "-c", f"echo run >> {marker}"]
    agent.send(op="launch", key="5.0", job_id=5, argv=cmd)
    agent.wait_for("exited", "5.0")
    agent.send(op="launch", key="5.0", job_id=5, argv=cmd)
    assert agent.wait_for("exited", "5.0")["rc"] == 0
    assert marker.read_text() == "run\n"


def test_signal_reaches_the_job_and_its_children_but_the_wrapper_records_the_end(agent):
    agent.send(op="launch", key="2.0", job_id=2, argv=["sh", "-c", "sleep 60 & sleep 60"])
    agent.wait_for("started", "2.0")
    agent.send(op="signal", key="2.0", sig="TERM")
    assert agent.wait_for("exited", "2.0")["rc"] == 128 + signal.SIGTERM


def test_jobs_survive_the_agent_and_their_exit_is_reported_to_the_next_one(tmp_path):
    root = tmp_path / "agent"
    first = Agent(root)
    first.send(op="launch", key="3.0", job_id=3, argv=["sh", "-c", "sleep 0.5; exit 4"])
    first.send(op="launch", key="4.0", job_id=4, argv=["sleep", "30"])
    first.wait_for("started", "4.0")
    first.kill9()  # the SSH link or the daemon went away
    time.sleep(1.0)
    second = Agent(root)
    try:
        second.send(op="sync", id=1)
        jobs = {j["key"]: j for j in second.wait_for("jobs")["jobs"]}
        assert jobs["3.0"]["state"] == "exited" and jobs["3.0"]["rc"] == 4
        assert jobs["4.0"]["state"] == "running"
        second.send(op="signal", key="4.0", sig="KILL")
        second.send(op="forget", keys=["3.0"])
        time.sleep(0.3)
        second.send(op="sync", id=2)
        jobs = {j["key"]: j for j in second.wait_for("jobs")["jobs"]}
        assert "3.0" not in jobs
        assert jobs["4.0"]["state"] == "exited" and jobs["4.0"]["rc"] == 128 + signal.SIGKILL
    finally:
        second.close()


def wait_until(condition, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not {what} after {timeout:g} s")
        time.sleep(0.02)


def ended_job(a: Agent, key: str, output: str = "out\n") -> None:
    """Run `key` to its end and wait for the end of its output stream."""
    a.send(op="launch", key=key, job_id=int(key.split(".")[0]), argv=["sh", "-c", f"printf '{output}'"])
    a.wait_for("exited", key)
    deadline = time.monotonic() + 10
    while not (msg := a.wait_for("output", key, timeout=deadline - time.monotonic()))["eof"]:
        pass
    assert msg["offset"] == len(output)


def test_an_ended_jobs_directory_goes_once_its_end_and_all_its_output_are_stored(tmp_path):
    """A node keeps no job directory for good: once the daemon has recorded the job's end
    (forget) and stored all of its output (done), the directory goes after the retention (here
    none). Until both, it stays: output the daemon has not stored is never removed."""
    root = tmp_path / "agent"
    jobs = root / "jobs"
    a = Agent(root, extra=("--keep-job-dirs", "0"))
    try:
        for key in ("1.0", "2.0", "3.0"):
            ended_job(a, key)
        a.send(op="output_ack", key="1.0", offset=4, done=True)
        a.send(op="forget", keys=["1.0"])
        a.send(op="forget", keys=["2.0"])  # its end is recorded, its output not yet stored
        a.send(op="output_ack", key="3.0", offset=4, done=True)  # stored, its end not yet recorded
        wait_until(lambda: not (jobs / "1.0").exists(), "1.0's directory removed")
        time.sleep(0.3)
        assert (jobs / "2.0" / "log").read_text() == "out\n" and (jobs / "3.0" / "rc").exists()
        a.send(op="output_ack", key="2.0", offset=4, done=True)
        wait_until(lambda: not (jobs / "2.0").exists(), "2.0's directory removed")
        a.send(op="sync", id=1)
        assert [j["key"] for j in a.wait_for("jobs")["jobs"]] == ["3.0"]
        a.send(op="log", id=2, key="3.0")  # what the node still holds is still served
        assert a.wait_for("log")["data"] == "out\n"
    finally:
        a.close()


def test_an_agent_started_later_removes_what_ended_before_it_once_past_the_retention(tmp_path):
    """The retention counts from when the job became removable, across agent restarts: an
    agent finds what its predecessors left and removes what is past it, keeping the rest."""
    root = tmp_path / "agent"
    jobs = root / "jobs"
    first = Agent(root)  # the default retention: an hour
    for key in ("4.0", "5.0"):
        ended_job(first, key)
        first.send(op="output_ack", key=key, offset=4, done=True)
        first.send(op="forget", keys=[key])
    wait_until(lambda: all((jobs / k / "forgotten").exists() and (jobs / k / "log.done").exists()
                           for k in ("4.0", "5.0")), "both ends stored")
    time.sleep(0.3)
    assert (jobs / "4.0").exists() and (jobs / "5.0").exists()  # within the hour
    first.close()
    two_hours_ago = time.time() - 7200
    for name in ("forgotten", "log.done"):
        os.utime(jobs / "4.0" / name, (two_hours_ago, two_hours_ago))
    second = Agent(root)
    try:
        wait_until(lambda: not (jobs / "4.0").exists(), "4.0's directory removed by the next agent")
        assert (jobs / "5.0" / "rc").read_text() == "0"
    finally:
        second.close()


def test_a_job_whose_wrapper_died_is_reported_lost(tmp_path):
    root = tmp_path / "agent"
    a = Agent(root)
    a.send(op="launch", key="6.0", job_id=6, argv=["sleep", "30"])
    a.wait_for("started", "6.0")
    job_dir = root / "jobs" / "6.0"
    os.kill(int((job_dir / "wpid").read_text()), signal.SIGKILL)  # e.g. the node rebooted
    os.killpg(int((job_dir / "pid").read_text()), signal.SIGKILL)
    assert a.wait_for("exited", "6.0")["lost"] is True
    a.close()


def test_missing_workdir_fails_the_job_with_a_message(agent):
    agent.send(op="launch", key="7.0", job_id=7, argv=["true"], workdir="/nonexistent/dir")
    assert agent.wait_for("exited", "7.0")["rc"] == 127
    agent.send(op="log", id=3, key="7.0")
    assert "workdir '/nonexistent/dir' does not exist" in agent.wait_for("log")["data"]


def test_a_burst_of_requests_in_one_write_is_answered_whole_and_once(agent):
    """A scheduling cycle's launches reach a node together and the agent answers a turn's
    reports in one write: every request of a burst longer than one turn's batch is handled,
    each job ends once with its own code, and a request behind the launches is answered."""
    burst = "".join(json.dumps({"op": "launch", "key": f"{i}.0", "job_id": i, "gpus": [],
                                "argv": ["sh", "-c", f"exit {i % 7}"]}) + "\n" for i in range(1, 151))
    agent.proc.stdin.write(burst + json.dumps({"op": "ping", "id": 77}) + "\n")
    agent.proc.stdin.flush()
    ends: dict[str, list[int]] = {}
    pongs = []
    deadline = time.monotonic() + 60
    while len(ends) < 150 or not pongs:
        msg = agent.read(deadline - time.monotonic())
        if msg.get("ev") == "exited":
            ends.setdefault(msg["key"], []).append(msg["rc"])
        elif msg.get("ev") == "pong":
            pongs.append(msg["id"])
    time.sleep(0.5)  # a report sent twice would come by now
    while not agent.lines.empty():
        msg = agent.lines.get()
        if msg.get("ev") == "exited":
            ends.setdefault(msg["key"], []).append(msg["rc"])
    assert ends == {f"{i}.0": [i % 7] for i in range(1, 151)}
    assert pongs == [77]


def test_a_bad_request_gets_an_error_and_the_agent_keeps_going(agent):
    agent.send(op="nonsense", id=11)
    assert agent.wait_for("error")["id"] == 11
    agent.send(op="ping", id=12)
    assert agent.wait_for("pong")["id"] == 12


def test_the_agent_listens_for_wake_ups_on_a_socket_only_it_may_write_to(agent, tmp_path):
    import stat

    sock = tmp_path / "agent" / "wake.sock"
    mode = sock.stat().st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    agent.send(op="launch", key="8.0", job_id=8, argv=["sh", "-c", "sleep 0.2; exit 3"])
    assert agent.wait_for("exited", "8.0")["rc"] == 3
    spec = json.loads((tmp_path / "agent" / "jobs" / "8.0" / "spec.json").read_text())
    assert spec["wake"] == str(sock)


def test_a_job_step_wakes_the_agent_when_it_writes_the_pid_and_the_exit_status(tmp_path):
    import socket

    sys.path.insert(0, str(AGENT.parent))
    from nodefiles import listen_wake

    woken: queue.Queue = queue.Queue()
    path = tmp_path / "wake.sock"
    assert listen_wake(str(path), lambda: woken.put(time.monotonic()))
    rc, _ = _wrap(tmp_path, "j1", ["sh", "-c", "exit 5"], str(tmp_path), wake=str(path))
    assert rc == "5"
    assert woken.get(timeout=5) and woken.get(timeout=5)  # one for the pid, one for the rc
    # a wake-up nobody listens for is no error for the job step
    path.unlink()
    rc, _ = _wrap(tmp_path, "j2", ["sh", "-c", "exit 5"], str(tmp_path), wake=str(path))
    assert rc == "5"
    with pytest.raises(OSError):
        socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM).sendto(b"1", str(path))


def test_an_agent_that_cannot_bind_its_wake_socket_still_reports_starts_and_ends(tmp_path):
    # a socket address holds 107 bytes: under a deeper directory the agent falls back to polling
    deep = tmp_path / ("d" * 60) / ("e" * 60) / "agent"
    a = Agent(deep)
    try:
        assert not (deep / "wake.sock").exists()
        a.send(op="launch", key="9.0", job_id=9, argv=["sh", "-c", "sleep 0.3; exit 6"])
        assert a.wait_for("started", "9.0")
        assert a.wait_for("exited", "9.0")["rc"] == 6
        spec = json.loads((deep / "jobs" / "9.0" / "spec.json").read_text())
        assert spec["wake"] is None
    finally:
        a.close()


PROBE = """
import os, signal, stat, sys
print("leader", os.getsid(0) == os.getpid() == os.getpgid(0))
print("stdin", os.readlink("/proc/self/fd/0"))
print("cwd", os.getcwd())
mask = os.umask(0); print("umask", oct(mask))
print("fds", sorted(int(f) for f in os.listdir("/proc/self/fd")))
print("env", os.environ.get("ONLY_THIS"), "HOME" in os.environ)
sys.stdout.flush(); sys.stderr.write("to stderr\\n")
"""


def _wrap(tmp_path, name: str, argv: list, cwd: str, **extra) -> tuple[str, str]:
    job = tmp_path / name
    job.mkdir()
    (job / "spec.json").write_text(json.dumps({
        "argv": argv, "env": {"PATH": os.environ["PATH"], "ONLY_THIS": "yes"}, "cwd": cwd,
        "account": None, "cgroups": [], "stdout": None, "stderr": None, "gpus": [], **extra}))
    subprocess.run([sys.executable, str(AGENT), "wrap", str(job)], check=True, timeout=30)
    return (job / "rc").read_text(), (job / "log").read_text()


def test_a_job_started_without_a_second_fork_gets_what_a_forked_one_gets(tmp_path):
    """An unfenced job (no cgroups, no owner to become) is started with posix_spawn: it still
    leads its own session, reads /dev/null, runs in its directory with the spec's umask and
    only its own environment, gets SIGPIPE back, and inherits no descriptor beyond 0-2."""
    work = tmp_path / "work dir"
    work.mkdir()
    # the shell reports what it was started with (Python would ignore SIGPIPE itself)
    shell = 'grep ^SigIgn: /proc/$$/status; exec python3 -c "$0"'
    rc, out = _wrap(tmp_path, "j1", ["sh", "-c", shell, PROBE], str(work), umask=0o027)
    assert rc == "0"
    ignored, *rest = out.splitlines()
    mask = int(ignored.split()[1], 16)
    assert not mask & (1 << (signal.SIGPIPE - 1)) and not mask & (1 << (signal.SIGXFSZ - 1)), ignored
    assert rest == ["leader True", "stdin /dev/null", f"cwd {work}", "umask 0o27", "fds [0, 1, 2, 3]",
                    "env yes False", "to stderr"]


def test_a_job_program_is_found_on_the_jobs_path_and_from_its_directory(tmp_path):
    """The program is looked up as execvpe would: on the PATH of the job's environment (not the
    supervisor's: `id` there is the system's), and a name with a slash from the job's working
    directory (not the supervisor's, which is the job's own directory on the node)."""
    tools, work = tmp_path / "tools", tmp_path / "work"

    def program(path, says):
        path.parent.mkdir(exist_ok=True)
        path.write_text(f"#!/bin/sh\necho {says} \"$@\" $PWD\n")
        path.chmod(0o755)

    def run(name, argv, env):
        job = tmp_path / name
        program(job / "here.sh", "from the supervisor's directory")
        (job / "spec.json").write_text(json.dumps({
            "argv": argv, "env": env, "cwd": str(work), "account": None, "cgroups": [],
            "stdout": None, "stderr": None, "gpus": []}))
        subprocess.run([sys.executable, str(AGENT), "wrap", str(job)], check=True, timeout=30)
        return (job / "rc").read_text(), (job / "log").read_text()

    program(tools / "id", "from tools")
    program(work / "here.sh", "from work")
    system_id = subprocess.run(["sh", "-c", "command -v id"], capture_output=True, text=True).stdout
    assert system_id.strip() and str(tools) not in system_id
    assert run("j5", ["id", "a b"], {"PATH": f"{tools}:/usr/bin:/bin"}) == ("0", f"from tools a b {work}\n")
    assert run("j6", ["./here.sh", "x"], {"PATH": "/usr/bin:/bin"}) == ("0", f"from work x {work}\n")
    # no PATH in the job's environment: /bin:/usr/bin, as execvpe and a shell would search
    assert run("j7", ["sh", "-c", "echo ok"], {}) == ("0", "ok\n")


def test_a_job_that_cannot_start_says_why_as_before(tmp_path):
    rc, out = _wrap(tmp_path, "j2", ["no-such-program-here"], str(tmp_path))
    assert (rc, out) == ("127", "trainyard: cannot run no-such-program-here: No such file or directory\n")
    rc, out = _wrap(tmp_path, "j3", ["true"], str(tmp_path / "gone"))
    assert (rc, out) == ("1", f"trainyard: cannot enter {tmp_path / 'gone'}: No such file or directory\n")
    script = tmp_path / "not-executable"
    script.write_text("echo hi\n")
    rc, out = _wrap(tmp_path, "j4", [str(script)], str(tmp_path))
    assert (rc, out) == ("127", f"trainyard: cannot run {script}: Permission denied\n")


def test_the_daemons_job_dir_retention_reaches_every_agent_and_a_bad_one_is_named():
    from scheduler.nodes import SshSettings, SshTarget, agent_argv
    from scheduler.settings import Settings, SettingsError

    def nodes(**values):
        return Settings.from_toml({"nodes": values}, source="trainyard.toml").nodes

    assert nodes().job_dir_retention == 3600.0
    assert nodes(job_dir_retention="2h").job_dir_retention == 7200.0
    assert nodes(job_dir_retention=0).job_dir_retention == 0.0  # removed at once
    with pytest.raises(SettingsError) as e:
        nodes(job_dir_retention="soon")
    assert "nodes.job_dir_retention: cannot read 'soon' as a duration" in str(e.value)
    for privilege in ("login", "sudo"):
        target = SshTarget("g1", "10.0.0.1", 22, "root", "/k", privilege=privilege)
        argv = agent_argv(target, SshSettings("/kh", job_dir_retention_s=7200), "/b/agent.pyz", "/d")
        assert argv[argv.index("--keep-job-dirs") + 1] == "7200"
