"""`trainyard simulate`: replay a job trace through the planner in simulated time (discrete events)."""

from __future__ import annotations

import csv
import heapq
import json
import math
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

import click

from scheduler.planner import JobView, NodeView, PolicyConfig, QueuePolicy, Snapshot, plan
from scheduler.planner.fairshare import UsageLedger
from scheduler.planner.ordering import PendingOrder
from scheduler.planner.policy import SIMULATION_PRESETS
from scheduler.predict import JobFeatures, Prediction, Predictor
from scheduler.traces import (
    TraceError,
    TraceJob,
    load_trace,  # noqa: F401  (re-exported for callers of this module)
    parse_window,
    read_trace,
)

DEFAULT_QUEUE = "default"


# --- cluster --------------------------------------------------------------------------------

@dataclass
class Cluster:
    nodes: list[NodeView]
    queues: dict[str, QueuePolicy]  # queue -> its nodes (node_selector)
    gpus_per_node: int
    single_queue: bool  # NxG: every job goes to the one queue

    def size(self, queue: str) -> tuple[int, int]:
        """(nodes, GPUs) that serve `queue`."""
        sel = self.queues[queue].node_selector
        ns = [n for n in self.nodes if all(n.labels.get(k) == v for k, v in sel.items())]
        return len(ns), sum(n.gpus_total for n in ns)


def parse_cluster(spec: str, gpus_per_node: int = 8) -> Cluster:
    """`NxG` (N nodes of G GPUs, one queue) or a CSV of `vc,node num` (a queue per VC)."""
    text = spec.strip().lower()
    if "x" in text and not Path(spec).exists():
        n, _, g = text.partition("x")
        if not (n.isdigit() and g.isdigit() and int(n) > 0 and int(g) > 0):
            raise click.BadParameter(f"{spec!r}: expected NxG such as 352x8, or a CSV file",
                                     param_hint="--cluster")
        nodes = [NodeView(f"node{i:04d}", int(g), tuple(range(int(g))))
                 for i in range(int(n))]
        return Cluster(nodes, {DEFAULT_QUEUE: QueuePolicy(DEFAULT_QUEUE)}, int(g), True)
    path = Path(spec)
    if not path.exists():
        raise click.BadParameter(f"{spec!r}: no such file, and not NxG such as 352x8",
                                 param_hint="--cluster")
    nodes: list[NodeView] = []
    queues: dict[str, QueuePolicy] = {}
    with path.open(newline="") as f:
        reader = csv.reader(f)
        header = next(reader, None)
        if not header or [h.strip().lower() for h in header[:2]] != ["vc", "node num"]:
            raise click.BadParameter(f"{path}: expected a header 'vc,node num', got {header!r}",
                                     param_hint="--cluster")
        for line, row in enumerate(reader, start=2):
            if not row or not row[0].strip():
                continue
            vc = row[0].strip()
            try:
                count = int(row[1])
            except (IndexError, ValueError) as e:
                raise click.BadParameter(f"{path}, line {line}: node num {row[1:]!r} is not a "
                                         "whole number", param_hint="--cluster") from e
            queues[vc] = QueuePolicy(vc, node_selector={"vc": vc})
            nodes += [NodeView(f"{vc}-{i:03d}", gpus_per_node, tuple(range(gpus_per_node)),
                               labels={"vc": vc}) for i in range(count)]
    return Cluster(nodes, queues, gpus_per_node, False)


def gang_shape(gpus: int, per_node: int) -> tuple[int, int] | None:
    """(GPUs per node, nodes) for a job of `gpus` GPUs: one node if it fits, else the fewest
    equal shares that fit a node (12 GPUs on 8-GPU nodes -> 2 x 6). None if none exists."""
    if gpus <= per_node:
        return gpus, 1
    for k in range(2, gpus + 1):
        if gpus % k == 0 and gpus // k <= per_node:
            return gpus // k, k
    return None


# --- the replay -----------------------------------------------------------------------------

@dataclass(slots=True)
class SimJob:
    t: TraceJob
    queue: str
    user: str
    team: str
    gpn: int  # GPUs per node
    nodes: int
    remaining: float
    attained: float = 0.0
    start: float | None = None
    first_start: float | None = None
    end: float | None = None
    allocation: tuple = ()
    epoch: int = 0
    preempted_at: float | None = None
    preemptions: int = 0
    view: JobView | None = None
    prediction: Prediction | None = None  # made at submission, from jobs finished before


@dataclass
class Partition:
    """Nodes serving one queue (or the whole cluster): planned independently of the others."""

    names: list[str]
    free: dict[str, list[int]]
    views: dict[str, NodeView]
    pending: dict[int, SimJob] = field(default_factory=dict)
    running: dict[int, SimJob] = field(default_factory=dict)
    # the planner's view of the pending jobs, and its order of them kept across passes
    pending_views: dict[int, JobView] = field(default_factory=dict)
    users: dict[str, int] = field(default_factory=dict)  # user -> pending jobs
    order: PendingOrder = field(default_factory=PendingOrder)
    # the snapshot's nodes and running jobs, rebuilt only where something changed since the
    # last pass (most passes start or end a few jobs on a few nodes)
    node_views: tuple[NodeView, ...] | None = None
    running_views: tuple[JobView, ...] | None = None
    running_view_of: dict[int, JobView] = field(default_factory=dict)  # in `running`'s order
    changed: set[str] = field(default_factory=set)  # nodes whose free GPUs changed


FINISH, RELEASE = 0, 1


class Simulator:
    def __init__(self, jobs: list[TraceJob], cluster: Cluster, policy: PolicyConfig,
                 seed: int = 0, users_per_vc: int = 10, estimate_factor: float = 1.0,
                 progress: Callable[[str], None] | None = None):
        self.cluster = cluster
        self.policy = replace(policy, queues={**cluster.queues, **policy.queues})
        self.estimate_factor = estimate_factor
        # the oracle knows every job's run time; srsf otherwise predicts it from history
        self.clairvoyant = policy.name == "oracle"
        self.predictor = Predictor() if policy.order == "srsf" and not self.clairvoyant else None
        self.progress = progress
        self.ledger = UsageLedger(self.policy.fairshare_half_life_s)
        self.use_usage = self.policy.order == "multifactor" and self.policy.weights.fairshare > 0
        self.skipped_no_queue: dict[str, int] = {}
        self.skipped_oversize: list[TraceJob] = []
        self.parts: dict[str, Partition] = {}
        self.part_of_queue: dict[str, str] = {}
        for q, qp in cluster.queues.items():
            names = [n.name for n in cluster.nodes
                     if all(n.labels.get(k) == v for k, v in qp.node_selector.items())]
            self.parts[q] = Partition(names, {n: list(range(cluster.gpus_per_node)) for n in names},
                                      {n.name: n for n in cluster.nodes if n.name in set(names)})
            self.part_of_queue[q] = q
        rng = random.Random(seed)
        # Zipf-like weights: a few heavy users, many light ones, as in real clusters
        weights = [1.0 / (i + 1) ** 1.2 for i in range(max(1, users_per_vc))]
        self.jobs: list[SimJob] = []
        for tj in jobs:
            queue = DEFAULT_QUEUE if cluster.single_queue else tj.vc
            if queue not in cluster.queues:
                self.skipped_no_queue[tj.vc] = self.skipped_no_queue.get(tj.vc, 0) + 1
                continue
            if tj.nodes:
                shape = (tj.gpus // tj.nodes, tj.nodes) if tj.gpus % tj.nodes == 0 else None
            else:
                shape = gang_shape(tj.gpus, cluster.gpus_per_node)
            part = self.parts[queue]
            if shape is None or shape[0] > cluster.gpus_per_node or shape[1] > len(part.names):
                self.skipped_oversize.append(tj)
                continue
            team = tj.team or tj.vc or DEFAULT_QUEUE
            user = tj.user or f"{team}-u{rng.choices(range(len(weights)), weights)[0]}"
            self.jobs.append(SimJob(tj, queue, user, team, shape[0], shape[1],
                                    max(tj.duration, 0.0)))
        self.finished_jobs: list[SimJob] = []
        self.passes = 0
        self.preemptions = 0
        self.held_gpu_s = 0.0  # GPU-seconds allocated, including preempted jobs' grace periods
        self.heap: list = []
        self.seq = 0

    # JobViews are rebuilt only when a job changes state
    def pending_view(self, j: SimJob) -> JobView:
        # the time limit a user would have given: the true run time x --estimate-factor
        limit = max(1.0, math.ceil(j.remaining * self.estimate_factor))
        if self.clairvoyant:
            predicted = j.t.duration
        elif j.prediction is not None and j.prediction.confident:
            predicted = j.prediction.seconds
        else:
            predicted = None
        return JobView(j.t.id, j.user, j.queue, name=j.t.name, gpus=j.gpn, nodes=j.nodes,
                       submit_time=j.t.submit, time_limit_s=limit, account=j.team,
                       attained_gpu_s=j.attained, predicted_runtime_s=predicted,
                       preemptions=j.preemptions)

    def running_view(self, j: SimJob) -> JobView:
        return replace(j.view, start_time=j.start, allocation=j.allocation,
                       preempted_at=j.preempted_at)

    def push(self, when: float, kind: int, j: SimJob) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (when, self.seq, kind, j, j.epoch))

    def node_view(self, part: Partition, name: str) -> NodeView:
        v = part.views[name]
        free = tuple(part.free[name])
        if v.free_gpus != free:  # rebuilt only when its allocations changed
            v = part.views[name] = NodeView(v.name, v.gpus_total, free, labels=v.labels)
        return v

    def run(self) -> dict:
        arrivals = self.jobs
        i = 0
        n = len(arrivals)
        dirty: set[str] = set()
        wall0 = time.monotonic()
        last_report = wall0
        now = 0.0
        while i < n or self.heap:
            t_next = arrivals[i].t.submit if i < n else math.inf
            if self.heap and self.heap[0][0] < t_next:
                t_next = self.heap[0][0]
            now = t_next
            while i < n and arrivals[i].t.submit == now:
                j = arrivals[i]
                self.enqueue(j, now)
                dirty.add(j.queue)
                i += 1
            while self.heap and self.heap[0][0] == now:
                _, _, kind, j, epoch = heapq.heappop(self.heap)
                if epoch != j.epoch:
                    continue  # stale: the job was preempted since
                self.leave(j, now, requeue=kind == RELEASE)
                dirty.add(j.queue)
            for q in sorted(dirty):
                self.plan_partition(q, now)
            dirty.clear()
            if self.progress and time.monotonic() - last_report > 2.0:
                last_report = time.monotonic()
                self.progress(f"simulated day {now / 86400:.1f}: {len(self.finished_jobs)}/{n} "
                              f"jobs done, {self.passes} planner passes")
        return self.metrics(time.monotonic() - wall0)

    def leave(self, j: SimJob, now: float, requeue: bool) -> None:
        part = self.parts[j.queue]
        for name, gpus in j.allocation:
            part.free[name] = sorted(part.free[name] + list(gpus))
            part.changed.add(name)
        part.running_views = None
        self.held_gpu_s += (now - j.start) * j.gpn * j.nodes
        del part.running[j.t.id]
        del part.running_view_of[j.t.id]
        j.allocation = ()
        if requeue:  # preempted: back to PENDING with the work it has left
            j.start = None
            j.preempted_at = None
            self.enqueue(j, now)
            return
        ran = now - j.start
        j.attained += ran * j.gpn * j.nodes
        self.ledger.charge_run(j.user, j.team, j.gpn * j.nodes, j.start, now)
        j.remaining = 0.0
        j.end = now
        self.finished_jobs.append(j)
        if self.predictor is not None:
            self.predictor.observe(self.features(j), j.t.duration)

    def enqueue(self, j: SimJob, now: float) -> None:
        """The job is PENDING (submitted, or requeued after a preemption)."""
        part = self.parts[j.queue]
        if j.prediction is None and self.predictor is not None:
            j.prediction = self.predictor.predict(self.features(j))
        j.view = self.pending_view(j)
        part.pending[j.t.id] = j
        part.pending_views[j.t.id] = j.view
        part.users[j.user] = part.users.get(j.user, 0) + 1

    def features(self, j: SimJob) -> JobFeatures:
        return JobFeatures(j.user, j.t.name, j.t.vc or j.queue, j.gpn * j.nodes)

    def plan_partition(self, q: str, now: float) -> None:
        part = self.parts[q]
        if not part.pending:
            return
        self.passes += 1
        if part.running_views is None:
            part.running_views = tuple(part.running_view_of.values())
        running = part.running_views
        if part.node_views is None or part.changed:
            for name in part.changed:
                self.node_view(part, name)
            part.changed.clear()
            part.node_views = tuple(map(part.views.__getitem__, part.names))
        usage = {}
        if self.use_usage:
            keys = None
            if not self.cluster.single_queue:
                # a VC's queue is planned alone and all its jobs share one team (the VC), so
                # only its users' and its team's usage can change its order
                keys = {f"user:{u}" for u in part.users}
                keys.add(f"team:{q}")
            # every job's account is its team (never empty): the ledger's default reads it
            usage = self.ledger.decayed(now, running, None, keys)
        snap = Snapshot(
            part.node_views,
            tuple(part.pending_views.values()),
            running,
            usage=usage,
        )
        d = plan(snap, now, self.policy, part.order)
        for s in d.starts:
            j = part.pending.pop(s.job_id)
            del part.pending_views[s.job_id]
            left = part.users[j.user] - 1
            if left:
                part.users[j.user] = left
            else:
                del part.users[j.user]
            for name, gpus in s.allocation:
                taken = set(gpus)
                part.free[name] = [g for g in part.free[name] if g not in taken]
                part.changed.add(name)
            j.allocation = s.allocation
            j.start = now
            if j.first_start is None:
                j.first_start = now
            j.epoch += 1
            j.view = self.running_view(j)
            part.running[j.t.id] = j
            part.running_view_of[j.t.id] = j.view
            self.push(now + j.remaining, FINISH, j)
        if d.starts or d.preempts:
            part.running_views = None
        for p in d.preempts:
            j = part.running[p.job_id]
            self.preemptions += 1
            j.preemptions += 1
            ran = now - j.start
            j.preempted_at = now
            if j.remaining - ran > p.grace_period_s:
                # SIGTERM: it checkpoints during the grace period (no progress), then leaves
                j.attained += ran * j.gpn * j.nodes
                self.ledger.charge_run(j.user, j.team, j.gpn * j.nodes, j.start, now)
                j.remaining -= ran
                j.epoch += 1
                self.push(now + p.grace_period_s, RELEASE, j)
            # else it has less work left than its grace period and simply finishes
            j.view = part.running_view_of[j.t.id] = self.running_view(j)

    def metrics(self, wall_s: float) -> dict:
        done = self.finished_jobs
        jct = sorted(j.end - j.t.submit for j in done)
        wait = sorted(max(0.0, j.end - j.t.submit - j.t.duration) for j in done)
        first_wait = sorted(j.first_start - j.t.submit for j in done)
        total_gpus = sum(len(p.names) for p in self.parts.values()) * self.cluster.gpus_per_node
        start = min((j.t.submit for j in self.jobs), default=0.0)
        makespan = max((j.end for j in done), default=start) - start
        useful = sum(j.t.duration * j.gpn * j.nodes for j in done)
        capacity = total_gpus * makespan
        return {
            "policy": self.policy.name,
            "jobs": len(done),
            "jobs_in_trace": len(self.jobs) + len(self.skipped_oversize)
            + sum(self.skipped_no_queue.values()),
            "skipped_oversize": len(self.skipped_oversize),
            "skipped_no_queue": dict(sorted(self.skipped_no_queue.items())),
            "avg_jct_s": _mean(jct),
            "p50_jct_s": _pct(jct, 50),
            "p99_jct_s": _pct(jct, 99),
            "avg_wait_s": _mean(wait),
            "p50_wait_s": _pct(wait, 50),
            "p99_wait_s": _pct(wait, 99),
            "avg_first_start_wait_s": _mean(first_wait),
            "utilization": useful / capacity if capacity else 0.0,
            "allocated_utilization": self.held_gpu_s / capacity if capacity else 0.0,
            "makespan_s": makespan,
            "gpus": total_gpus,
            "preemptions": self.preemptions,
            "planner_passes": self.passes,
            "wall_s": round(wall_s, 2),
            **self.prediction_metrics(),
            "_jct": jct,
            "_wait": wait,
        }


    def prediction_metrics(self) -> dict:
        """How good the submit-time predictions were (srsf policies that predict)."""
        if self.predictor is None:
            return {}
        errs, within, confident, made = [], 0, 0, 0
        for j in self.finished_jobs:
            p = j.prediction
            if p is None:
                continue
            made += 1
            confident += p.confident
            truth = max(j.t.duration, 1.0)
            errs.append(abs(p.seconds - j.t.duration))
            within += 0.5 <= max(p.seconds, 1.0) / truth <= 2.0
        errs.sort()
        return {"predictions": made,
                "prediction_confident": confident / made if made else 0.0,
                "prediction_median_abs_error_s": _pct(errs, 50),
                "prediction_within_2x": within / made if made else 0.0}


def offered_load(trace: list[TraceJob], span_s: float, gpus: int) -> float:
    """Σ(run time x GPUs) / (window length x GPUs): the load the trace offers the cluster."""
    work = sum(j.duration * j.gpus for j in trace)
    return work / (span_s * gpus) if span_s > 0 and gpus > 0 else 0.0


def size_for_load(trace: list[TraceJob], span_s: float, load: float, spec: str,
                  gpus_per_node: int) -> Cluster:
    """A cluster on which the trace offers `load`: one pool (`pooled`), or a queue per VC each
    sized for its own jobs (`per-vc`, or the VCs of a 'vc,node num' CSV, resized)."""
    if not 0.0 < load <= 1.5:
        raise click.BadParameter(f"{load!r}: the offered load must be in (0, 1.5]; 0.8 means "
                                 "the trace's GPU-time fills 80% of the cluster's", param_hint="--load")
    if span_s <= 0:
        raise click.BadParameter("the trace spans no time: give --window START END",
                                 param_hint="--load")

    def nodes_for(jobs: list[TraceJob]) -> int:
        work = sum(j.duration * j.gpus for j in jobs)
        biggest = max((-(-j.gpus // gpus_per_node) for j in jobs), default=1)
        return max(1, biggest, math.ceil(work / (span_s * load * gpus_per_node)))

    if spec == "pooled":
        return parse_cluster(f"{nodes_for(trace)}x{gpus_per_node}", gpus_per_node)
    if spec == "per-vc":
        vcs = sorted({j.vc for j in trace})
    elif Path(spec).exists():
        vcs = list(parse_cluster(spec, gpus_per_node).queues)
    else:
        raise click.BadParameter(f"{spec!r}: with --load, give 'pooled', 'per-vc' or a CSV of "
                                 "'vc,node num' (its VCs are resized)", param_hint="--cluster")
    by_vc: dict[str, list[TraceJob]] = {}
    for j in trace:
        by_vc.setdefault(j.vc, []).append(j)
    nodes: list[NodeView] = []
    queues: dict[str, QueuePolicy] = {}
    for vc in vcs:
        queues[vc] = QueuePolicy(vc, node_selector={"vc": vc})
        nodes += [NodeView(f"{vc}-{i:03d}", gpus_per_node, tuple(range(gpus_per_node)),
                           labels={"vc": vc}) for i in range(nodes_for(by_vc.get(vc, [])))]
    return Cluster(nodes, queues, gpus_per_node, False)


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else 0.0


def _pct(sorted_xs: list[float], p: float) -> float:
    """Nearest-rank percentile of an already sorted list."""
    if not sorted_xs:
        return 0.0
    k = max(0, math.ceil(p / 100 * len(sorted_xs)) - 1)
    return sorted_xs[k]


def simulate_policy(trace: list[TraceJob], cluster: Cluster, policy: PolicyConfig, seed: int = 0,
                    users_per_vc: int = 10, estimate_factor: float = 1.0,
                    progress: Callable[[str], None] | None = None) -> dict:
    return Simulator(trace, cluster, policy, seed, users_per_vc, estimate_factor, progress).run()


# --- output ---------------------------------------------------------------------------------

def _hours(s: float) -> str:
    return f"{s / 3600:,.2f} h"


def render_table(results: list[dict]) -> str:
    head = ("policy", "jobs", "avg JCT", "p50 JCT", "p99 JCT", "avg wait", "p99 wait",
            "util", "makespan", "preempt")
    ratio = any("avg_jct_vs_oracle" in r for r in results)
    if ratio:
        head += ("vs oracle",)
    rows = [head]
    for r in results:
        row = (r["policy"], f"{r['jobs']:,}", _hours(r["avg_jct_s"]), _hours(r["p50_jct_s"]),
               _hours(r["p99_jct_s"]), _hours(r["avg_wait_s"]), _hours(r["p99_wait_s"]),
               f"{r['utilization']:.1%}", f"{r['makespan_s'] / 86400:,.1f} d",
               f"{r['preemptions']:,}")
        if ratio:
            row += (f"{r.get('avg_jct_vs_oracle', 0.0):.2f}x",)
        rows.append(row)
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.rjust(w) if k else c.ljust(w) for k, (c, w) in enumerate(zip(row, widths,
                                                                                      strict=True)))
             for row in rows]
    return "\n".join(lines)


def save_plot(results: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        for ax, key in zip(axes, ("_jct", "_wait"), strict=True):
            xs = [max(x, 1.0) for x in r[key]]
            if not xs:
                continue
            ys = [(i + 1) / len(xs) for i in range(len(xs))]
            ax.plot(xs, ys, label=r["policy"])
    for ax, what in zip(axes, ("job completion time", "queueing delay"), strict=True):
        ax.set_xscale("log")
        ax.set_xlabel(f"{what} (s, log scale)")
        ax.set_ylabel("fraction of jobs")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


HELP = f"""Replay a job trace through trainyard's planner in simulated time.

\b
A discrete-event loop: arrivals and completions advance a simulated clock (no sleeping);
at each event time the planner (the same plan() the daemon runs) decides starts and
preemptions. Reports mean/p50/p99 job completion time (JCT), mean/p99 queueing delay
(JCT minus run time), GPU utilisation (the trace's GPU-seconds over GPUs x makespan) and
makespan; with `oracle` among the policies, each policy's mean JCT as a ratio to it.

\b
--trace FILE   Philly's CSV (timestamp,duration,num_gpus,gpu_time,cluster), a Helios-style
               cluster_log.csv (job_id,user,vc,gpu_num,node_num,submit_time,duration,...),
               Alibaba's GPU pod list (openb_pod_list_*.csv: name,num_gpu,creation_time,
               scheduled_time,deletion_time,...; scripts/fetch_trace.sh alibaba fetches it),
               or a generic CSV with submit_time,duration,gpus and optional
               nodes,queue,user,team,name. Rows that cannot be jobs are counted by reason.
--window S E   replay only jobs submitted in [S, E) (dates or seconds; a bare end date
               includes that day).
--cluster SPEC NxG: N nodes of G GPUs in one queue (e.g. 352x8); or a CSV with a header
               'vc,node num': one queue per virtual cluster with that many nodes of
               --gpus-per-node GPUs, only its own jobs on its own nodes. With --load:
               'pooled' (default), 'per-vc', or such a CSV (its VCs are resized).
--load X       size the cluster so the trace offers X of its GPU-time:
               sum(run time x GPUs) / (window length x GPUs); X in (0, 1.5].
--policy NAME  {", ".join(SIMULATION_PRESETS)} (or several, comma-separated, to compare):
               fifo       submit order, a blocked head holds its queue;
               backfill   multifactor priority (age, queue) + EASY backfill on time limits;
               fairshare  multifactor with fair share over decayed usage + EASY backfill;
               las        least attained service (Tiresias-style discretised LAS, GPU-time
                          thresholds), preempts more-served jobs; needs no durations;
               las-budget LAS on levels that double from 4 GPU-hours, preempting a job at
                          most once per level it reaches (jobs under 4 GPU-hours never);
               qssf       shortest predicted remaining GPU-service first (run times learned
                          from finished jobs), with aging and backfill on predictions,
                          no preemption;
               oracle     shortest true remaining GPU-service first with preemption: knows
                          every run time, the reference the others are measured against.

\b
A trace without users (Philly, Alibaba's) gives each job a synthetic user of its VC
(Zipf-distributed, from --seed); its team is its VC. Time limits are the true run time x
--estimate-factor. Alibaba's GPU pods (cluster-trace-gpu-v2023) queue by QoS class, and a pod
that asked for part of a GPU gets a whole one (counted in the output).
"""


@click.command("simulate", help=HELP)
@click.option("--trace", "trace_path", required=True, type=click.Path(exists=True, dir_okay=False),
              help="trace CSV (Philly's, Helios-style, Alibaba's GPU pods or generic)")
@click.option("--cluster", "spec", help="NxG, a CSV of 'vc,node num'; with --load: pooled, per-vc")
@click.option("--load", "load", type=float, help="size the cluster for this offered load, (0, 1.5]")
@click.option("--window", nargs=2, metavar="START END", help="replay jobs submitted in [START, END)")
@click.option("--policy", "policy_names", default="backfill", show_default=True,
              help=f"{', '.join(SIMULATION_PRESETS)}; comma-separated to compare several")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False),
              help="trainyard.toml whose [scheduler]/[teams] settings override the policy's")
@click.option("--seed", default=0, show_default=True, help="seed for synthetic users")
@click.option("--users-per-vc", default=10, show_default=True,
              help="synthetic users per VC when the trace has none")
@click.option("--gpus-per-node", default=8, show_default=True,
              help="GPUs per node for a CSV cluster")
@click.option("--estimate-factor", default=1.0, show_default=True, type=click.FloatRange(min=1.0),
              help="time limit = run time x this (1.0: exact estimates)")
@click.option("--limit", "max_jobs", type=click.IntRange(min=1),
              help="replay only the first N jobs (by submit time)")
@click.option("--json", "as_json", is_flag=True, help="print the metrics as JSON")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False),
              help="write CDFs of JCT and queueing delay to this PNG")
@click.option("--quiet", is_flag=True, help="no progress on stderr")
def simulate(trace_path, spec, load, window, policy_names, config_path, seed, users_per_vc,
             gpus_per_node, estimate_factor, max_jobs, as_json, plot_path, quiet):
    names = [p.strip() for p in policy_names.split(",") if p.strip()]
    for name in names:
        if name not in SIMULATION_PRESETS:
            raise click.BadParameter(f"unknown policy {name!r}; choose from "
                                     f"{', '.join(SIMULATION_PRESETS)}", param_hint="--policy")
    if load is not None and not 0.0 < load <= 1.5:
        raise click.BadParameter(f"{load!r}: the offered load must be in (0, 1.5]; 0.8 means the "
                                 "trace's GPU-time fills 80% of the cluster's", param_hint="--load")
    if spec is None and load is None:
        raise click.UsageError("give --cluster (NxG or a 'vc,node num' CSV), or --load X to size one")
    overrides: dict = {}
    if config_path:
        import tomllib

        from .settings import Settings

        try:
            doc = tomllib.loads(Path(config_path).read_text())
            base = Settings.from_toml(doc).to_policy()
        except (tomllib.TOMLDecodeError, ValueError) as e:
            raise click.BadParameter(f"{config_path}: {e}", param_hint="--config") from e
        sched = doc.get("scheduler", {})
        overrides = {v: getattr(base, v) for k, v in _CONFIG_FIELDS.items() if k in sched}
        if "teams" in doc:
            overrides["teams"] = base.teams
    try:
        bounds = parse_window(*window) if window else None
        tr = read_trace(trace_path, bounds)
    except TraceError as e:
        raise click.BadParameter(str(e), param_hint="--trace") from e
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--window") from e
    trace = tr.jobs[:max_jobs] if max_jobs else tr.jobs
    span = tr.span_s if bounds or not max_jobs else (trace[-1].submit if trace else 0.0)
    if load is not None:
        cluster = size_for_load(trace, span, load, spec or "pooled", gpus_per_node)
    else:
        cluster = parse_cluster(spec, gpus_per_node)
    results = []
    for name in names:
        policy = replace(PolicyConfig.preset(name), **overrides)
        progress = None if quiet else (lambda m, n=name: print(f"[{n}] {m}", file=sys.stderr))
        r = simulate_policy(trace, cluster, policy, seed, users_per_vc, estimate_factor, progress)
        r["offered_load"] = offered_load(trace, span, r["gpus"])
        r["skipped_rows"] = dict(sorted(tr.skipped.items()))
        r["adjusted_rows"] = dict(sorted(tr.adjusted.items()))
        if not quiet:
            print(f"[{name}] done: {r['jobs']:,} jobs in {r['wall_s']:.1f} s", file=sys.stderr)
        results.append(r)
    oracle = next((r for r in results if r["policy"] == "oracle"), None)
    if oracle is not None and oracle["avg_jct_s"] > 0:
        for r in results:
            r["avg_jct_vs_oracle"] = r["avg_jct_s"] / oracle["avg_jct_s"]
    if plot_path:
        save_plot(results, plot_path, f"{Path(trace_path).name} on {Path(spec or 'pooled').name}")
    public = [{k: v for k, v in r.items() if not k.startswith("_")} for r in results]
    if as_json:
        out = public[0] if len(public) == 1 else {r["policy"]: r for r in public}
        click.echo(json.dumps(out, indent=2))
        return
    r0 = public[0]
    click.echo(f"trace {trace_path}: {r0['jobs_in_trace']:,} jobs; cluster "
               f"{spec or 'pooled'}: {r0['gpus']:,} GPUs "
               f"({len(cluster.nodes)} x {cluster.gpus_per_node}); offered load "
               f"{r0['offered_load']:.0%}")
    if r0["skipped_rows"]:
        why = ", ".join(f"{reason} ({n:,})" for reason, n in r0["skipped_rows"].items())
        click.echo(f"rows not read as jobs: {why}")
    if r0["adjusted_rows"]:
        how = ", ".join(f"{what} ({n:,})" for what, n in r0["adjusted_rows"].items())
        click.echo(f"rows read with a change: {how}")
    if r0["skipped_oversize"]:
        click.echo(f"not run: {r0['skipped_oversize']:,} jobs larger than their queue's nodes")
    if r0["skipped_no_queue"]:
        missing = ", ".join(f"{vc} ({c})" for vc, c in r0["skipped_no_queue"].items())
        click.echo(f"not run: jobs of VCs the cluster does not have: {missing}")
    click.echo(render_table(public))


_CONFIG_FIELDS = {
    "backfill": "backfill", "queueing": "queueing", "preemption": "preemption",
    "max_preemptors_per_pass": "max_preemptors_per_pass", "grace_period": "grace_period_s",
    "default_time": "default_time_limit_s", "fairshare_half_life": "fairshare_half_life_s",
    "priority_weights": "weights", "las_thresholds_gpu_hours": "las_thresholds_gpu_s",
    "order": "order", "topology_keys": "topology_keys", "queue_depth": "queue_depth",
    "backfill_on_prediction": "backfill_on_prediction",
    "max_preemptions_per_job": "max_preemptions_per_job",
    "las_preempt_once_per_level": "las_preempt_once_per_level",
}
