"""What a caller keeps between passes (pending order, running jobs' ends, node table) never
changes a decision: a long run of passes over views that persist, as a replay and the daemon
hand them over, decides exactly as passes that start from nothing, and the order in which the
views come does not matter either."""

import random
from dataclasses import replace

import pytest
from planner_helpers import job

from scheduler.planner import NodeView, PolicyConfig, Snapshot, plan
from scheduler.planner.changes import Views
from scheduler.planner.fairshare import UsageLedger
from scheduler.planner.ordering import PendingOrder
from scheduler.planner.policy import SIMULATION_PRESETS


def _views(jobs: tuple, last: Views | None) -> Views:
    """`jobs` as the daemon hands them over: saying which views came and went since `last`."""
    if last is None:
        return Views.of(jobs)
    before, after = {id(v) for v in last}, {id(v) for v in jobs}
    return Views.of(jobs, last.serial, [v for v in jobs if id(v) not in before],
                    [v for v in last if id(v) not in after])


def _replay(preset: str, steps: int, seed: int, as_views: bool = False) -> tuple[int, int, int]:
    """Drive `steps` passes like a replay: views are kept and replaced only when their job or
    node changes. Every pass is planned twice, warm and cold, and the two must be equal
    (starts, preemptions, waits with their reasons and estimates, cancellations). With
    `as_views`, the warm pass gets them as `Views` that say what changed (as from the daemon)."""
    last_pending = last_running = None
    rng = random.Random(seed)
    mix = random.Random(seed + 1)  # its own, so that the replay is the one it was
    policy = PolicyConfig.preset(preset)
    memo = PendingOrder()
    ledger = UsageLedger(3600.0)
    nodes = {f"n{i}": NodeView(f"n{i}", 8, tuple(range(8))) for i in range(4)}
    free = {name: list(range(8)) for name in nodes}
    pending: dict[int, object] = {}
    running: dict[int, object] = {}
    ends: dict[int, float] = {}
    next_id = 1
    started = preempted = 0
    for step in range(steps):
        now = float(step * 60)
        for _ in range(rng.randint(0, 2)):
            gpus = rng.choice([1, 1, 2, 4, 8, 8])
            limit = rng.choice([120.0, 600.0, 3600.0])
            pending[next_id] = job(
                next_id, gpus=gpus, user=rng.choice(["ann", "bob", "cy", "dee"]),
                nodes=rng.choice([1, 1, 1, 2]) if gpus == 8 else 1, submit_time=now,
                time_limit_s=limit, account=rng.choice(["vision", "speech"]),
                predicted_runtime_s=rng.choice([None, limit / 2]),
                attained_gpu_s=rng.choice([0.0, 0.0, 4000.0, 40000.0]))
            next_id += 1
        for jid in [j for j, t in ends.items() if t <= now]:  # finished, or done leaving
            view = running.pop(jid)
            del ends[jid]
            for name, gpus in view.allocation:
                free[name] = sorted(free[name] + list(gpus))
                nodes[name] = replace(nodes[name], free_gpus=tuple(free[name]))
            ledger.charge_run(view.user, view.account, view.gpus * view.nodes,
                              view.start_time, now)
        pending_now, running_now = tuple(pending.values()), tuple(running.values())
        if as_views:
            pending_now = last_pending = _views(pending_now, last_pending)
            running_now = last_running = _views(running_now, last_running)
        usage = ledger.decayed(now, running_now)
        s = Snapshot(tuple(nodes.values()), pending_now, running_now, usage=usage)
        warm = plan(s, now, policy, memo)
        cold = plan(Snapshot(s.nodes, tuple(s.pending), tuple(s.running), usage=usage), now, policy)
        assert warm == cold, f"{preset}: pass {step} differs with a kept state"
        # the daemon hands its views over in no particular order (kept by id, not sorted)
        mixed = Snapshot(s.nodes, tuple(mix.sample(s.pending, len(s.pending))),
                         tuple(mix.sample(s.running, len(s.running))), usage=usage)
        assert plan(mixed, now, policy) == cold, f"{preset}: pass {step} depends on the views' order"
        for st in warm.starts:
            view = pending.pop(st.job_id)
            for name, gpus in st.allocation:
                free[name] = [g for g in free[name] if g not in gpus]
                nodes[name] = replace(nodes[name], free_gpus=tuple(free[name]))
            running[st.job_id] = replace(view, start_time=now, allocation=st.allocation)
            ends[st.job_id] = now + rng.choice([60.0, 300.0, 900.0, 3600.0])
            started += 1
        for p in warm.preempts:
            view = running[p.job_id]
            running[p.job_id] = replace(view, preempted_at=now)
            ends[p.job_id] = min(ends[p.job_id], now + p.grace_period_s)
            preempted += 1
    return started, preempted, len(pending)


@pytest.mark.parametrize("as_views", [False, True], ids=["tuples", "views-with-changes"])
@pytest.mark.parametrize("preset", SIMULATION_PRESETS)
def test_a_kept_state_decides_as_a_fresh_one_pass_after_pass(preset, as_views):
    started, preempted, backlog = _replay(preset, steps=150, seed=11, as_views=as_views)
    # the comparison covered real decisions: starts, a backlog (waits, reservations) and,
    # where the policy preempts, preemptions
    assert started >= 40 and backlog >= 20
    if preset in ("las", "las-budget", "oracle"):
        assert preempted > 0
