"""Time limits and grace periods with the clock injected: no test here sleeps."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from sqlmodel import select

from scheduler import models as m
from scheduler.config import DaemonConfig
from scheduler.daemon import Daemon, ManualClock
from scheduler.models import Event, Job


@pytest.fixture
def daemon(tmp_path):
    clock = ManualClock()
    d = Daemon(DaemonConfig(kill_grace_s=10.0), tmp_path / "home", clock=clock)
    d.prepare()
    yield d, clock
    d.engine.dispose()


def running_job(d: Daemon, clock: ManualClock, limit: int | None) -> int:
    """A job the daemon believes RUNNING on a node (as after an agent's `started`)."""
    with d.store.tx() as s:
        job = Job(user="ann", queue="default", command=["sleep", "1000"], gpus=1, time_limit_s=limit,
                  submit_time=clock.time(), eligible_time=clock.time(), start_time=clock.time(),
                  allocation=[{"node": "n1", "gpus": [0]}])
        s.add(job)
        s.flush()
        d.store.set_state(s, job, m.RUNNING)
        return job.id


def job(d: Daemon, job_id: int) -> SimpleNamespace:
    with d.store.read() as s:
        j = s.get(Job, job_id)
        return SimpleNamespace(state=j.state, kill_reason=j.kill_reason, kill_time=j.kill_time)


def actions(d: Daemon, job_id: int) -> list[str]:
    with d.store.read() as s:
        return [e.action for e in s.exec(select(Event).where(Event.target == str(job_id)).order_by(Event.id))]


def test_a_time_limit_stops_the_job_at_its_limit_not_before(daemon):
    d, clock = daemon
    jid = running_job(d, clock, limit=3600)
    clock.advance(3599)
    d.housekeeping(clock.time())
    assert job(d, jid).kill_reason == ""
    clock.advance(2)
    d.housekeeping(clock.time())
    stopped = job(d, jid)
    assert (stopped.kill_reason, stopped.kill_time) == ("timeout", clock.time())
    assert actions(d, jid)[-1] == "job.timeout"


def test_sigkill_follows_after_the_grace_period_and_repeats_each_period(daemon):
    d, clock = daemon
    jid = running_job(d, clock, limit=60)
    clock.advance(61)
    d.housekeeping(clock.time())
    first = job(d, jid).kill_time
    clock.advance(9)  # within kill_grace_s = 10: nothing more
    d.housekeeping(clock.time())
    assert job(d, jid).kill_time == first
    clock.advance(2)
    d.housekeeping(clock.time())
    assert job(d, jid).kill_time == clock.time()  # SIGKILL sent, and again a period later
    assert job(d, jid).state == m.RUNNING  # until the node reports the end, it still runs


def test_a_node_unreachable_past_its_grace_goes_down_and_its_jobs_end_node_fail(daemon):
    d, clock = daemon
    d.config.node_grace_s = 30.0
    with d.store.tx() as s:
        s.add(m.Node(name="n1", address="127.0.0.1", state=m.UP))
    jid = running_job(d, clock, limit=None)
    d.links.unreachable_since["n1"] = clock.time()
    clock.advance(29)
    d.housekeeping(clock.time())
    assert job(d, jid).state == m.RUNNING
    clock.advance(2)
    d.housekeeping(clock.time())
    assert job(d, jid).state == m.NODE_FAIL
    with d.store.read() as s:
        node = s.get(m.Node, "n1")
        assert node.state == m.DOWN and node.reason.startswith("unreachable for 31s")
