"""One planner pass: order pending jobs, gate them (held, stopped, dependency, array, quota),
place gangs, reserve for the top blocked job (EASY backfill), and preempt where a policy allows.

Work per pass follows what can change, not the backlog: once every queue is blocked (a strict
queue's top job, or `queue_depth` jobs tried behind it), the pass stops, and the waits of the
jobs it did not reach are built only when they are read.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass

from .backfill import Releases, reserve
from .dependencies import NEVER, WAITING, dependency_status, is_singleton
from .ordering import PendingOrder
from .placement import INF, ClusterState, eligibility
from .policy import PolicyConfig
from .preemption import VictimIndex, choose_victims
from .priority import (
    attained,
    las_level,
    order_key,
    order_runs,
    remaining_service,
    runtime_estimate,
)
from .quota import QuotaBook, job_gpus
from .types import (
    ARRAY_TASK_LIMIT,
    BAD_CONSTRAINT,
    DEPENDENCY,
    DEPENDENCY_NEVER_SATISFIED,
    HELD,
    PRIORITY,
    QUEUE_STOPPED,
    QUOTA_LIMIT,
    REQ_NODE_NOT_AVAIL,
    RESOURCES,
    Decisions,
    JobView,
    Preempt,
    Snapshot,
    Start,
    Wait,
)

DEFAULT_POLICY = PolicyConfig()


@dataclass(frozen=True, slots=True)
class QueueRules:
    open: bool
    default_limit: float | None
    max_limit: float | None
    selector: tuple


def _queue_rules(snapshot: Snapshot, policy: PolicyConfig, name: str) -> QueueRules:
    qp = policy.queue(name)
    qv = snapshot.queues.get(name)
    default = qv.default_time_limit_s if qv is not None else None
    if default is None:
        default = qp.default_time_limit_s
    if default is None:
        default = policy.default_time_limit_s
    max_limit = qv.max_time_limit_s if qv is not None else None
    if max_limit is None:
        max_limit = qp.max_time_limit_s
    return QueueRules(qv.open if qv is not None else qp.open, default, max_limit,
                      qp.node_selector)


def time_limit(job: JobView, rules: QueueRules) -> float | None:
    """The job's own limit, else its queue's default; never above the queue's maximum."""
    limit = job.time_limit_s if job.time_limit_s is not None else rules.default_limit
    if limit is not None and rules.max_limit is not None:
        limit = min(limit, rules.max_limit)
    return limit


def plan(snapshot: Snapshot, now: float, policy: PolicyConfig | None = None,
         order: PendingOrder | None = None) -> Decisions:
    """Decide which pending jobs start now, which running jobs are preempted, and why the rest
    wait. Pure: no I/O, no clock reads; the same snapshot, time and policy give the same answer.

    `order` is a cache of the pending jobs' order that a caller planning again and again (the
    daemon's cycle, a replay) keeps between passes: it saves re-sorting the backlog and never
    changes a decision.
    """
    return _Pass(snapshot, now, policy or DEFAULT_POLICY,
                 order if order is not None else PendingOrder()).run()


class _Pass:
    def __init__(self, snapshot: Snapshot, now: float, policy: PolicyConfig,
                 order: PendingOrder):
        self.order = order
        self.s = snapshot
        self.now = now
        self.policy = policy
        self.d = Decisions()
        self.team_of = policy.team_of
        self.state = ClusterState(snapshot.nodes, snapshot.running, order.nodes)
        self.rules: dict[str, QueueRules] = {}
        self.releases: Releases | None = None
        self.started: list[tuple[float, tuple, bool]] = []  # (end, allocation, exclusive)
        # what the teams' pending jobs ask for is read only if a job would borrow (QuotaBook.asked_of);
        # a stopped queue's jobs ask for nothing
        self.quota = QuotaBook(policy, snapshot.running, self.team_of, (
            j for j in snapshot.pending if self.queue_rules(j.queue).open)) if policy.teams else None
        self.victims: VictimIndex | None = None
        self.claimed: set[int] = set()
        self.preemptors = 0
        self.soon: dict[str, int] | None = None  # GPUs on their way back from preempted jobs
        self.levels: dict[int, int] = {}
        self.verdicts: dict[tuple, dict[int, bool]] = {}
        # waits are recorded as (job id, reason, estimate, detail) and become Wait objects
        # when `waits` is first read (a replay never reads them); `out` is where wait()
        # writes: the pass's own records, or a deferred batch
        self.records: list[tuple] = []
        self.out = self.records
        self.d.defer_waits(self.recorded_waits)
        # built on first use (most passes gate no dependency, singleton or array limit)
        self._running_ids: set[int] | None = None
        self._singletons: set[tuple[str, str]] | None = None
        self._array_running: Counter | None = None
        self.started_jobs: list[JobView] = []
        self.never: dict[tuple, bool] = {}
        self.plain_keys: dict[str, tuple] = {}  # queue -> eligibility of unconstrained jobs
        self.remaining: dict[int, float] = {}  # running job -> service left (SRSF)
        self.leaving_eta: float | None = None  # when GPUs of jobs being preempted are back
        self.net: dict[int, float] = {}  # running job -> service left net of its grace period
        self.srsf_failed: dict[tuple, float] = {}  # gang shape -> least need that found no victims
        self.las_failed: dict[tuple, int] = {}  # gang shape -> lowest LAS level that found none
        self.order_victims: VictimIndex | None = None  # only jobs the order alone may evict
        self.order_bound: float | None = None  # ranks it holds are below this (None: all)

    @property
    def running_ids(self) -> set[int]:
        if self._running_ids is None:
            self._running_ids = {j.id for j in self.s.running}
        return self._running_ids

    @property
    def singletons(self) -> set[tuple[str, str]]:
        """(user, name) of every running job, and of those started in this pass."""
        if self._singletons is None:
            self._singletons = {(j.user, j.name) for j in (*self.s.running, *self.started_jobs)}
        return self._singletons

    @property
    def array_running(self) -> Counter:
        """Array parent -> its running tasks, counting those started in this pass."""
        if self._array_running is None:
            self._array_running = Counter(j.array_parent for j in (*self.s.running,
                                                                   *self.started_jobs)
                                          if j.array_parent is not None)
        return self._array_running

    def queue_rules(self, name: str) -> QueueRules:
        r = self.rules.get(name)
        if r is None:
            r = self.rules[name] = _queue_rules(self.s, self.policy, name)
        return r

    def runtime(self, job: JobView, rules: QueueRules) -> float | None:
        """How long the job is expected to run: its limit, or its prediction where lower."""
        limit = time_limit(job, rules)
        pred = job.predicted_runtime_s
        if pred is not None and self.policy.backfill_on_prediction:
            # the prediction is for the whole job; earlier runs have done part of it
            pred = max(1.0, pred - job.attained_gpu_s / max(1, job.gpus * job.nodes))
            return pred if limit is None else min(pred, limit)
        return limit

    def raw_end(self, job: JobView) -> float:
        """When a running job is expected to give its GPUs back (INF: never counted on), before
        clamping to now: its start plus its expected run time, or the end of its grace period."""
        limit = self.runtime(job, self.queue_rules(job.queue))
        end = INF if limit is None or job.start_time is None else job.start_time + limit
        if job.preempted_at is not None:
            end = min(end, job.preempted_at + self.policy.grace_for(job))
        return end

    def expected_end(self, job: JobView) -> float:
        return max(self.raw_end(job), self.now)

    def get_releases(self) -> Releases:
        if self.releases is None:
            s = self.s
            # expected ends follow from the views, the policy and the queues' rules alone:
            # the caller's cache keeps them between passes, sorted
            ends = self.order.ends
            sig = (self.policy, tuple(sorted(s.queues.items())))
            events = ends.events(s.running, sig, self.now, self.raw_end)
            extra = []
            hidden = self.state.hidden
            for job in ends.exclusive.values():
                end = self.expected_end(job)
                if end != INF:
                    extra += [(end, name, len(gpus) + hidden.get(name, 0))
                              for name, gpus in job.allocation]
            for end, allocation, _exclusive in self.started:
                if end != INF:
                    extra += [(end, name, len(gpus)) for name, gpus in allocation]
            r = Releases()
            r.events = sorted(events + extra) if extra else events
            self.releases = r
        return self.releases

    def wait(self, job: JobView, reason: str, detail: str = "", estimate: float | None = None):
        self.out.append((job.id, reason, estimate, detail))

    def recorded_waits(self) -> list[Wait]:
        return [Wait(*r) for r in self.records]

    def gate(self, job: JobView, rules: QueueRules):
        """Wait (or cancel) a job that a gate stops and return None; else (pool, shape, ekey)."""
        s = self.s
        if job.held:
            self.wait(job, HELD, "held by a user or operator")
            return None
        if not rules.open:
            self.wait(job, QUEUE_STOPPED, f"queue {job.queue} is stopped")
            return None
        if job.dependency:
            status, detail = dependency_status(job, s.finished, self.running_ids)
            if status == NEVER:
                self.d.cancels.append(Wait(job.id, DEPENDENCY_NEVER_SATISFIED, None, detail))
                return None
            if status == WAITING:
                self.wait(job, DEPENDENCY, detail)
                return None
            if is_singleton(job) and (job.user, job.name) in self.singletons:
                self.wait(job, DEPENDENCY,
                          f"singleton: a job named {job.name!r} of {job.user} is running")
                return None
        parent = job.array_parent
        if parent is not None and job.array_limit and \
                self.array_running[parent] >= job.array_limit:
            self.wait(job, ARRAY_TASK_LIMIT,
                      f"array {parent} already runs {self.array_running[parent]} of at most "
                      f"{job.array_limit} tasks at once")
            return None
        if job.constraint or job.gpu_type or job.features or job.nodelist or job.exclude:
            ekey = eligibility(job, rules.selector)
        else:
            ekey = self.plain_keys.get(job.queue)
            if ekey is None:
                ekey = self.plain_keys[job.queue] = eligibility(job, rules.selector)
        pool = self.state.pool(ekey)
        shape = (ekey, job.gpus, job.nodes, job.exclusive)
        ok = self.never.get(shape)
        if ok is None:
            ok = self.never[shape] = pool.could_ever_fit(job.gpus, job.nodes)
        if not ok:
            self.wait(job, *no_nodes_reason(job, rules.selector))
            return None
        return pool, shape

    def behind(self, job: JobView, rules: QueueRules, blocker: int) -> None:
        """A job of a queue whose top job is blocked: its gate's reason, else Priority."""
        if self.gate(job, rules) is not None:
            self.wait(job, PRIORITY, f"queue {job.queue} waits for job {blocker} first")

    def deferred(self, jobs: list[JobView], rest: list[list[tuple]], closed: dict[str, int]):
        """The waits of jobs the pass did not try, built when read (dependent ones are not
        here: their gates may cancel them, so they were decided in the pass)."""
        def build() -> list[Wait]:
            self.out = batch = []
            for job in jobs:
                self.behind(job, self.queue_rules(job.queue), closed[job.queue])
            for run in rest:
                for entry in run:
                    job = entry[-1]
                    if not job.dependency:
                        self.behind(job, self.queue_rules(job.queue), closed[job.queue])
            return [Wait(*r) for r in batch]
        return build

    def run(self) -> Decisions:
        s, now, policy, state = self.s, self.now, self.policy, self.state
        memo = self.order
        sig, class_of, seq_of, full_key = order_runs(policy, s.queues)
        memo.sync(s.pending, sig, class_of, seq_of)
        key = None
        if full_key:
            cluster_gpus = sum(n.gpus_total for n in s.nodes if n.schedulable)
            key = order_key(policy, s.queues, now, s.usage, cluster_gpus,
                            memo.representatives(), self.team_of)
        order = memo.ordered(key)

        strict = not policy.backfill and policy.queueing == "strict"
        held_up: dict[str, int] = {}  # queue -> its top blocked job (that got no remedy)
        behind_top: dict[str, str] = {}  # queue -> why the jobs behind that one wait
        plain_pools: dict[str, tuple] = {}  # queue -> (eligibility, pool) of unconstrained jobs
        never = self.never
        by_prediction = policy.backfill_on_prediction
        unpromised: set[str] = set()  # queues whose top job got no reservation: hold them
        # queue -> the job it waits for: nothing behind it can start in this pass
        closed: dict[str, int] = {}
        tried: Counter = Counter()  # jobs tried behind a queue's blocked top job
        untried: list[JobView] = []
        failed: dict[tuple, int] = {}  # placement shape -> state.version when it last failed
        topology = policy.topology_keys
        depth = policy.queue_depth
        queues_pending = len(memo.queues)
        cut = False

        for job in order:
            if len(closed) >= queues_pending:
                cut = True
                if not job.dependency:
                    untried.append(job)
                break
            q = job.queue
            rules = self.queue_rules(q)
            if q in closed:
                if job.dependency:
                    self.behind(job, rules, closed[q])
                else:
                    untried.append(job)
                continue
            if (job.held or job.dependency or job.array_limit or not rules.open
                    or job.constraint or job.gpu_type or job.features or job.nodelist
                    or job.exclude):
                gated = self.gate(job, rules)
                if gated is None:
                    continue
                pool, shape = gated
            else:  # no gate can stop it: gate()'s last step, for the queue's plain node set
                plain = plain_pools.get(q)
                if plain is None:
                    ekey = self.plain_keys.get(q)
                    if ekey is None:
                        ekey = self.plain_keys[q] = eligibility(job, rules.selector)
                    plain = plain_pools[q] = (ekey, self.state.pool(ekey))
                ekey, pool = plain
                shape = (ekey, job.gpus, job.nodes, job.exclusive)
                ok = never.get(shape)
                if ok is None:
                    ok = never[shape] = pool.could_ever_fit(job.gpus, job.nodes)
                if not ok:
                    self.wait(job, *no_nodes_reason(job, rules.selector))
                    continue
            if q in unpromised or (strict and q in held_up):
                self.wait(job, PRIORITY, behind_top[q])
                continue
            if q in held_up:
                tried[q] += 1
                if tried[q] >= depth:
                    closed[q] = held_up[q]
            if job.predicted_runtime_s is None or not by_prediction:
                limit = job.time_limit_s  # time_limit(), inlined
                if limit is None:
                    limit = rules.default_limit
                if limit is not None and rules.max_limit is not None:
                    limit = min(limit, rules.max_limit)
            else:
                limit = self.runtime(job, rules)
            end = INF if limit is None else now + limit
            team = gpus = None  # needed with quotas, and to start or preempt
            reclaim = 0
            if self.quota is not None:
                team, gpus = self.team_of(job), job_gpus(job)
                adm = self.quota.admit(team, gpus)
                if not adm.ok:
                    self.wait(job, QUOTA_LIMIT, adm.detail)
                    continue
                reclaim = adm.reclaim

            allocation = None
            if reclaim == 0:
                mkey = (shape, job.cpus, job.mem_mb, state.crossings(end))
                if failed.get(mkey) != state.version:
                    allocation = state.place(job, pool, end, topology)
                    if allocation is None:
                        failed[mkey] = state.version
            if allocation is not None:
                backfilled = bool(state.reservation_times)
                state.take(job, allocation, end)
                self.started.append((end, allocation, job.exclusive))
                if self.releases is not None and end != INF:
                    for name, g in allocation:
                        self.releases.add(end, ((name, g),), False, state)
                if self.quota is not None:
                    self.quota.add(team, gpus, job.id)
                self.started_jobs.append(job)
                if self._singletons is not None:
                    self._singletons.add((job.user, job.name))
                if job.array_parent is not None and self._array_running is not None:
                    self._array_running[job.array_parent] += 1
                if backfilled:
                    self.d.starts.append(Start(job.id, allocation, "backfill",
                                               "starts without delaying any reserved job"))
                else:
                    self.d.starts.append(Start(job.id, allocation, "priority"))
                continue

            if q in held_up:
                self.wait(job, PRIORITY, behind_top[q])
                continue
            if policy.preemption and self.try_preempt(
                    job, pool, team if team is not None else self.team_of(job), reclaim):
                continue
            if reclaim:
                self.wait(job, QUOTA_LIMIT, f"waiting for GPUs lent in the cohort to come back "
                                            f"({reclaim} GPUs); preemption is off")
                continue
            held_up[q] = job.id
            behind_top[q] = f"queue {q} waits for job {job.id} first"
            estimate = None
            if policy.backfill:
                res = reserve(job, pool, state, self.get_releases(), now)
                if res is not None:
                    estimate = res.start
                else:  # nothing can be promised, so backfill could starve it: hold the queue
                    unpromised.add(q)
            self.wait(job, RESOURCES, "waiting for GPUs" if estimate is None else
                      f"reserved {job.nodes} node(s) from the estimated start", estimate)
            if q in unpromised or strict:
                closed[q] = job.id
        if cut:
            # every queue is blocked: the jobs not reached only wait. Those with a dependency
            # are decided now (a failed dependency cancels); the rest when waits are read.
            if memo.dependent:
                seen = self.decided()
                for jid, job in memo.dependent.items():
                    if jid not in seen:
                        self.behind(job, self.queue_rules(job.queue), closed[job.queue])
            rest = order.rest()
        else:
            rest = []
        if untried or rest:
            self.d.defer_waits(self.deferred(untried, rest, closed))
        return self.d

    def left(self, v: JobView) -> float:
        """A running job's remaining service (SRSF), computed once per pass. A job that has
        outlived its estimate counts as having none left: evicting it is a gamble, not a gain."""
        x = self.remaining.get(v.id)
        if x is None:
            x = self.remaining[v.id] = remaining_service(v, self.now, self.policy, False)
        return x

    def net_left(self, v: JobView) -> float:
        """Service left less the GPU-time its grace period would cost if it were evicted."""
        x = self.net.get(v.id)
        if x is None:
            x = self.net[v.id] = self.left(v) - self.policy.grace_for(v) * job_gpus(v)
        return x

    def all_net_left(self) -> None:
        """net_left of every running job, in one sweep (a pass with a preemptor needs them)."""
        net_left = self.net_left
        for v in self.s.running:
            net_left(v)

    def srsf_ranked(self, cap: int | None, bound: float | None) -> list[tuple[float, JobView]]:
        """(rank, job) of the running jobs SRSF may evict: preemptible, not already leaving,
        under the per-job cap, and ranked (minus the service left net of the grace period)
        below `bound`. Works out net_left only for the few `ServiceIndex` says may be (the
        others, when asked, by net_left)."""
        policy = self.policy
        low = INF if bound is None else bound

        def constant(v: JobView) -> float | None:
            # net service left is about this - GPUs x now (see ServiceIndex)
            if not v.preemptible or v.preempted_at is not None or (
                    cap is not None and v.preemptions >= cap):
                return None
            gpus = v.gpus * v.nodes
            a = (runtime_estimate(v, policy) - policy.grace_for(v)) * gpus - v.attained_gpu_s
            return a if v.start_time is None else a + v.start_time * gpus

        out = []
        net_left = self.net_left
        # a job with no service left has a net of minus its grace period's cost: below any
        # threshold but a negative one
        above = -low if -low >= 0.0 else -INF
        for v in self.order.service.candidates(self.s.running, policy, self.now, -1, above, constant):
            x = net_left(v)
            if -x < low:
                out.append((-x, v))
        return out

    def victim_index(self, by_order: bool, level_of, bound: float | None = None) -> VictimIndex:
        """Running jobs in eviction order, built once per pass: under LAS the most-served first,
        under SRSF those with most service left (net of the grace period's cost) first. With
        `by_order`, only the jobs the order could ever evict (under the per-job preemption cap;
        under LAS, past the first service threshold), which is most of the saving under load,
        and of those only the ones ranked below `bound`: a scan that stops at a rank of `bound`
        or less never reaches the others. It is built again, wider, only for a waiting job
        whose scan would stop later (in a pass, the first preemptor usually stops latest)."""
        if by_order:
            index = self.order_victims
            if index is not None and (self.order_bound is None or (
                    bound is not None and bound <= self.order_bound)):
                return index
        elif self.victims is not None:
            return self.victims
        policy = self.policy
        las, srsf = policy.order == "las", policy.order == "srsf"
        if by_order and srsf:
            index = self.order_victims = VictimIndex.from_ranked(
                self.srsf_ranked(policy.max_preemptions_per_job, bound), self.now)
            self.order_bound = bound
            return index
        rank = None
        if las:
            rank = lambda v: -level_of(v)  # noqa: E731
        elif srsf:
            self.all_net_left()
            net = self.net
            rank = lambda v: -net[v.id]  # noqa: E731
        if by_order:
            cap = policy.max_preemptions_per_job
            if las:
                # evictable by some job only past the first threshold (or, once per level,
                # past the threshold after its last preemption); the level of each job kept
                # is worked out in the same sweep (what level_of would give), and so is its
                # rank, leaving out those ranked at `bound` or more
                th = policy.las_thresholds_gpu_s
                per_level = policy.las_preempt_once_per_level
                now, top, levels = self.now, len(th), self.levels
                low = INF if bound is None else bound
                kept = []
                # only jobs whose attained service reaches the threshold above the
                # preemptor's level can rank below `bound` (-level)
                at_least = -INF
                none = False
                if bound is not None:
                    need_level = math.floor(-bound)
                    if need_level >= top:
                        none = True
                    elif need_level >= 0 and -bound == need_level:
                        at_least = th[need_level]

                def constant(v: JobView) -> float | None:
                    # attained service is about this + GPUs x now (see ServiceIndex)
                    if not v.preemptible or v.preempted_at is not None or (
                            cap is not None and v.preemptions >= cap) or (
                            per_level and v.preemptions >= top):
                        return None
                    if v.start_time is None:
                        return v.attained_gpu_s
                    return v.attained_gpu_s - v.start_time * v.gpus * v.nodes

                jobs = [] if none else self.order.service.candidates(
                    self.s.running, (policy, "las"), now, 1, at_least, constant)
                for v in jobs:
                    k = v.preemptions if per_level else 0
                    if k >= top:
                        continue
                    run = (now - v.start_time if v.start_time is not None
                           else 0.0) * v.gpus * v.nodes
                    if v.attained_gpu_s + run >= th[k]:
                        lv = levels.get(v.id)
                        if lv is None:
                            lv = levels[v.id] = bisect_right(th, v.attained_gpu_s
                                                             + max(0.0, run))
                        if -lv < low:
                            kept.append((-lv, v))
                index = VictimIndex.from_ranked(kept, now)
            else:
                jobs = [v for v in self.s.running if v.preemptible and v.preempted_at is None
                        and (cap is None or v.preemptions < cap)]
                index = VictimIndex(jobs, self.now, rank, bound)
            self.order_victims = index
            self.order_bound = bound
        else:
            jobs = [v for v in self.s.running if v.preemptible and v.preempted_at is None]
            index = self.victims = VictimIndex(jobs, self.now, rank)
        return index

    def decided(self) -> set[int]:
        d = self.d
        return {r[0] for r in self.records} | {x.job_id for x in d.cancels} | \
            {x.job_id for x in d.starts}

    def try_preempt(self, job: JobView, pool, team: str, reclaim: int) -> bool:
        """Preempt for `job` if a policy allows; True when the job now waits for its victims."""
        policy, now = self.policy, self.now
        tiers = set(policy.queue(job.queue).preempts)
        las = policy.order == "las"
        srsf = policy.order == "srsf"
        quota = self.quota
        cohort = quota.cohort_of(team) if quota is not None else None
        within_nominal = False
        if cohort is not None:
            t = policy.teams[team]
            within_nominal = quota.usage.get(team, 0) + job_gpus(job) <= (t.nominal_gpus or 0)
        reclaiming = within_nominal and any(
            quota.is_borrowing(t.name) for t in quota.cohorts.get(cohort, ()) if t.name != team
        )
        if not (tiers or las or srsf or reclaiming):
            return False
        if self.preemptors >= policy.max_preemptors_per_pass:
            return False
        need = remaining_service(job, now, policy) if srsf else 0.0
        ratio = policy.srsf_preempt_ratio
        shape = (id(pool), job.gpus, job.nodes, job.exclusive)
        thresholds = policy.las_thresholds_gpu_s
        level = las_level(job.attained_gpu_s, thresholds) if las else 0
        # the order alone (no queue tiers, no quota reclaim) decides who may be evicted
        by_order = not (tiers or reclaiming)
        # a job of this shape that needed less (SRSF) or had a lower level (LAS) already found
        # no victims: neither will this one (victims only get fewer within a pass)
        if by_order and ((srsf and need >= self.srsf_failed.get(shape, INF))
                         or (las and level >= self.las_failed.get(shape, INF))):
            return False
        self.preemptors += 1
        levels = self.levels
        cap = policy.max_preemptions_per_job
        per_level = las and policy.las_preempt_once_per_level
        net_left = self.net_left

        def pays(v: JobView) -> bool:
            # SRSF: evict only a job with (ratio x) more service left, net of the GPU-time
            # its grace period costs
            return net_left(v) > ratio * need

        def level_of(v: JobView) -> int:
            lv = levels.get(v.id)
            if lv is None:
                lv = levels[v.id] = las_level(attained(v, now), thresholds)
            return lv

        def borrower(v: JobView) -> bool:
            vt = self.team_of(v)
            return vt != team and quota.cohort_of(vt) == cohort and quota.is_borrowing(vt)

        # whether v may be evicted depends only on the preemptor's kind: cache it per kind
        # (quota borrowing changes as victims are claimed, so that part is checked live)
        verdicts = self.verdicts.setdefault((job.queue, level, job.id if srsf else None), {})
        claimed = self.claimed

        def may_preempt(v: JobView) -> bool:
            if v.id in claimed or not v.preemptible or v.preempted_at is not None:
                return False
            ok = verdicts.get(v.id)
            if ok is None:
                ok = verdicts[v.id] = (v.queue in tiers or (
                    (cap is None or v.preemptions < cap)
                    and ((las and level_of(v) > level and (not per_level
                                                           or v.preemptions < level_of(v)))
                         or (srsf and pays(v)))))
            return ok or (reclaiming and borrower(v))

        if self.soon is None:
            self.soon = {}
            for v in self.s.running:
                if v.preempted_at is not None:
                    for name, g in v.allocation:
                        self.soon[name] = self.soon.get(name, 0) + len(g)
        soon = self.soon
        reclaim_pool = [v for v in self.s.running if may_preempt(v) and borrower(v)] \
            if reclaiming else []
        stop_rank = None
        if by_order:
            # victims are in eviction order (most service left, or highest LAS level, first):
            # past the first that the order does not allow, none is allowed. Their rank in the
            # index is minus that service (net of the grace period) or level, so that first
            # one is the first whose rank reaches minus what the waiting job needs (or has)
            if srsf:
                stop_rank = -(ratio * need)  # not pays(v): net_left(v) <= ratio x need
            elif las:
                stop_rank = -level  # level_of(v) <= level
        index = self.victim_index(by_order, level_of, stop_rank)
        # plain LAS or SRSF: the index holds only jobs that may be evicted and the scan stops
        # where the order no longer allows it, so only victims already claimed are left out
        plain = by_order and cap is None and not per_level
        victims = choose_victims(
            job, pool, self.state, index, soon, None if plain else may_preempt,
            reclaim=reclaim, reclaim_value=lambda v: job_gpus(v) if borrower(v) else 0,
            reclaim_pool=reclaim_pool, stop_rank=stop_rank, excluded=claimed,
        )
        if victims is None:
            if by_order and srsf:
                self.srsf_failed[shape] = min(need, self.srsf_failed.get(shape, INF))
            elif by_order and las:
                self.las_failed[shape] = min(level, self.las_failed.get(shape, INF))
            return False
        deadline = now
        for v in victims:
            self.claimed.add(v.id)
            grace = policy.grace_for(v)
            deadline = max(deadline, now + grace)
            if v.queue in tiers:
                why = f"preempted for job {job.id} (queue {job.queue} preempts queue {v.queue})"
            elif las and level_of(v) > level:
                why = (f"preempted for job {job.id}: it has had less GPU time "
                       f"({job.attained_gpu_s / 3600:.1f} vs {attained(v, now) / 3600:.1f} GPU-hours)")
            elif srsf and pays(v):
                why = (f"preempted for job {job.id}: it needs less GPU time "
                       f"({need / 3600:.1f} vs {self.left(v) / 3600:.1f} "
                       "GPU-hours left)")
            else:
                why = (f"preempted for job {job.id}: team {team} reclaims GPUs lent to "
                       f"team {self.team_of(v)}")
            self.d.preempts.append(Preempt(v.id, why, grace, job.id))
            if quota is not None:
                quota.add(self.team_of(v), -job_gpus(v))
        if victims:
            self.wait(job, RESOURCES, f"preempting job(s) {', '.join(str(v.id) for v in victims)}",
                      deadline)
            return True
        # enough GPUs are already on their way back from earlier preemptions
        if self.leaving_eta is None:
            self.leaving_eta = max((self.expected_end(v) for v in self.s.running
                                    if v.preempted_at is not None), default=now)
        self.wait(job, RESOURCES, "waiting for preempted jobs to leave", self.leaving_eta)
        return True


def no_nodes_reason(job: JobView, selector) -> tuple[str, str]:
    """Why no node can take a job now, in Slurm's words: its named nodes are unavailable
    (ReqNodeNotAvail), its constraints match no schedulable node (BadConstraints), or, with no
    constraint at all, the nodes that could hold it are down, drained or too small (Resources)."""
    size = f"{job.nodes} schedulable node(s) with {job.gpus} GPUs"
    if job.nodelist:
        return REQ_NODE_NOT_AVAIL, f"no {size} among the requested nodes {','.join(job.nodelist)}"
    if "container-runtime" in job.features:
        return BAD_CONSTRAINT, (f"no {size} with a container runtime (an --image job runs only where "
                                "the node's agent found podman, docker or enroot)")
    if job.constraint or job.gpu_type or job.features or job.exclude or selector:
        return BAD_CONSTRAINT, (f"no {size} match queue {job.queue}'s nodes, --gpu-type and "
                                "--constraint")
    return RESOURCES, f"no {size} now (nodes down, drained or too small)"
