"""`trainyard demo`: a busy cluster from a real trace's slice, and nothing left running after it."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import pytest

from scheduler.daemon_config import DaemonConfig
from scheduler.demo import demo_config
from scheduler.demo_feed import USERS, due, job_request, plan_feed, team_members
from scheduler.traces import read_trace
from scheduler.traces.demo import PHILLY_SLICE, DemoJob
from tests.conftest import PY, ROOT, wait_for


class Demo:
    """`trainyard demo --no-tui` as a real process, with the CLI pointed at it."""

    def __init__(self, base: Path, *args: str):
        self.base = base
        self.env = {**os.environ, "HOME": str(base), "XDG_CONFIG_HOME": str(base / "cfg")}
        self.proc = subprocess.Popen(
            [PY, "-m", "scheduler.cli", "demo", "--no-tui", "--dir", str(base / "demo"), *args],
            cwd=ROOT, env=self.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        for _ in range(2):
            key, _, value = self.proc.stdout.readline().strip().partition("=")
            self.env[key] = value
        if not self.env.get("TRAINYARD_TOKEN", "").startswith("ty_"):
            self.stop(signal.SIGKILL)
            raise AssertionError("trainyard demo did not print TRAINYARD_URL/TRAINYARD_TOKEN")

    def json(self, command: str, *args: str):
        r = subprocess.run([PY, "-m", "scheduler.cli", command, "--json", *args], env=self.env, cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        return json.loads(r.stdout)

    def stop(self, sig: int = signal.SIGINT) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait()


def processes_of(base: Path, argv: list[str] | None = None) -> list[int]:
    """Live processes (running `argv`, if given) that a node of the demo under `base` started:
    agents, job steps, jobs."""
    marker = f"TRAINYARD_AGENT_DIR={base / 'demo' / 'nodes'}".encode()
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                if f.read().rsplit(b")", 1)[1].split()[0] == b"Z":
                    continue  # ended; its parent has yet to reap it
            if argv is not None:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if f.read().split(b"\0")[:-1] != [a.encode() for a in argv]:
                        continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                if any(e.startswith(marker) for e in f.read().split(b"\0")):
                    found.append(int(pid))
        except (OSError, IndexError):
            continue
    return found


# ------------------------------------------------------------------ stopping ends every job


def nodes_process(base: Path) -> list[int]:
    """The demo's simulated nodes' own process (`python -m scheduler.simnode agents ...`)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"scheduler.simnode" in argv and str(base / "demo" / "nodes").encode() in argv:
            found.append(int(pid))
    return found


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGKILL],
                         ids=["SIGTERM", "Ctrl-C", "SIGKILL"])
def test_stopping_the_demo_ends_every_process_its_jobs_started(tmp_path, sig):
    demo = Demo(tmp_path, "--idle", "--nodes", "1", "--gpus-per-node", "2")
    try:
        # the job's own sleep, and one it detached into a session of its own
        job = demo.json("submit", "--gpus", "1", "--", "sh", "-c", "setsid sleep 300 & exec sleep 300")
        wait_for(lambda: len(processes_of(tmp_path, ["sleep", "300"])) == 2, 30,
                 what=f"job {job['id']}'s two sleep 300 processes")
        assert len(nodes_process(tmp_path)) == 1
        # the simulated nodes' work yields to the daemon, which shares their cores: the lowest priority
        lowest = min(19, os.getpriority(os.PRIO_PROCESS, 0) + 19)
        assert os.getpriority(os.PRIO_PROCESS, nodes_process(tmp_path)[0]) == lowest
        assert {os.getpriority(os.PRIO_PROCESS, p) for p in processes_of(tmp_path, ["sleep", "300"])} == {lowest}
        assert os.getpriority(os.PRIO_PROCESS, demo.proc.pid) == os.getpriority(os.PRIO_PROCESS, 0)
        # and the idle policy: they run on what the daemon and its clients leave of the cores
        job_procs = processes_of(tmp_path, ["sleep", "300"])
        assert {os.sched_getscheduler(p) for p in [*nodes_process(tmp_path), *job_procs]} == {os.SCHED_IDLE}
        assert os.sched_getscheduler(demo.proc.pid) == os.sched_getscheduler(0) != os.SCHED_IDLE
    finally:
        rc = demo.stop(sig)
    if sig == signal.SIGKILL:  # nothing of the demo ran after it: its nodes' process saw it go
        assert rc == -signal.SIGKILL
        wait_for(lambda: not processes_of(tmp_path) and not nodes_process(tmp_path), 30,
                 what="the nodes' process to end the jobs and itself")
    assert rc in (0, -signal.SIGKILL)
    assert processes_of(tmp_path, ["sleep", "300"]) == []
    assert nodes_process(tmp_path) == []


def test_an_idle_demo_runs_nothing_of_its_own(tmp_path):
    demo = Demo(tmp_path, "--idle", "--nodes", "1", "--gpus-per-node", "2")
    try:
        wait_for(lambda: demo.json("nodes")[0]["state"] == "UP", 30, what="node-1 UP")
        time.sleep(2)  # the live demo submits its first jobs at once; an idle one never does
        assert demo.json("jobs", "--all") == []
    finally:
        demo.stop()


@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed")
@pytest.mark.parametrize("how", ["quit", "SIGTERM"])
def test_the_demo_in_its_tui_ends_its_jobs_when_it_stops(tmp_path, how):
    socket = f"trainyard-demo-{tmp_path.name}"
    tmux = [shutil.which("tmux"), "-f", "/dev/null", "-L", socket]
    command = (f"cd {ROOT} && exec env -u COLUMNS -u LINES TERM=xterm-256color HOME={tmp_path} "
               f"XDG_CONFIG_HOME={tmp_path / 'cfg'} {PY} -m scheduler.cli demo --nodes 1 "
               f"--gpus-per-node 4 --dir {tmp_path / 'demo'}")
    subprocess.run([*tmux, "new-session", "-d", "-s", "demo", "-x", "140", "-y", "36", command],
                   check=True)
    try:
        demo = int(subprocess.run([*tmux, "list-panes", "-t", "demo", "-F", "#{pane_pid}"],
                                  capture_output=True, text=True, check=True).stdout)
        wait_for(lambda: "running" in subprocess.run(
            [*tmux, "capture-pane", "-p", "-t", "demo"], capture_output=True, text=True).stdout
            and len(processes_of(tmp_path)) > 1, 60, what="the TUI on a busy demo")
        if how == "quit":
            subprocess.run([*tmux, "send-keys", "-t", "demo", "q"], check=True)
        else:
            os.kill(demo, signal.SIGTERM)
        wait_for(lambda: not Path(f"/proc/{demo}").exists(), 30, what="the demo to exit")
        assert processes_of(tmp_path) == []
    finally:
        subprocess.run([*tmux, "kill-server"], capture_output=True)


# ------------------------------------------------------------------ the living demo


def test_the_demo_is_busy_with_the_trace_within_seconds(tmp_path):
    demo = Demo(tmp_path, "--nodes", "2", "--gpus-per-node", "4")
    seen: dict[str, bool] = {}

    def busy():
        jobs = demo.json("jobs", "--all")
        states = Counter(j["state"] for j in jobs)
        gpus = [g for n in demo.json("nodes") for g in (n["telemetry"] or {}).get("gpus", [])]
        seen.update({
            "several users": len({j["user"] for j in jobs}) >= 3,
            "both queues": {"prod", "dev"} <= {j["queue"] for j in jobs},
            "running": states["RUNNING"] > 0,
            "pending with a reason": any(j["state"] == "PENDING" and j["reason"] for j in jobs),
            "completed": states["COMPLETED"] > 0,
            "failed": states["FAILED"] > 0,
            "preempted": seen.get("preempted") or any(j["attempt"] > 0 for j in jobs),
            "busy GPUs": any(g.get("job_id") and (g.get("util_gpu") or 0) >= 40
                             and (g.get("mem_used_mb") or 0) > 0 for g in gpus),
        })
        return all(seen.values())

    try:
        wait_for(busy, 100, interval=1.0, what="a busy demo cluster")
        queues = {q["name"]: q for q in demo.json("queues")}
        assert queues["prod"]["priority"] > queues["dev"]["priority"]
    finally:
        assert demo.stop() == 0


# ------------------------------------------------------------------ the parts, on plain data


def test_the_shipped_slice_is_small_and_every_row_is_a_job():
    trace = read_trace(PHILLY_SLICE)
    assert PHILLY_SLICE.stat().st_size <= 200 * 1024
    assert (trace.format, len(trace.jobs), sum(trace.skipped.values())) == ("philly", 3234, 0)
    assert trace.span_s <= 12 * 3600


def test_the_feed_is_thinned_to_the_offered_load_of_the_cluster():
    small, large = plan_feed(8, load=0.9), plan_feed(32, load=0.9)
    assert small.offered_load == pytest.approx(0.9, abs=0.15)
    assert large.offered_load == pytest.approx(0.9, abs=0.15)
    assert len(small.jobs) < len(large.jobs) < 3234
    assert all(j.gpus <= 8 and j.user in USERS and j.queue in ("prod", "dev") for j in large.jobs)
    assert plan_feed(8, load=0.9).jobs == small.jobs  # the same on every run


def test_the_feed_starts_over_when_the_slice_ends():
    jobs = [DemoJob(0.0, "ann", "speech", "dev", "a", 1, 5.0, 0),
            DemoJob(10.0, "bob", "speech", "prod", "b", 1, 5.0, 0)]
    assert [j.name for j in due(jobs, 20.0, -1.0, 5.0)] == ["a"]
    assert [j.name for j in due(jobs, 20.0, 5.0, 19.0)] == ["b"]
    assert [j.name for j in due(jobs, 20.0, 19.0, 20.0)] == ["a"]  # the second lap begins
    assert [j.name for j in due(jobs, 20.0, 0.0, 60.0)] == ["b", "a", "b", "a", "b", "a"]
    assert due(jobs, 20.0, 30.0, 30.0) == []


def test_a_demo_job_prints_its_epochs_and_exits_with_its_code(tmp_path):
    job = DemoJob(0.0, "ann", "speech", "dev", "6214e9-7", 2, 1.0, 1, trace_id=7)
    body = job_request(job)
    assert (body["queue"], body["gpus"], body["name"]) == ("dev", 2, "6214e9-7")
    assert body["time_limit"] >= 2 * job.runtime_s
    r = subprocess.run(body["command"], capture_output=True, text=True, timeout=30,
                       env={**os.environ, "CUDA_VISIBLE_DEVICES": "0,1"})
    assert r.returncode == 1
    assert r.stdout.splitlines()[0] == "6214e9-7: 2 GPU(s), 1 s, GPUs 0,1"
    assert r.stdout.splitlines()[-1] == "epoch 5/5"
    assert "loss is NaN" in r.stderr


def test_the_demo_configuration_has_queues_and_teams_with_quotas(tmp_path):
    config = demo_config(tmp_path, "127.0.0.1:0", gpus_total=32)
    assert DaemonConfig.load(tmp_path / "trainyard.toml").cluster_name == "demo"
    policy = config.policy_config
    assert policy.queues["prod"].preempts == ("dev",)
    assert policy.queues["prod"].priority > policy.queues["dev"].priority
    teams = team_members()
    assert sorted(u for users in teams.values() for u in users) == sorted(USERS)
    for name, users in teams.items():
        quota = policy.teams[name]
        assert (quota.nominal_gpus, quota.borrowing_limit_gpus, quota.cohort) == (16, 8, "lab")
        assert sorted(quota.users) == sorted(users)
