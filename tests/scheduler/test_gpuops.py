"""GPU operations: the health gate, idle reclaim, checkpoint-aware stops and node-failure requeues."""

from __future__ import annotations

import httpx
import pytest

from scheduler.client import ApiError
from scheduler.daemon.healthgate import FAIL, PASS, SKIP, nvml_sanity
from tests.conftest import DaemonProc, current_user, wait_for


# ------------------------------------------------------------------------------ NVML sanity
def gpu(i: int, **over) -> dict:
    g = {"index": i, "off_bus": False, "remap_pending": False, "remap_failure": False,
         "ecc_dbe_volatile": 0, "sm_clock_mhz": 345, "power_w": 90.0, "power_limit_w": 700.0, "temp_c": 40}
    g.update(over)
    return g


def sample(*gpus: dict, source: str = "nvml") -> dict:
    return {"time": 0.0, "source": source, "gpus": list(gpus)}


def test_sane_gpus_pass():
    r = nvml_sanity(sample(gpu(0), gpu(1)), expected_gpus=2)
    assert (r.result, r.detail) == (PASS, "2 GPUs sane")


@pytest.mark.parametrize(("bad", "said"), [
    ({"remap_pending": True}, "GPU 1: row remap pending"),
    ({"ecc_dbe_volatile": 2}, "GPU 1: 2 uncorrected ECC errors"),
    ({"sm_clock_mhz": 0}, "GPU 1: SM clock 0 MHz"),
    ({"power_w": 900.0}, "GPU 1: power 900 W against a 700 W limit"),
    ({"off_bus": True}, "1 of 2 expected GPUs present (off the bus: 1)"),
])
def test_an_unhealthy_gpu_fails_naming_the_gpu_and_the_cause(bad, said):
    r = nvml_sanity(sample(gpu(0), gpu(1, **bad)), expected_gpus=2)
    assert r.result == FAIL and said in r.detail


def test_a_missing_gpu_fails_against_the_declared_count():
    r = nvml_sanity(sample(gpu(0), gpu(1)), expected_gpus=8)
    assert r.result == FAIL and r.detail == "2 of 8 expected GPUs present"


def test_a_node_without_nvml_is_skipped_and_says_why():
    r = nvml_sanity(sample(source="declared"), expected_gpus=4)
    assert r.result == SKIP and "no NVML telemetry (source declared)" in r.detail


# ------------------------------------------------------------------------------ the gate, end to end
def gated_daemon(daemon_factory, gate: str) -> DaemonProc:
    return daemon_factory(extra_config=f"\n[gate]\n{gate}\n")


def add_node(d: DaemonProc, node, gpus: int = 2) -> None:
    d.client().add_node({"name": node.name, "address": "127.0.0.1", "port": node.port, "user": current_user(),
                         "accept_new_host_key": True, "gpus": gpus, "gpu_model": "Test GPU",
                         "agent_dir": node.agent_dir})


def settled(c, name: str) -> dict:
    """The node once its health checks have ended."""
    return wait_for(lambda: (n := c.node(name))["health_checks"].get("status") in ("passed", "failed") and n,
                    30, what=f"health checks of {name}: {c.node(name)}")


def test_a_node_that_passes_the_gate_goes_up_and_shows_its_checks(daemon_factory, sshd_factory):
    d = gated_daemon(daemon_factory, 'test_command = ["sh", "-c", "echo all-reduce ok"]')
    node = sshd_factory("g1", d.public_key)
    add_node(d, node)
    n = settled(d.client(), "g1")
    assert n["state"] == "UP"
    checks = {c["check"]: c for c in n["health_checks"]["checks"]}
    assert checks["nvml"]["result"] == "skip"  # sshd nodes declare their GPUs: no NVML to read
    assert (checks["dcgm"]["result"], checks["dcgm"]["detail"]) == ("skip", "dcgmi is not installed on the node")
    assert checks["test job"]["result"] == "pass"
    assert n["health_checks"]["trigger"] == "node add"


def test_a_failing_test_job_keeps_the_node_drained_and_resume_refuses(daemon_factory, sshd_factory):
    d = gated_daemon(daemon_factory, 'test_command = ["sh", "-c", "echo nccl: bus bandwidth 3 GB/s; exit 3"]\n'
                                     'resume_wait = "20s"')
    node = sshd_factory("g2", d.public_key)
    add_node(d, node)
    c = d.client()
    n = settled(c, "g2")
    assert n["state"] == "DRAINED"
    assert n["reason"] == "health gate: test job failed: sh -c echo nccl: bus bandwidth 3 GB/s; exit 3: " \
                          "exit 3: nccl: bus bandwidth 3 GB/s"
    with pytest.raises(ApiError) as refused:
        c.resume_node("g2")
    assert refused.value.status == 409
    assert "failed its health check test job" in refused.value.detail and "force=true" in refused.value.detail
    assert c.node("g2")["state"] == "DRAINED"

    r = httpx.post(f"{d.url}/v1/nodes/g2/resume", params={"force": "true"},
                   headers={"Authorization": f"Bearer {d.token}"})
    assert r.status_code == 200 and r.json()["state"] == "UP"
    forced = [e for e in c.events(since=0, limit=1000) if e["action"] == "node.resume" and e["target"] == "g2"]
    assert forced[-1]["detail"]["forced"] is True and forced[-1]["detail"]["health_checks"] == "failed"
    assert forced[-1]["actor"] == "alice"


def test_a_check_that_hangs_times_out_and_the_node_stays_out(daemon_factory, sshd_factory):
    d = gated_daemon(daemon_factory, 'test_command = ["sleep", "600"]\ncheck_timeout = "1s"')
    node = sshd_factory("g3", d.public_key)
    add_node(d, node)
    n = settled(d.client(), "g3")
    assert (n["state"], n["reason"]) == ("DRAINED", "health gate: test job failed: check timed out")


def test_a_simulated_gpu_with_an_ecc_fault_fails_the_gate_until_cleared(demo_cluster):
    c = demo_cluster.client()
    assert settled(c, "node-1")["state"] == "UP"  # the demo's nodes passed the gate when they came up
    c.fault_node("node-1", 1, "ecc_dbe")
    wait_for(lambda: c.node("node-1")["state"] == "DRAINED", 15, what="health drain of node-1")
    with pytest.raises(ApiError) as refused:
        c.resume_node("node-1")
    assert refused.value.status == 409
    assert "failed its health check nvml: GPU 1: row remap pending (reset the GPU); " \
           "GPU 1: 1 uncorrected ECC error" in refused.value.detail
    n = c.node("node-1")
    assert n["state"] == "DRAINED" and n["reason"].startswith("health gate: nvml failed: GPU 1: row remap pending")
    assert n["health_checks"]["status"] == "failed"

    c.fault_node("node-1", 1, "clear")
    assert c.resume_node("node-1")["state"] == "UP"
    checks = {x["check"]: x["result"] for x in c.node("node-1")["health_checks"]["checks"]}
    assert checks == {"nvml": "pass", "dcgm": "skip"}


def test_a_pending_row_remap_alone_keeps_a_node_out_of_service():
    from scheduler.simgpu import SimulatedGpus

    gpus = SimulatedGpus(2)
    gpus.fault(0, "remap_pending")
    r = nvml_sanity({"source": "simulated", "gpus": gpus.telemetry({})}, expected_gpus=2)
    assert (r.result, r.detail) == (FAIL, "GPU 0: row remap pending (reset the GPU)")


# ------------------------------------------------------------------------------ checkpoint-aware stops
IDLE_QUEUES = {"queues": {
    "interactive": {"idle_util_pct": 5.0, "idle_minutes": 30, "idle_grace_minutes": 10},
    "batch": {"idle_minutes": 60, "idle_grace_minutes": 0, "idle_action": "requeue", "allow_opt_out": True},
}}


@pytest.fixture
def clocked(tmp_path):
    """A daemon in this process on a ManualClock; what it sends to agents is kept in `sent`."""
    from scheduler.config import DaemonConfig
    from scheduler.daemon import Daemon, ManualClock
    from scheduler.settings import Settings

    clock = ManualClock()
    d = Daemon(DaemonConfig(kill_grace_s=10.0, settings=Settings.from_toml(IDLE_QUEUES)), tmp_path / "home",
               clock=clock)
    d.prepare()
    sent: list[tuple[str, dict]] = []
    d.links.send = lambda node, msg: sent.append((node, msg)) or True  # the agents' side of the link
    yield d, clock, sent
    d.engine.dispose()


def running(d, clock, *, nodes=("n1",), limit=None, signal="", retries=0, queue="default", gpus=1) -> int:
    from scheduler import models as m
    from scheduler.models import Job, Node

    with d.store.tx() as s:
        for n in nodes:
            if s.get(Node, n) is None:
                s.add(Node(name=n, address="127.0.0.1", state=m.UP, gpus_total=8))
        job = Job(user="ann", queue=queue, command=["train.py"], gpus=gpus, nodes=len(nodes), time_limit_s=limit,
                  signal=signal, retries=retries, submit_time=clock.time(), eligible_time=clock.time(),
                  start_time=clock.time(), allocation=[{"node": n, "gpus": list(range(gpus))} for n in nodes])
        s.add(job)
        s.flush()
        d.store.set_state(s, job, m.RUNNING)
        return job.id


def events(d, job_id: int, action: str) -> list[dict]:
    from sqlmodel import select

    from scheduler.models import Event

    with d.store.read() as s:
        return [e.detail for e in s.exec(select(Event).where(Event.target == str(job_id), Event.action == action)
                                         .order_by(Event.id))]


def signals(sent, job_id: int) -> list[str]:
    return [msg["sig"] for _, msg in sent if msg.get("op") == "signal" and msg["key"].startswith(f"{job_id}.")]


@pytest.mark.parametrize(("text", "sig", "secs", "batch"), [
    ("USR1@120", "USR1", 120, False), ("B:USR1@90", "USR1", 90, True), ("SIGTERM", "TERM", 60, False),
    ("10@30", "USR1", 30, False), ("R:hup@5", "HUP", 5, False),
])
def test_slurm_signal_syntax_is_understood(text, sig, secs, batch):
    from scheduler.daemon.lifecycle import SignalSpec

    assert SignalSpec.parse(text) == SignalSpec(sig, secs, batch)


@pytest.mark.parametrize(("text", "said"), [("KILL@10", "unknown signal 'KILL'"), ("USR1@soon", "'soon' is not")])
def test_a_bad_signal_is_refused_saying_what_is_accepted(text, said):
    from scheduler.daemon.lifecycle import SignalSpec

    with pytest.raises(ValueError) as bad:
        SignalSpec.parse(text)
    assert said in str(bad.value) and "USR1" in str(bad.value)


def test_the_signal_arrives_its_seconds_before_the_time_limit_once(clocked):
    d, clock, sent = clocked
    jid = running(d, clock, limit=3600, signal="USR1@120")
    clock.advance(3600 - 121)
    d.housekeeping(clock.time())
    assert signals(sent, jid) == []
    clock.advance(1)
    d.housekeeping(clock.time())
    clock.advance(30)
    d.housekeeping(clock.time())
    assert signals(sent, jid) == ["USR1"]
    assert events(d, jid, "job.signal") == [{"sig": "USR1", "why": "time limit", "deadline": 1_700_003_600.0}]
    clock.advance(91)
    d.housekeeping(clock.time())
    assert signals(sent, jid) == ["USR1", "TERM"]  # the limit itself: SIGTERM, as before


def test_a_preempted_job_gets_its_signal_at_the_start_of_the_grace_period(clocked):
    from scheduler.models import Job

    d, clock, sent = clocked
    jid = running(d, clock, signal="USR1@60")
    with d.store.tx() as s:
        job = s.get(Job, jid)
        job.kill_grace_s = 300.0
        d.lifecycle.kill(s, job, "preempt")
    assert signals(sent, jid) == ["USR1"]  # not SIGTERM: the job checkpoints within its grace
    assert events(d, jid, "job.signal")[0] == {"sig": "USR1", "why": "preemption", "deadline": clock.time() + 300}
    clock.advance(301)
    d.housekeeping(clock.time())
    assert signals(sent, jid) == ["USR1", "KILL"]


def test_a_gang_whose_node_failed_is_requeued_with_its_id_excluding_that_node(clocked):
    from scheduler import models as m
    from scheduler.models import Job

    d, clock, sent = clocked
    d.config.node_grace_s = 30.0
    jid = running(d, clock, nodes=("n1", "n2", "n3", "n4"), retries=1)
    d.links.unreachable_since["n3"] = clock.time()
    clock.advance(31)
    d.housekeeping(clock.time())
    with d.store.read() as s:
        job = s.get(Job, jid)
        assert (job.id, job.state, job.attempt, job.exclude) == (jid, m.PENDING, 1, ["n3"])
        assert job.reason == "retry 1 of 1 after NODE_FAIL, excluding n3"
    assert sorted(n for n, msg in sent if msg.get("sig") == "KILL") == ["n1", "n2", "n4"]


# ------------------------------------------------------------------------------ idle reclaim
def telemetry(d, node: str, job_id: int, util: float, gpus: int = 2) -> None:
    """What the node's agent reports: the job's GPUs at `util` %."""
    d.on_agent_message(node, {"ev": "telemetry", "time": 0.0, "source": "simulated",
                              "gpus": [{"index": i, "job_id": job_id, "util_gpu": util} for i in range(gpus)]})


def tick(d, clock, seconds: float, node="n1", job_id=None, util=0.0, gpus=2) -> None:
    """Let `seconds` pass in one-minute samples, housekeeping after each."""
    for _ in range(int(seconds // 60)):
        clock.advance(60)
        if job_id is not None:
            telemetry(d, node, job_id, util, gpus)
        d.housekeeping(clock.time())


def state(d, job_id: int):
    from scheduler.models import Job

    with d.store.read() as s:
        j = s.get(Job, job_id)
        return j.state, j.kill_reason, j.reason


def test_an_idle_job_is_warned_then_cancelled_and_its_gpu_hours_counted(clocked):
    d, clock, sent = clocked
    reclaimed: list[tuple[str, float]] = []
    d.idle.on_reclaimed = lambda queue, hours: reclaimed.append((queue, hours))
    jid = running(d, clock, queue="interactive", gpus=2)
    telemetry(d, "n1", jid, 1.0)
    tick(d, clock, 29 * 60, job_id=jid, util=2.0)
    assert events(d, jid, "job.idle_warning") == []
    tick(d, clock, 60, job_id=jid, util=2.0)
    warning = events(d, jid, "job.idle_warning")
    assert [(w["idle_s"], w["action"]) for w in warning] == [(1800, "cancel")]
    tick(d, clock, 9 * 60, job_id=jid, util=2.0)
    assert state(d, jid)[1] == ""  # still within the grace period
    tick(d, clock, 60, job_id=jid, util=2.0)
    assert state(d, jid)[1:] == ("cancel", "cancelled: GPUs idle under 5% for 40 min "
                                           "(queue interactive reclaims idle GPUs)")
    assert signals(sent, jid) == ["TERM"]
    assert events(d, jid, "job.idle_reclaim")[0]["gpu_hours"] == pytest.approx(2 * 40 / 60, abs=1e-3)
    assert reclaimed == [("interactive", pytest.approx(2 * 40 / 60))]


def test_a_job_that_gets_busy_again_is_left_alone(clocked):
    d, clock, sent = clocked
    jid = running(d, clock, queue="interactive", gpus=2)
    telemetry(d, "n1", jid, 0.0)
    tick(d, clock, 31 * 60, job_id=jid, util=0.0)
    assert len(events(d, jid, "job.idle_warning")) == 1
    tick(d, clock, 60, job_id=jid, util=95.0)  # it started training
    tick(d, clock, 20 * 60, job_id=jid, util=0.0)  # a shorter idle stretch than 30 min
    assert state(d, jid)[1] == "" and signals(sent, jid) == []


def test_a_gang_is_idle_only_when_every_node_is(clocked):
    d, clock, sent = clocked
    jid = running(d, clock, nodes=("n1", "n2"), queue="interactive", gpus=2)
    for _ in range(50):
        clock.advance(60)
        telemetry(d, "n1", jid, 0.0)
        telemetry(d, "n2", jid, 80.0)
        d.housekeeping(clock.time())
    assert events(d, jid, "job.idle_warning") == [] and signals(sent, jid) == []


def test_requeue_policy_and_opt_out_where_the_queue_allows_it(clocked):
    from scheduler.models import Job

    d, clock, sent = clocked
    kept = running(d, clock, queue="batch", nodes=("n1",))
    requeued = running(d, clock, queue="batch", nodes=("n2",))
    with d.store.tx() as s:
        s.get(Job, kept).idle_opt_out = True
    for _ in range(61):
        clock.advance(60)
        telemetry(d, "n1", kept, 0.0)
        telemetry(d, "n2", requeued, 0.0)
        d.housekeeping(clock.time())
    assert state(d, kept)[1] == ""
    assert state(d, requeued)[1] == "requeue"
    assert events(d, requeued, "job.idle_reclaim")[0]["action"] == "requeue"


def test_opting_out_is_ignored_where_the_queue_does_not_allow_it(clocked):
    from scheduler.models import Job

    d, clock, sent = clocked
    jid = running(d, clock, queue="interactive")
    with d.store.tx() as s:
        s.get(Job, jid).idle_opt_out = True
    telemetry(d, "n1", jid, 0.0)
    tick(d, clock, 41 * 60, job_id=jid, util=0.0)
    assert state(d, jid)[1] == "cancel"


def test_idle_settings_are_checked_with_the_key_named():
    from scheduler.settings import Settings, SettingsError

    with pytest.raises(SettingsError) as bad:
        Settings.from_toml({"queues": {"q": {"idle_action": "kill"}}})
    assert "queues.q.idle_action" in str(bad.value)
