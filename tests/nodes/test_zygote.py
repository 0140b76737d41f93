"""Job supervisors forked by the agent's zygote: detached from the agent, never orphaned zygotes,
a fresh interpreter when the zygote is gone, each job run once, no zombies or leaked fds."""

from __future__ import annotations

import collections
import contextlib
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

from scheduler import zygote as zygote_module
from scheduler.nodes import agent_bundle
from scheduler.zygote import Zygote, claim
from tests.conftest import wait_for
from tests.scheduler.test_agent import AGENT, Agent


def stat_of(pid: int) -> list[str] | None:
    """/proc/PID/stat after the command name: [state, ppid, pgrp, session, ...]; None if gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None


def alive(pid: int) -> bool:
    st = stat_of(pid)
    return st is not None and st[0] != "Z"


def children(pid: int) -> dict[int, str]:
    """The processes whose parent is `pid`, with their state letter."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            st = stat_of(int(entry))
            if st is not None and int(st[1]) == pid:
                out[int(entry)] = st[0]
    return out


def spares(zygote: int) -> list[int]:
    """The zygote's spare supervisors: forked, waiting for a job (still in the zygote's "/")."""
    out = []
    for pid, state in children(zygote).items():
        with contextlib.suppress(OSError):
            if state != "Z" and os.readlink(f"/proc/{pid}/cwd") == "/":
                out.append(pid)
    return out


def working(zygote: int) -> dict[int, str]:
    """The zygote's children but its spare: supervisors of jobs, or zombies."""
    idle = set(spares(zygote))
    return {p: st for p, st in children(zygote).items() if p not in idle}


def cmdline(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")[:-1]


class AgentProc(Agent):
    """test_agent.py's agent process, started from `argv` (the source tree's agent by default),
    with its stderr kept in a file."""

    def __init__(self, root: Path, argv: list | None = None):
        self.stderr_path = root.parent / f"agent-{time.monotonic_ns()}.stderr"
        # simulated GPUs: jobs run as this account (as on the demo's nodes), not as owners
        env = {**os.environ, "TRAINYARD_SIM_GPUS": "4", "TRAINYARD_SIM_PLUGIN_DIR": str(AGENT.parent)}
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                argv or [sys.executable, str(AGENT), "--root", str(root), "--telemetry", "0"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        self.root = root
        self.lines: queue.Queue = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        self.hello = self.read()

    def launch(self, key: str, argv: list) -> int:
        """Start a job, wait until it runs; its supervisor's pid."""
        self.send(op="launch", key=key, job_id=int(key.split(".")[0]), argv=argv)
        self.wait_for("started", key)
        return int((self.root / "jobs" / key / "wpid").read_text())

    def zygote(self) -> int:
        """The pid of the agent's zygote (started with the agent)."""
        found = wait_for(lambda: [p for p in children(self.proc.pid) if "zygote" in cmdline(p)],
                         what="the agent's zygote")
        assert len(found) == 1, found
        return found[0]

    def stderr(self) -> str:
        return self.stderr_path.read_text()


@pytest.fixture
def jobs_to_end():
    """Process groups of jobs a test leaves running: ended after it."""
    groups: list[int] = []
    yield groups
    for pgid in groups:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)


def job_pid(root: Path, key: str) -> int:
    return int((root / "jobs" / key / "pid").read_text())


def test_a_job_started_through_the_zygote_outlives_the_agent_killed_with_sigkill(tmp_path,
                                                                                 jobs_to_end):
    root = tmp_path / "agent"
    first = AgentProc(root)
    zygote = first.zygote()
    supervisor = first.launch("1.0", ["sleep", "60"])
    jobs_to_end.append(job_pid(root, "1.0"))
    st = stat_of(supervisor)
    assert int(st[1]) == zygote, "forked by the zygote, not started by the agent"
    assert int(st[3]) == supervisor, "the supervisor leads a session of its own"
    first.proc.kill()
    first.proc.wait()
    wait_for(lambda: not alive(zygote), what="the zygote to end with its agent")
    assert alive(supervisor) and alive(job_pid(root, "1.0"))
    second = AgentProc(root)
    try:
        second.send(op="sync", id=1)
        jobs = {j["key"]: j for j in second.wait_for("jobs")["jobs"]}
        assert jobs["1.0"]["state"] == "running"
        second.send(op="signal", key="1.0", sig="KILL")
        assert second.wait_for("exited", "1.0")["rc"] == 128 + signal.SIGKILL
    finally:
        second.close()


def threads(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(status.split("Threads:", 1)[1].split()[0])


def test_a_supervisor_holds_nothing_of_the_agent(tmp_path, jobs_to_end):
    root = tmp_path / "agent"
    agent = AgentProc(root)
    try:
        supervisor = agent.launch("1.0", ["sleep", "60"])
        jobs_to_end.append(job_pid(root, "1.0"))
        assert threads(agent.proc.pid) > 1 and threads(agent.zygote()) == 1
        assert threads(supervisor) == 1
        fds = {int(fd): os.readlink(f"/proc/{supervisor}/fd/{fd}")
               for fd in os.listdir(f"/proc/{supervisor}/fd")}
        assert {fds[0], fds[1], fds[2]} == {os.devnull}
        # beside them the job's log, which the job step opened, and its two pipes to the zygote
        # (a next job comes on one, it says its job ended on the other): no socket, pipe or
        # file of the agent's, and nothing the job inherits (they close on exec)
        pipes = sorted(t for t in fds.values() if t.startswith("pipe:"))
        assert set(fds.values()) - set(pipes) == {os.devnull, str(root / "jobs" / "1.0" / "log")}
        zygote_fds = {os.readlink(f"/proc/{agent.zygote()}/fd/{fd}")
                      for fd in os.listdir(f"/proc/{agent.zygote()}/fd")}
        assert len(pipes) == 2 and set(pipes) <= zygote_fds
        job = job_pid(root, "1.0")
        job_fds = {os.readlink(f"/proc/{job}/fd/{fd}") for fd in os.listdir(f"/proc/{job}/fd")}
        assert job_fds == {os.devnull, str(root / "jobs" / "1.0" / "log")}
    finally:
        agent.close()


@pytest.mark.parametrize("how", ["daemon goes away", "agent killed"])
def test_the_zygote_ends_with_its_agent(tmp_path, how):
    agent = AgentProc(tmp_path / "agent")
    zygote = agent.zygote()
    if how == "daemon goes away":
        agent.close()  # end of file on the agent's channel: it exits
    else:
        agent.proc.kill()
        agent.proc.wait()
    wait_for(lambda: not alive(zygote), what=f"the zygote to end ({how})")


def test_a_killed_zygote_is_replaced_and_meanwhile_jobs_start_as_fresh_interpreters(
        tmp_path, jobs_to_end):
    root = tmp_path / "agent"
    agent = AgentProc(root)
    try:
        old = agent.zygote()
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: not alive(old), what="the zygote to die")
        supervisor = agent.launch("1.0", ["sleep", "60"])
        jobs_to_end.append(job_pid(root, "1.0"))
        assert int(stat_of(supervisor)[1]) == agent.proc.pid  # a fresh interpreter, `wrap`
        assert cmdline(supervisor)[-2:] == ["wrap", str(root / "jobs" / "1.0")]
        supervisor = agent.launch("2.0", ["sleep", "60"])
        jobs_to_end.append(job_pid(root, "2.0"))
        new = agent.zygote()
        assert new != old and int(stat_of(supervisor)[1]) == new
        marker = tmp_path / "runs"
        agent.send(op="launch", key="3.0", job_id=3, argv=["sh", "-c", f"echo run >> {marker}"])
        assert agent.wait_for("exited", "3.0")["rc"] == 0
        assert marker.read_text() == "run\n"
    finally:
        agent.close()
    said = [line for line in agent.stderr().splitlines() if "zygote" in line]
    assert len(said) == 1, said
    assert f"the supervisor zygote failed (pid {old}, signal 9)" in said[0]
    assert "a new zygote starts for the next job" in said[0]


def job_dir(base: Path, name: str, argv: list) -> str:
    """A job directory as the agent prepares it: spec.json for the job step."""
    d = base / name
    (d / "work").mkdir(parents=True)
    (d / "spec.json").write_text(json.dumps({"argv": argv, "env": {"PATH": os.environ["PATH"]},
                                             "cwd": str(d / "work")}))
    return str(d)


def test_a_hung_zygote_is_killed_and_the_job_runs_once_as_a_fresh_interpreter(tmp_path, capfd):
    zygote = Zygote(str(AGENT), reply_timeout_s=1.0)
    zygote.start()
    hung = zygote.pid
    assert zygote.launch(job_dir(tmp_path, "warm", ["true"])) is None  # loaded and answering
    os.kill(hung, signal.SIGSTOP)
    marker = tmp_path / "runs"
    d = job_dir(tmp_path, "1.0", ["sh", "-c", f"echo run >> {marker}"])
    supervisor = zygote.launch(d)
    assert supervisor is not None and supervisor.wait(30) == 0
    assert Path(d, "rc").read_text() == "0" and marker.read_text() == "run\n"
    assert not alive(hung)
    assert "the supervisor zygote failed" in capfd.readouterr().err
    zygote.close()


def test_a_claimed_job_directory_is_never_started_again(tmp_path, capfd):
    d = job_dir(tmp_path, "1.0", ["true"])
    assert claim(d, 4242)
    assert not claim(d, os.getpid())
    assert Path(d, "wpid").read_text() == "4242"
    assert sorted(os.listdir(d)) == ["spec.json", "work", "wpid"]
    forks = Zygote(str(AGENT))
    assert forks.launch(d) is None
    wait_for(lambda: not working(forks.pid), what="the zygote's child to give up")
    forks.close()
    cannot_fork = Zygote(str(AGENT), python=str(tmp_path / "no-python"))
    assert cannot_fork.launch(d) is None
    assert "the supervisor zygote failed: cannot start it" in capfd.readouterr().err
    assert not Path(d, "pid").exists() and not Path(d, "rc").exists()
    assert Path(d, "wpid").read_text() == "4242"


def pipes_of(pid: int) -> list[str]:
    """The pipes `pid` holds ("pipe:[inode]"), sorted."""
    return sorted(t for t in (os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd"))
                  if t.startswith("pipe:"))


def test_a_thousand_jobs_leave_no_zombies_and_no_leaked_fds_and_need_few_forks(tmp_path):
    zygote = Zygote(str(AGENT))
    zygote.start()
    assert zygote.launch(job_dir(tmp_path, "warm", ["true"])) is None
    wait_for(lambda: spares(zygote.pid), what="a spare supervisor")
    dirs = [job_dir(tmp_path, f"{i}.0", ["true"]) for i in range(1000)]
    for d in dirs:
        assert zygote.launch(d) is None, "every supervisor forked by the zygote"
    wait_for(lambda: all(os.path.exists(os.path.join(d, "rc")) for d in dirs), timeout=300,
             interval=0.5, what="1,000 jobs to end")
    assert {Path(d, "rc").read_text() for d in dirs} == {"0"}
    # each job ran once, by a supervisor that ran at most MAX_JOBS of them, and most of them by
    # a supervisor that had run one before (no fork, no exit for those)
    ran_by = collections.Counter(int(Path(d, "wpid").read_text()) for d in dirs)
    assert max(ran_by.values()) <= zygote_module.MAX_JOBS
    assert len(ran_by) <= 100, f"{len(ran_by)} supervisors for 1,000 jobs one after another"
    wait_for(lambda: set(working(zygote.pid).values()) <= {"Z"}, timeout=30,
             what="the supervisors to end or wait")
    with contextlib.suppress(AssertionError):  # a zombie is reaped when its SIGCHLD arrives
        wait_for(lambda: not working(zygote.pid), timeout=5)
    assert working(zygote.pid) == {}, "zombies left in the zygote"
    waiting = spares(zygote.pid)
    assert 1 <= len(waiting) <= zygote_module.MAX_IDLE
    # the zygote holds one pipe to each supervisor that waits, and both ends of the one they all
    # say "my job ended" on (a supervisor forked later inherits its end): nothing of 1,000 jobs
    wait_for(lambda: len(pipes_of(zygote.pid)) == len(spares(zygote.pid)) + 2,
             what="the zygote's pipes to be those of the supervisors that wait")
    others = {int(fd): os.readlink(f"/proc/{zygote.pid}/fd/{fd}") for fd in os.listdir(f"/proc/{zygote.pid}/fd")}
    others = {fd: t for fd, t in others.items() if not t.startswith("pipe:")}
    assert others[0] == others[1] == os.devnull and 2 in others  # stderr: the agent's
    assert [t.split("[")[0] for fd, t in others.items() if fd > 2] == ["socket:"]  # the agent's
    zygote.close()
    wait_for(lambda: not any(alive(p) for p in waiting), what="the waiting supervisors to end")


def test_the_agent_bundle_forks_supervisors_from_its_zygote(tmp_path, jobs_to_end):
    data, digest = agent_bundle()
    bundle = tmp_path / f"agent-{digest}.pyz"
    bundle.write_bytes(data)
    root = tmp_path / "agent"
    agent = AgentProc(root, ["python3", str(bundle), "--dir", str(root), "--telemetry", "0"])
    try:
        zygote = agent.zygote()
        assert cmdline(zygote)[1:] == ["-S", str(bundle), "zygote"]
        supervisor = agent.launch("1.0", ["sleep", "60"])
        jobs_to_end.append(job_pid(root, "1.0"))
        assert int(stat_of(supervisor)[1]) == zygote
        agent.send(op="signal", key="1.0", sig="TERM")
        assert agent.wait_for("exited", "1.0")["rc"] == 128 + signal.SIGTERM
    finally:
        agent.close()


def test_the_zygote_loads_only_what_a_supervisor_needs(tmp_path):
    # every job's supervisor is a copy of the zygote: each module it holds is memory that a fork
    # maps and an exit tears down, per job; a container job's modules are loaded by that job
    data, digest = agent_bundle()
    bundle = tmp_path / f"agent-{digest}.pyz"
    bundle.write_bytes(data)
    loaded = subprocess.run(
        ["python3", "-S", "-c", "import sys; sys.path.insert(0, sys.argv[1]); import zygote; "
         "print(' '.join(sorted(sys.modules)))", str(bundle)],
        capture_output=True, text=True, check=True).stdout.split()
    assert {"jobstep", "fencing", "accounts", "nodefiles"} <= set(loaded)
    assert not {"containers", "subprocess", "threading", "zipfile", "tempfile", "traceback", "ctypes",
                "platform"} & set(loaded)


def wait_rc(d: str) -> str:
    wait_for(lambda: os.path.exists(os.path.join(d, "rc")), what=f"the job in {d} to end")
    return Path(d, "rc").read_text()


def test_a_waiting_supervisor_holds_nothing_and_ends_with_its_zygote(tmp_path):
    """A job's supervisor is forked before its job comes (the spare), or is one whose job ended:
    it waits in a session of its own with /dev/null and its two pipes only; the zygote forks a
    spare when none waits, replaces one that died by a fork, and none outlives the zygote."""
    zygote = Zygote(str(AGENT))
    zygote.start()
    warm = job_dir(tmp_path, "warm", ["true"])
    assert zygote.launch(warm) is None
    assert wait_rc(warm) == "0"
    first = int(Path(warm, "wpid").read_text())
    # the spare forked after the answer, and the warm job's supervisor, back in "/"
    waiting = wait_for(lambda: sorted(spares(zygote.pid)) if len(spares(zygote.pid)) == 2 else None,
                       what="two supervisors waiting")
    assert first in waiting
    for pid in waiting:
        assert int(stat_of(pid)[3]) == pid  # it leads its own session
        fds = {int(fd): os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")}
        assert {fds.pop(0), fds.pop(1), fds.pop(2)} == {os.devnull}
        assert [t.split("[")[0] for t in fds.values()] == ["pipe:", "pipe:"]  # to the zygote, from it
        assert not os.path.exists(f"/proc/{pid}/cwd/spec.json")

    d = job_dir(tmp_path, "1.0", ["true"])
    assert zygote.launch(d) is None
    assert wait_rc(d) == "0"
    assert int(Path(d, "wpid").read_text()) == first  # the latest to finish ran it: no fork

    for pid in wait_for(lambda: spares(zygote.pid), what="supervisors waiting"):
        os.kill(pid, signal.SIGKILL)  # supervisors that died while waiting: the job gets a fork
    wait_for(lambda: not spares(zygote.pid), what="the waiting supervisors to die")
    marker = tmp_path / "runs"
    d = job_dir(tmp_path, "2.0", ["sh", "-c", f"echo run >> {marker}"])
    assert zygote.launch(d) is None
    assert wait_rc(d) == "0" and marker.read_text() == "run\n"
    assert int(Path(d, "wpid").read_text()) not in waiting

    waiting = wait_for(lambda: spares(zygote.pid), what="a supervisor waiting again")
    zygote.close()  # end of file: the zygote ends, and every supervisor waiting with it
    wait_for(lambda: not any(alive(p) for p in waiting), what="the waiting supervisors to end")


def test_a_supervisor_runs_its_next_job_as_a_fresh_one_would(tmp_path):
    """The second job of a supervisor sees its own spec only: its environment, working directory,
    umask and output files, no descriptor of the job before it, and the supervisor keeps nothing
    of that job open."""
    zygote = Zygote(str(AGENT))
    zygote.start()
    out = tmp_path / "first.out"
    first = job_dir(tmp_path, "1.0", ["sh", "-c", "echo one"])
    spec = json.loads(Path(first, "spec.json").read_text())
    spec.update(env={"PATH": "/first-path:" + os.environ["PATH"], "ONLY_FIRST": "1"}, stdout=str(out), umask=0o022)
    Path(first, "spec.json").write_text(json.dumps(spec))
    assert zygote.launch(first) is None
    assert wait_rc(first) == "0" and out.read_text() == "one\n"
    supervisor = int(Path(first, "wpid").read_text())
    wait_for(lambda: supervisor in spares(zygote.pid), what="the first job's supervisor to wait")
    assert [t for t in (os.readlink(f"/proc/{supervisor}/fd/{fd}") for fd in os.listdir(f"/proc/{supervisor}/fd"))
            if not t.startswith("pipe:")] == [os.devnull] * 3  # its job's log and output file closed

    second = job_dir(tmp_path, "2.0", ["sh", "-c", "echo PATH=$PATH; echo ONLY_FIRST=${ONLY_FIRST-unset}; "
                                       "pwd; umask; ls /proc/self/fd"])
    assert zygote.launch(second) is None
    assert wait_rc(second) == "0"
    assert int(Path(second, "wpid").read_text()) == supervisor
    lines = Path(second, "log").read_text().split("\n")
    assert lines[0] == f"PATH={os.environ['PATH']}"
    assert lines[1] == "ONLY_FIRST=unset"
    assert lines[2] == str(Path(second, "work"))
    assert lines[3] == "0077"  # the spec's default, not the first job's 022
    assert sorted(lines[4:-1]) == ["0", "1", "2", "3"]  # 3: `ls`'s own directory handle
    zygote.close()


def test_a_supervisor_stops_after_max_jobs_and_the_pool_keeps_at_most_max_idle(tmp_path):
    zygote = Zygote(str(AGENT))
    zygote.start()
    n = zygote_module.MAX_JOBS + 1
    dirs = [job_dir(tmp_path, f"{i}.0", ["true"]) for i in range(n)]
    for d in dirs:  # one after another: the latest to finish runs each, until it has run MAX_JOBS
        assert zygote.launch(d) is None
        assert wait_rc(d) == "0"
    ran_by = collections.Counter(int(Path(d, "wpid").read_text()) for d in dirs)
    (busiest, jobs), *rest = ran_by.most_common()
    assert jobs == zygote_module.MAX_JOBS and sum(c for _, c in rest) == 1
    wait_for(lambda: not alive(busiest), what="the supervisor that ran MAX_JOBS jobs to end")

    # many jobs at once: each has a supervisor of its own; once they ended, MAX_IDLE wait
    many = zygote_module.MAX_IDLE * 2
    dirs = [job_dir(tmp_path, f"b{i}.0", ["sleep", "0.5"]) for i in range(many)]
    for d in dirs:
        assert zygote.launch(d) is None
    assert len({int(Path(d, "wpid").read_text()) for d in dirs if wait_rc(d) == "0"}) == many
    wait_for(lambda: len(spares(zygote.pid)) == zygote_module.MAX_IDLE and not working(zygote.pid),
             what=f"{zygote_module.MAX_IDLE} supervisors waiting and the rest ended")
    zygote.close()


def test_supervisors_that_waited_too_long_are_told_to_end():
    """The pool's books alone (no fork): one that waited IDLE_S reads end of file on its pipe;
    a later one keeps waiting, and the zygote's wait is until the next is due."""
    pool = zygote_module._Pool({})
    now = time.monotonic()
    ends = {}
    for pid, since in ((101, now - zygote_module.IDLE_S - 1), (102, now - 5)):
        r, w = os.pipe()
        ends[pid] = r
        pool.pipes[pid] = (pid, w)
        pool.idle[pid] = (pid, since)
    wait = pool.retire_due(now)
    assert os.read(ends[101], 1) == b""  # told to end
    assert list(pool.idle) == [102] and 102 in pool.pipes and 101 not in pool.pipes
    assert zygote_module.IDLE_S - 6 < wait <= zygote_module.IDLE_S - 5
    pool.close()
    assert os.read(ends[102], 1) == b""
    for fd in (*ends.values(), pool.done_r, pool.done_w):
        os.close(fd)
