"""The scheduling cycle keeps the backlog's rows between cycles and re-reads only the jobs that
committed transactions changed: after any mix of submissions, holds, releases, priority and time
limit changes, cancels, starts, ends and requeues, what it plans with equals a full read."""

from __future__ import annotations

import random

import pytest
from sqlmodel import select

from scheduler import models as m
from scheduler.config import DaemonConfig
from scheduler.daemon import Daemon, ManualClock
from scheduler.daemon.caller import Caller
from scheduler.daemon.errors import DomainError
from scheduler.daemon.jobs import JobRequest
from scheduler.daemon.lifecycle import RankExit
from scheduler.daemon.scheduling import SchedulingCycle
from scheduler.models import Job, Node
from scheduler.planner import plan
from scheduler.planner.changes import Views
from scheduler.planner.fairshare import UsageLedger
from scheduler.planner.ordering import PendingOrder

ADMIN = Caller("root", "admin")


def make_daemon(home, gpus_per_node: int = 4) -> tuple[Daemon, ManualClock]:
    """A daemon with three UP nodes that have no agents: their rows are what counts here."""
    clock = ManualClock()
    d = Daemon(DaemonConfig(), home, clock=clock)
    d.prepare()
    d.links.connected = lambda name: True
    with d.store.tx() as s:
        for i in range(3):
            s.add(Node(name=f"n{i}", address="127.0.0.1", state=m.UP, gpus_total=gpus_per_node,
                       gpu_indices=list(range(gpus_per_node)), cpus=32, mem_mb=64000))
    return d, clock


@pytest.fixture
def daemon(tmp_path):
    d, clock = make_daemon(tmp_path / "home")
    yield d, clock
    d.engine.dispose()


def planned(cycle: SchedulingCycle, d: Daemon, now: float):
    """What a cycle plans with: the pending views (ids, requests) and the active ones."""
    with d.store.tx() as s:
        snap, rows = cycle.snapshot(s, now)
    if snap is None:
        return None
    # in no particular order: the planner orders them (tests/planner/test_kept_state.py)
    return (sorted((v.id, v.priority, v.held, v.nice, v.time_limit_s, v.gpus) for v in snap.pending),
            dict(rows), dict(snap.finished), sorted((v.id, v.start_time, v.allocation, v.preempted_at) for v in snap.running),
            [(n.name, n.free_gpus, n.schedulable, n.labels) for n in snap.nodes])


def fresh(d: Daemon, now: float):
    c = SchedulingCycle(d.store, d.links, d.health, d.lifecycle, d.dispatcher, d.clock, d.policy,
                        d.ledger, 1.0, d.metrics)
    c.store = _NoChanges(d.store)
    return planned(c, d, now)


class _NoChanges:
    """The store as a brand-new cycle sees it (a full read), without taking the live cycle's
    pending changes away from it."""

    def __init__(self, store):
        self._store = store

    def take_changed_jobs(self) -> set[int]:
        return set()

    def __getattr__(self, name):
        return getattr(self._store, name)


def start(d: Daemon, clock: ManualClock, job_id: int) -> None:
    """What the cycle and the agent's `started` do, without a node: the job RUNNING on n1."""
    with d.store.tx() as s:
        job = s.get(Job, job_id)
        job.allocation = [{"node": "n1", "gpus": [0]}]
        job.start_time = clock.time()
        d.store.set_state(s, job, m.CONFIGURING, "")
        d.store.set_state(s, job, m.RUNNING, "")


def end(d: Daemon, job_id: int, rc: int) -> None:
    with d.store.tx() as s:
        job = s.get(Job, job_id)
        d.lifecycle.finish(s, job, {"n1": RankExit(rc)})


OPS = ("submit", "submit", "array", "hold", "release", "priority", "limit", "cancel", "start", "end",
       "requeue", "cycle", "node", "begin", "after")


def churn(d: Daemon, clock: ManualClock, rng: random.Random, ids: list[int]) -> str:
    """One random change of the kind users, operators and agents make; its name."""
    clock.advance(rng.uniform(0.1, 5))
    op = rng.choice(OPS)
    try:
        if op == "submit" or not ids:
            ids.append(d.jobs.submit(ADMIN, JobRequest(command=["true"], gpus=rng.randint(0, 2),
                                                       time_limit_s=rng.choice((None, 600))))["id"])
        elif op == "begin":  # sbatch --begin: not a candidate (BeginTime) until then
            ids.append(d.jobs.submit(ADMIN, JobRequest(command=["true"], gpus=1,
                                                       slurm={"begin": clock.time() + rng.uniform(1, 30)}))["id"])
        elif op == "after":  # --dependency=afterok:ID
            ids.append(d.jobs.submit(ADMIN, JobRequest(command=["true"], gpus=1,
                                                       dependency=f"afterok:{rng.choice(ids)}"))["id"])
        elif op == "array":
            d.jobs.submit(ADMIN, JobRequest(command=["true"], array="0-3%2"))
            with d.store.read() as s:
                ids[:] = [j.id for j in s.exec(select(Job)).all()]
        elif op in ("hold", "release", "cancel", "requeue"):
            d.jobs.act(ADMIN, rng.choice(ids), op)
        elif op == "priority":
            d.jobs.set_priority(ADMIN, rng.choice(ids), rng.randint(0, 100))
        elif op == "limit":
            d.jobs.set_time_limit(ADMIN, rng.choice(ids), rng.choice((60, 3600)))
        elif op == "node":  # an operator drains a node, or it comes back
            with d.store.tx() as s:
                node = s.get(Node, f"n{rng.randint(0, 2)}")
                node.state = m.DRAINED if node.state == m.UP else m.UP
                node.labels = {"rack": str(rng.randint(1, 3))}
                s.add(node)
        elif op == "start":
            with d.store.read() as s:
                waiting = [j.id for j in s.exec(select(Job).where(Job.state == m.PENDING, Job.held == ""))]
            if waiting:
                start(d, clock, rng.choice(waiting))
        elif op == "end":
            with d.store.read() as s:
                running = [j.id for j in s.exec(select(Job).where(Job.state == m.RUNNING))]
            if running:
                end(d, rng.choice(running), rng.choice((0, 1)))
        else:
            d.cycle.run_once()
    except DomainError:
        pass  # e.g. releasing a job that is not held: refused, and nothing changed
    return op


def test_the_kept_backlog_equals_a_full_read_after_every_kind_of_change(daemon):
    d, clock = daemon
    rng = random.Random(7)
    ids: list[int] = []
    for step in range(400):
        op = churn(d, clock, rng, ids)
        if step % 3 == 0:
            now = clock.time()
            assert planned(d.cycle, d, now) == fresh(d, now), f"after step {step} ({op})"
    with d.store.read() as s:
        states = {j.state for j in s.exec(select(Job)).all()}
        begun = s.exec(select(Job).where(Job.eligible_time > Job.submit_time)).all()
        dependent = s.exec(select(Job).where(Job.dependency != "")).all()
    assert {m.PENDING, m.RUNNING} <= states and len(ids) > 50  # the mix reached every kind of row
    assert begun, "some jobs waited for their --begin or a requeue"
    assert dependent, "some jobs depended on others"


def test_each_snapshot_says_exactly_what_came_and_went_and_planning_from_that_decides_as_from_nothing(daemon):
    """The cycle hands the planner its pending and running views as `Views` that say which
    views came and went since its previous snapshot, so that what the planner keeps between
    passes follows the changes, not the backlog. The lists must be exact, and a planner state
    kept from them must decide as a fresh one."""
    d, clock = daemon
    rng = random.Random(11)
    ids: list[int] = []
    memo = PendingOrder()  # fed only this test's snapshots: the delta path, pass after pass
    last: dict[str, Views] = {}
    followed = 0
    for step in range(400):
        op = churn(d, clock, rng, ids)
        now = clock.time()
        with d.store.tx() as s:
            snap, _ = d.cycle.snapshot(s, now)
        if snap is None:
            continue
        for kind, views in (("pending", snap.pending), ("running", snap.running)):
            assert isinstance(views, Views)
            prev = last.get(kind)
            if prev is not None and views.base == prev.serial:
                before, after = {id(v) for v in prev}, {id(v) for v in views}
                gone, new = {id(v) for v in views.gone}, {id(v) for v in views.new}
                assert gone == before - after, f"{kind} after step {step} ({op}): what went"
                assert new == after - before, f"{kind} after step {step} ({op}): what came"
                followed += 1
            last[kind] = views
        assert plan(snap, now, d.policy, memo) == plan(snap, now, d.policy), f"after step {step} ({op})"
        usage = d.ledger.decayed(now, snap.running, d.policy.team_of)  # followed by its changes
        cold = UsageLedger(d.ledger.half_life_s)  # the same charges, nothing kept of running jobs
        cold._ref, cold._value = d.ledger._ref, dict(d.ledger._value)
        assert cold.decayed(now, tuple(snap.running), d.policy.team_of) == pytest.approx(usage)
    assert followed > 200  # most snapshots were read as changes of the one before


def reasons(d: Daemon) -> dict[int, tuple]:
    with d.store.read() as s:
        return {j.id: (j.state, j.reason, j.estimated_start)
                for j in s.exec(select(Job).where(Job.state.in_((m.PENDING, m.CANCELLED))))}


def test_a_long_backlogs_waits_are_built_off_the_loop_and_keep_what_users_did_meanwhile(daemon, monkeypatch):
    import asyncio

    import scheduler.daemon.scheduling as scheduling

    monkeypatch.setattr(scheduling, "LONG_BACKLOG", 5)
    d, clock = daemon
    d.dispatcher.dispatch = lambda job: None
    ids = [d.jobs.submit(ADMIN, JobRequest(command=["true"], gpus=4, time_limit_s=600))["id"]
           for _ in range(12)]
    # the daemon's loop: the cycle starts what fits and leaves the waits to be built
    assert d.cycle.run_once(waits_later=True) == 3
    assert d.cycle.waits_pending is not None
    before = reasons(d)
    assert all(est is None for _, _, est in before.values()), "no estimate is written in the cycle"
    # meanwhile a user holds one pending job and cancels another
    held, cancelled = ids[5], ids[6]
    d.jobs.act(ADMIN, held, "hold")
    d.jobs.act(ADMIN, cancelled, "cancel")
    asyncio.run(d.cycle.write_waits())
    after = reasons(d)
    assert d.cycle.waits_pending is None
    waiting = [j for j in ids[3:] if j not in (held, cancelled)]
    assert after[waiting[0]][1] == "Resources"  # the first in line; those behind it: Priority
    assert {after[j][1] for j in waiting[1:]} == {"Priority"}
    assert after[waiting[0]][2] is not None, "the first in line has an estimated start"
    assert after[held][:2] == (m.PENDING, m.HELD_ADMIN), "the (operator's) hold's reason is kept"
    assert after[cancelled][0] == m.CANCELLED and after[cancelled][2] is None
    # within WAITS_EVERY_S the next cycles leave the waits alone; after it, they are built again
    clock.advance(1)
    d.cycle.run_once(waits_later=True)
    assert d.cycle.waits_pending is None
    clock.advance(scheduling.WAITS_EVERY_S)
    d.cycle.run_once(waits_later=True)
    assert d.cycle.waits_pending is not None
    # the kept rows agree with the database after the write: a full read plans the same
    asyncio.run(d.cycle.write_waits())
    assert planned(d.cycle, d, clock.time()) == fresh(d, clock.time())


def _pending_words(d: Daemon) -> dict[int, tuple]:
    with d.store.read() as s:
        return {j.id: (j.reason, j.reason_detail, j.estimated_start)
                for j in s.exec(select(Job).where(Job.state == m.PENDING))}


def test_in_the_loop_reasons_are_written_each_cycle_and_their_words_and_estimates_each_second(daemon):
    """The words of a Priority wait name the job at the head of the queue, and estimates move with
    every start and end: rewritten each cycle, every pending job's row was written each cycle."""
    import scheduler.daemon.scheduling as scheduling

    d, clock = daemon
    d.dispatcher.dispatch = lambda job: None
    ids = [d.jobs.submit(ADMIN, JobRequest(command=["true"], gpus=4, time_limit_s=600))["id"]
           for _ in range(8)]
    assert d.cycle.run_once(waits_later=True) == 3  # 3 nodes of 4 GPUs
    first = _pending_words(d)
    head = ids[3]
    assert first[head][0] == "Resources" and first[ids[4]][:2] == ("Priority", f"queue default waits for job {head} first")
    assert first[head][2] is not None
    # the head job is cancelled: the next one heads the queue (a new reason), the words of the
    # jobs behind it change, and so do the estimates
    d.jobs.act(ADMIN, head, "cancel")
    clock.advance(0.2)
    d.cycle.run_once(waits_later=True)
    now = _pending_words(d)
    assert now[ids[4]][0] == "Resources" and now[ids[4]][2] is not None, "a new reason is written at once"
    assert now[ids[5]] == first[ids[5]], "words alone wait for the next second"
    clock.advance(scheduling.ESTIMATES_EVERY_S)
    d.cycle.run_once(waits_later=True)
    assert _pending_words(d)[ids[5]][:2] == ("Priority", f"queue default waits for job {ids[4]} first")
    # outside the loop (scontrol, tests) a cycle writes everything
    d.jobs.act(ADMIN, ids[4], "cancel")
    d.cycle.run_once()
    assert _pending_words(d)[ids[6]][:2] == ("Priority", f"queue default waits for job {ids[5]} first")
    assert planned(d.cycle, d, clock.time()) == fresh(d, clock.time())


def test_in_the_loop_a_middling_backlogs_reasons_are_written_every_quarter_second(daemon, monkeypatch):
    """Above REASONS_EVERY_CYCLE pending jobs the daemon's loop works the reasons out at most every
    REASONS_EVERY_S (a cycle every few milliseconds rebuilt all of them each time); a cycle run
    outside the loop still writes them at once. The pass that also refreshes every estimated
    start (each ESTIMATES_EVERY_S) is written after the cycle, in pieces, as the loop does."""
    import asyncio

    import scheduler.daemon.scheduling as scheduling

    def loop_cycle() -> int:
        started = d.cycle.run_once(waits_later=True)
        if d.cycle.waits_pending is not None:
            asyncio.run(d.cycle.write_waits())
        return started

    monkeypatch.setattr(scheduling, "REASONS_EVERY_CYCLE", 3)
    d, clock = daemon
    d.dispatcher.dispatch = lambda job: None
    ids = [d.jobs.submit(ADMIN, JobRequest(command=["true"], gpus=4, time_limit_s=600))["id"]
           for _ in range(9)]
    assert d.cycle.run_once(waits_later=True) == 3  # 3 nodes of 4 GPUs; 6 wait
    assert d.cycle.waits_pending is not None, "the first pass's estimates are written after the cycle"
    asyncio.run(d.cycle.write_waits())
    head = ids[3]
    assert _pending_words(d)[head][0] == "Resources" and _pending_words(d)[ids[4]][0] == "Priority"
    d.jobs.act(ADMIN, head, "cancel")
    clock.advance(scheduling.REASONS_EVERY_S / 2)
    loop_cycle()
    assert _pending_words(d)[ids[4]][0] == "Priority", "within the quarter second the reasons wait"
    clock.advance(scheduling.REASONS_EVERY_S / 2)
    loop_cycle()
    assert _pending_words(d)[ids[4]][0] == "Resources", "the next cycle after it writes them"
    d.jobs.act(ADMIN, ids[4], "cancel")
    d.cycle.run_once()  # outside the loop (scontrol, tests): at once
    assert _pending_words(d)[ids[5]][0] == "Resources"
    assert planned(d.cycle, d, clock.time()) == fresh(d, clock.time())


def test_a_cycle_reads_and_writes_what_changed_not_the_backlog(tmp_path, monkeypatch):
    """With 50 or 1,000 jobs waiting, the cycle after one more submission runs as many
    statements and decodes one job: the backlog is kept between cycles, not read again."""
    from sqlalchemy import event

    import scheduler.daemon.scheduling as scheduling

    decoded = []
    real = scheduling.job_view
    monkeypatch.setattr(scheduling, "job_view", lambda r: decoded.append(r) or real(r))

    def cost(base, backlog: int) -> tuple[int, int]:
        d, clock = make_daemon(base / "home")
        d.dispatcher.dispatch = lambda job: None
        for _ in range(backlog):  # each takes the whole cluster: one runs, the backlog waits
            d.jobs.submit(ADMIN, JobRequest(command=["true"], gpus=4, nodes=3))
        d.cycle.run_once(waits_later=True)
        clock.advance(5)
        d.cycle.run_once(waits_later=True)  # the reasons are written: nothing changes any more
        d.jobs.submit(ADMIN, JobRequest(command=["true"], gpus=4, nodes=3))
        clock.advance(scheduling.REASONS_EVERY_S)  # the new job's reason is due in both
        statements = []

        def seen(conn, cursor, statement, params, context, executemany):
            statements.append(statement)

        decoded.clear()
        event.listen(d.engine, "before_cursor_execute", seen)
        try:
            d.cycle.run_once(waits_later=True)
        finally:
            event.remove(d.engine, "before_cursor_execute", seen)
        with d.store.tx() as s:
            assert len(d.cycle.snapshot(s, clock.time())[0].pending) == backlog
        d.engine.dispose()
        return len(statements), len(decoded)

    few, many = cost(tmp_path / "few", 50), cost(tmp_path / "many", 1000)
    assert few == many and few[1] == 1, (few, many)


def _job_reads(d: Daemon, fn) -> int:
    """How many statements that read the job table `fn` runs."""
    from sqlalchemy import event

    seen = []

    def count(conn, cursor, statement, params, context, executemany):
        if statement.lstrip().upper().startswith("SELECT") and " job" in statement.lower():
            seen.append(statement)

    event.listen(d.engine, "before_cursor_execute", count)
    try:
        fn()
    finally:
        event.remove(d.engine, "before_cursor_execute", count)
    return len(seen)



def _reads_for(base, gpus_per_node: int) -> dict[str, int]:
    """Job-table reads of a cycle that starts 3 x gpus_per_node jobs, and of one batch of the
    agents' `started` and `exited` reports for them."""
    import asyncio

    d, clock = make_daemon(base / "home", gpus_per_node)
    d.dispatcher.dispatch = lambda job: None  # no agents here: the launches go nowhere
    count = 3 * gpus_per_node
    first = [d.jobs.submit(ADMIN, JobRequest(command=["true"], gpus=1))["id"] for _ in range(count)]
    d.cycle.run_once()  # the first cycle reads everything whole
    more = [d.jobs.submit(ADMIN, JobRequest(command=["true"], gpus=1))["id"] for _ in range(count)]
    with d.store.tx() as s:  # the first ones end: their GPUs go to the next ones
        for j in d.store.load_jobs(s, first).values():
            j.end_time = clock.time()
            d.store.set_state(s, j, m.COMPLETED, "")
    reads = {"cycle": _job_reads(d, d.cycle.run_once)}
    with d.store.tx() as s:
        assert {j.id: j.state for j in d.store.load_jobs(s, more).values()} == dict.fromkeys(more, m.CONFIGURING)

    async def reports():  # what arrives in one turn of the event loop is committed together
        for jid in more:
            node = d.store.active.nodes_of[jid][0]
            d.reconciler.on_started(node, f"{jid}.0")
            d.reconciler.on_exited(node, f"{jid}.0", RankExit(rc=0), clock.time())
        await asyncio.sleep(0)

    reads["reports"] = _job_reads(d, lambda: asyncio.run(reports()))
    with d.store.tx() as s:
        assert {j.state for j in d.store.load_jobs(s, more).values()} == {m.COMPLETED}
    d.engine.dispose()
    return reads


def test_a_cycle_and_a_batch_of_agent_reports_read_their_jobs_at_once_however_many(tmp_path):
    """Starting 3 or 12 jobs, and taking the ends of 3 or 12, reads the job table as often: the
    jobs are read together, not with a SELECT each (each of which flushed the change before)."""
    few, many = _reads_for(tmp_path / "few", 1), _reads_for(tmp_path / "many", 4)
    assert few == many, (few, many)
