"""The scheduling cycle: (1) snapshot, (2) plan (pure), (3) commit decisions, (4) dispatch."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from collections.abc import Callable, Mapping
from operator import itemgetter

from sqlalchemy import bindparam, func, literal_column, update
from sqlalchemy import select as sa_select
from sqlmodel import Session, select

from .. import models as m
from ..models import Job, Node, Queue
from ..planner import (
    HELD,
    RESOURCES,
    JobView,
    NodeView,
    PolicyConfig,
    QueueView,
    Snapshot,
    UsageLedger,
    depends_on,
    plan,
)
from ..planner.changes import Views
from ..planner.ordering import PendingOrder
from .clock import Clock
from .dispatch import Dispatcher
from .gpuhealth import HealthMonitor
from .lifecycle import JobLifecycle
from .links import NodeLinks
from .prediction import planning_runtime
from .state import StateStore, TableCache

log = logging.getLogger("trainyard.daemon")
BEGIN_TIME = "BeginTime"  # Slurm's reason for a job whose --begin has not come

# Columns the planner needs, read as plain Core rows: hydrating ORM objects for thousands of
# pending jobs per cycle costs more than the planning itself.
_T = Job.__table__.c
VIEW_COLUMNS = (_T.id, _T.user, _T.queue, _T.name, _T.gpus, _T.nodes, _T.cpus, _T.mem_mb,
                _T.gpu_type, _T.priority, _T.submit_time, _T.state, _T.held, _T.time_limit_s,
                _T.start_time, _T.allocation, _T.dependency, _T.constraint, _T.exclusive,
                _T.nice, _T.account, _T.array_parent, _T.array_limit, _T.attained_gpu_s,
                _T.kill_reason, _T.kill_time, _T.attempt, _T.features, _T.nodelist, _T.exclude, _T.image,
                _T.predicted_runtime_s, _T.prediction_confident, _T.preemptions)
_N = Node.__table__.c
# the container runtime the agent found, extracted by the database: decoding every node's whole
# agent_info (its GPUs, fencing, versions) each cycle cost more than the planning at 1,000 nodes
NODE_COLUMNS = (_N.name, _N.gpus_total, _N.gpu_indices, _N.cpus, _N.mem_mb, _N.gpu_model, _N.labels,
                _N.agent_info[("containers", "runtime")].as_string().label("runtime"), _N.state)
# what may change while a job is active (the rest of its view is fixed until it ends or requeues);
# all of them are among VIEW_COLUMNS
ACTIVE_KEY = (_T.state, _T.attempt, _T.priority, _T.nice, _T.held, _T.time_limit_s, _T.start_time,
              _T.kill_reason, _T.kill_time, _T.attained_gpu_s)
# what the cycle reads of every pending job to know which changed (the cache key and the planner's
# last words, to write only what changed), and of every active one
PENDING_LIGHT = (_T.id, _T.attempt, _T.priority, _T.held, _T.reason, _T.estimated_start, _T.nice,
                 _T.time_limit_s, _T.reason_detail, _T.eligible_time, _T.submit_time)
_PENDING_AT = {c.name: i for i, c in enumerate(PENDING_LIGHT)}
_BEGIN_AT, _SUBMIT_AT = _PENDING_AT["eligible_time"], _PENDING_AT["submit_time"]
ACTIVE_LIGHT = (_T.id, *ACTIVE_KEY)
# the light rows are kept between cycles and only the jobs committed transactions changed are
# read again (StateStore.changed_jobs); all of them are read again this often regardless
FULL_READ_S = 300.0
# Under a long backlog every pending job's reason and estimated start are worked out again at
# most this often (building them costs O(backlog) per cycle); a shorter one gets them every cycle
LONG_BACKLOG = 2000
# a daemon that planned nothing for this long (and for 10x its last cycle) plans a submission at
# once. While submissions stream in, cycles follow each other closer than this, so they stay
# paced; a lone one (or the first of a burst) is planned in the same turn of the loop. At 50 ms,
# every submission within 50 ms of a job's end waited for the pacing: 2.5 ms of a warm start's
# 7 ms from submit to dispatch; 8 clients' rate and p99 did not move (four alternating runs of
# bench_submit_load.py 4000 8)
IDLE_PLAN_S = 0.005
WAITS_SWITCH_S = 0.0005  # the interpreter's thread switch interval while they are built
WAITS_WRITE_CHUNK = 250  # pending jobs' reasons written per transaction by write_waits (~5 ms)
WAITS_EVERY_S = 10.0  # (Slurm's backfill works out estimated starts every 30 s by default)
# Under a shorter backlog reasons are written every cycle, their words and estimated starts at
# most this often: they move with every start and end, and rewriting every pending job's row
# each cycle cost more than planning
ESTIMATES_EVERY_S = 1.0
# ... and above this many pending jobs, in the daemon's loop, the reasons too at most every
# REASONS_EVERY_S: a busy daemon plans every few milliseconds, and working out a thousand
# pending jobs' reasons each time was a tenth of its CPU while an array of 1,000 ran
REASONS_EVERY_CYCLE = 200
REASONS_EVERY_S = 0.25
# pending jobs hold no allocation: skip decoding that JSON column for them
PENDING_COLUMNS = tuple(literal_column("NULL").label("allocation") if c.name == "allocation" else c
                        for c in VIEW_COLUMNS)


# The cycle's statements, built once with their values as bound parameters: SQLAlchemy builds a
# SELECT (and works out its cache key, column by column) each time one is constructed, and for
# these 50-column reads that cost three to four times running them.
def _ids():
    return bindparam("ids", expanding=True)


def _light_reads(columns: tuple, where) -> tuple:
    """(every row, the rows of `ids`, the rows after id `after`) of `columns` where `where`."""
    return (sa_select(*columns).where(where), sa_select(*columns).where(_T.id.in_(_ids()), where),
            sa_select(*columns).where(_T.id > bindparam("after"), where))


_PENDING_LIGHT_READS = _light_reads(PENDING_LIGHT, _T.state == m.PENDING)
_ACTIVE_LIGHT_READS = _light_reads(ACTIVE_LIGHT, _T.state.in_(m.ACTIVE_STATES))
_PENDING_BY_IDS = sa_select(*PENDING_COLUMNS).where(_T.id.in_(_ids()))
_VIEWS_BY_IDS = sa_select(*VIEW_COLUMNS).where(_T.id.in_(_ids()))
_NODE_ROWS = sa_select(*NODE_COLUMNS)
_MAX_JOB_ID = sa_select(func.max(_T.id))
_STATES_BY_IDS = sa_select(_T.id, _T.state).where(_T.id.in_(_ids()))
_QUEUES = select(Queue)
_WAITS = (update(Job.__table__)
          .where(_T.id == bindparam("b_id"), _T.state == m.PENDING, _T.held == bindparam("b_held"))
          .values(reason=bindparam("b_reason"), estimated_start=bindparam("b_est"),
                  reason_detail=bindparam("b_detail")))


def job_view(r) -> JobView:
    """A JobView from one row of VIEW_COLUMNS."""
    x = r._mapping
    return JobView(
        id=x["id"], user=x["user"], queue=x["queue"], name=x["name"], gpus=x["gpus"], nodes=x["nodes"],
        cpus=x["cpus"], mem_mb=x["mem_mb"], gpu_type=x["gpu_type"], priority=x["priority"],
        submit_time=x["submit_time"], held=bool(x["held"]), time_limit_s=x["time_limit_s"],
        start_time=x["start_time"],
        allocation=tuple((a["node"], tuple(a["gpus"])) for a in x["allocation"] or ()),
        dependency=x["dependency"] or "", constraint=x["constraint"] or {}, exclusive=x["exclusive"],
        nice=x["nice"], account=x["account"], array_parent=x["array_parent"],
        array_limit=x["array_limit"], attained_gpu_s=x["attained_gpu_s"],
        preempted_at=x["kill_time"] if x["kill_reason"] == "preempt" else None,
        features=with_runtime(x["features"] or "", bool(x["image"])), nodelist=tuple(x["nodelist"] or ()),
        exclude=tuple(x["exclude"] or ()),
        predicted_runtime_s=planning_runtime(x["predicted_runtime_s"], x["prediction_confident"],
                                             x["time_limit_s"]),
        preemptions=x["preemptions"] or 0,
    )


CONTAINER_FEATURE = "container-runtime"  # a node feature the daemon adds where the agent found one


def with_runtime(features: str, image: bool) -> str:
    """A container job needs a node with a container runtime: a feature like any other."""
    if not image:
        return features
    return f"({features})&{CONTAINER_FEATURE}" if features else CONTAINER_FEATURE


def node_labels(labels: dict[str, str] | None, runtime: str | None) -> dict[str, str]:
    """A node's labels, plus the container-runtime feature where its agent found one."""
    labels = dict(labels or {})
    if runtime:
        labels[CONTAINER_FEATURE] = runtime
    return labels


_second = itemgetter(1)
# what of a pending job's light row may change while it stays PENDING (see pending_views)
_pending_key = itemgetter(_PENDING_AT["attempt"], _PENDING_AT["priority"], _PENDING_AT["held"], _PENDING_AT["nice"],
                          _PENDING_AT["time_limit_s"])


def _moves(dirty: dict[int, JobView | None], cache: dict[int, tuple[tuple, JobView]],
           skip: frozenset[int]) -> tuple[list[JobView], list[JobView]]:
    """The views that came and went between the last tuple built from `cache` and the next:
    `dirty` holds, for each job whose entry changed since, its view in the last tuple (None:
    none), and `skip` the jobs left out of both."""
    new, gone = [], []
    for jid, old in dirty.items():
        hit = cache.get(jid)
        cur = hit[1] if hit is not None else None
        if cur is old or jid in skip:
            continue
        if old is not None:
            gone.append(old)
        if cur is not None:
            new.append(cur)
    return new, gone


def view_rows(s: Session, columns, *where) -> list:
    return s.connection().execute(sa_select(*columns).where(*where)).all()


def rows_of(s: Session, statement, ids: list[int]) -> list:
    """The rows of a statement above that reads the jobs `ids`."""
    return s.connection().execute(statement, {"ids": ids}).all()


class Allocated:
    """The GPUs, CPUs and memory active jobs hold, by node, kept in step with the cycle's cache
    of active views: only the jobs that came, went or changed are added or taken away."""

    __slots__ = ("gpus", "cpus", "mem", "version")

    def __init__(self) -> None:
        self.gpus: dict[str, dict[int, int]] = {}  # node -> GPU -> how many active jobs hold it
        self.cpus: dict[str, int] = {}
        self.mem: dict[str, int] = {}
        self.version = 0  # bumped whenever what is held changes

    def _apply(self, view: JobView, sign: int) -> None:
        for node, gpus in view.allocation:
            held = self.gpus.setdefault(node, {})
            for g in gpus:
                n = held.get(g, 0) + sign
                if n > 0:
                    held[g] = n
                else:
                    held.pop(g, None)
            self.cpus[node] = self.cpus.get(node, 0) + sign * view.cpus
            self.mem[node] = self.mem.get(node, 0) + sign * view.mem_mb

    def add(self, view: JobView) -> None:
        self._apply(view, +1)
        self.version += 1

    def take(self, view: JobView) -> None:
        self._apply(view, -1)
        self.version += 1


class WaitColumns(Mapping):
    """A pending job's last reason, estimated start, hold and words, by id, read from the kept
    light rows (no per-cycle copy of the backlog)."""

    __slots__ = ("rows",)

    def __init__(self, rows: dict[int, tuple]):
        self.rows = rows

    def __getitem__(self, jid: int) -> tuple:
        r = self.rows[jid]  # PENDING_LIGHT: id, attempt, priority, held, reason, est, nice, limit, detail, ...
        return r[4], r[5], r[3], r[8]

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


class SchedulingCycle:
    """Plans with the pure planner and commits its decisions before anything is sent to a node."""

    def __init__(self, store: StateStore, links: NodeLinks, health: HealthMonitor, lifecycle: JobLifecycle,
                 dispatcher: Dispatcher, clock: Clock, policy: PolicyConfig, ledger: UsageLedger,
                 interval_s: float, metrics):
        self.store = store
        self.links = links
        self.health = health
        self.lifecycle = lifecycle
        self.dispatcher = dispatcher
        self.clock = clock
        self.policy = policy
        self.ledger = ledger
        self.interval_s = interval_s
        self.metrics = metrics
        self.last_cycle_s = 0.0
        self.on_cycle: Callable[[float, int, int], None] | None = None  # (seconds, pending, started)
        self.starting_since: dict[int, float] = {}
        self._pending_cache: dict[int, tuple[tuple, JobView]] = {}
        self._active_cache: dict[int, tuple[tuple, JobView]] = {}
        # the light rows of pending and active jobs, by id, kept up to date from the changes
        self._pending_light: dict[int, tuple] | None = None
        self._active_light: dict[int, tuple] | None = None
        self._max_id = 0  # new jobs have higher ids: read with `id > _max_id`
        self._changed: tuple[set[int], set[int]] = (set(), set())  # not yet applied: pending, active
        self._begins: dict[int, float] = {}  # pending jobs not eligible at submission: id -> eligible time
        self._pending_version = 0  # bumped whenever _pending_cache changes
        self._pending_tuple: tuple[tuple, Views] = ((-1, frozenset()), Views.of(()))  # (key, views)
        self._active_tuple: tuple[int, Views] = (-1, Views.of(()))  # (Allocated.version, views)
        # job id -> its view in the last tuple built (None: it was not there), for the jobs
        # whose cache entry changed since: what the next tuple says came and went
        self._pending_dirty: dict[int, JobView | None] = {}
        self._active_dirty: dict[int, JobView | None] = {}
        self._dependent: dict[int, JobView] = {}  # the pending views with a dependency, by id
        self._full_read_at = 0.0
        self._node_rows: TableCache[list] = TableCache(store, "node")  # the planner's columns of every node
        self._waits_due = 0.0  # when a long backlog's reasons are written again
        self._estimates_due = 0.0  # when a shorter backlog's estimated starts are written again
        self._reasons_due = 0.0  # when a middling backlog's reasons are written again
        self.waits_pending = None  # (decisions, rows) of a cycle whose waits write_waits builds
        self._ended = 0.0  # perf_counter when the loop's last cycle ended
        self._allocated = Allocated()  # what the views in _active_cache hold, by node
        self._node_views: tuple[tuple, tuple[NodeView, ...]] | None = None  # (inputs, views)
        self.refine_reason = None  # job id -> a more specific "Resources" (the autoscaler's)
        self.order = PendingOrder()  # the pending order kept between passes (no re-sort of the backlog)
        self._wake = asyncio.Event()

    def wake(self) -> None:
        self._wake.set()

    # ---------------------------------------------------------------- 1. snapshot
    def pending_views(self, s: Session, now: float | None = None) -> tuple[tuple[JobView, ...], Mapping[int, tuple]]:
        """The pending jobs as JobViews, decoded only when new or changed since the last cycle.

        While a job stays PENDING only its priority, nice, hold and time limit (`scontrol update`)
        can change; a requeue bumps its attempt. Those are the cache key; everything else is
        fetched once. Only the jobs committed transactions touched since the last cycle are
        looked at (O(changes), not O(backlog)), except on a full read.
        """
        kept, touched = self._light(s, pending=True)
        cache, begins, dirty = self._pending_cache, self._begins, self._pending_dirty
        if touched is None:  # a full read: every row is checked, and what left is dropped
            for jid in cache.keys() - kept.keys():
                dirty.setdefault(jid, cache.pop(jid)[1])
            self._pending_version += 1
            begins.clear()
            touched = kept.keys()
        missing = []
        for jid in touched:
            row = kept.get(jid)
            if row is None:
                old = cache.pop(jid, None)
                if old is not None:
                    dirty.setdefault(jid, old[1])
                    self._pending_version += 1
                begins.pop(jid, None)
                continue
            hit = cache.get(jid)
            if hit is None or hit[0] != _pending_key(row):
                missing.append(jid)
            if row[_BEGIN_AT] > row[_SUBMIT_AT]:  # --begin, or a requeue's hold-off: looked at each cycle
                begins[jid] = row[_BEGIN_AT]
            else:
                begins.pop(jid, None)
        for i in range(0, len(missing), 500):
            chunk = missing[i:i + 500]
            found = {}
            for r in rows_of(s, _PENDING_BY_IDS, chunk):
                found[r._mapping["id"]] = r
            for jid in chunk:
                r = found.get(jid)
                old = cache.pop(jid, None)
                dirty.setdefault(jid, old[1] if old is not None else None)
                if r is not None:
                    cache[jid] = (_pending_key(kept[jid]), job_view(r))
            self._pending_version += 1
        later = ()
        if now is not None and begins:  # --begin: not a candidate before its time (Slurm's BeginTime)
            later = [jid for jid, at in begins.items() if at > now and kept[jid][_PENDING_AT["held"]] == ""]
            waiting = [jid for jid in later if kept[jid][_PENDING_AT["reason"]] != BEGIN_TIME]
            if waiting:
                s.execute(update(Job.__table__).where(Job.__table__.c.id.in_(waiting)).values(reason=BEGIN_TIME))
                self._note_reasons({jid: {"reason": BEGIN_TIME} for jid in waiting})
            for jid in [jid for jid, at in begins.items() if at <= now]:
                del begins[jid]  # its time came: a candidate like any other from now on
        # the same tuple as last time when nothing changed: the planner and the ledger skip
        # their own look at it (they compare by identity)
        key = (self._pending_version, frozenset(later))
        last_key, last = self._pending_tuple
        if last_key != key:
            skip = key[1]
            if skip:
                jobs = (v for jid, (_, v) in cache.items() if jid not in skip)
            else:
                jobs = map(_second, cache.values())
            if skip == last_key[1]:  # what came and went is what the cache's entries did
                new, gone = _moves(dirty, cache, skip)
                views = Views.of(jobs, last.serial, new, gone)
                deps = self._dependent
                for v in gone:
                    if v.dependency:
                        deps.pop(v.id, None)
                for v in new:
                    if v.dependency:
                        deps[v.id] = v
            else:  # a job's --begin came or passed: compared whole by whoever reads them
                views = Views.of(jobs)
                self._dependent = {v.id: v for v in views if v.dependency}
            dirty.clear()
            self._pending_tuple = (key, views)
        return self._pending_tuple[1], WaitColumns(self._pending_light or {})

    def active_views(self, s: Session) -> tuple[JobView, ...]:
        """The active jobs as JobViews, decoded only when new or changed since the last cycle.

        A job's request and allocation are fixed while it is active (a requeue bumps its
        attempt); what may change is in ACTIVE_KEY, read without decoding any JSON column.
        """
        kept, touched = self._light(s, pending=False)
        cache, held, dirty = self._active_cache, self._allocated, self._active_dirty
        ids = (kept.keys() | cache.keys()) if touched is None else touched
        missing = []
        for jid in ids:
            row = kept.get(jid)
            if row is None:
                hit = cache.pop(jid, None)
                if hit is not None:
                    dirty.setdefault(jid, hit[1])
                    held.take(hit[1])
                continue
            hit = cache.get(jid)
            if hit is None or hit[0] != row[1:]:
                missing.append(jid)
        for i in range(0, len(missing), 500):
            chunk = missing[i:i + 500]
            found = {}
            for r in rows_of(s, _VIEWS_BY_IDS, chunk):
                found[r._mapping["id"]] = r
            for jid in chunk:
                old = cache.pop(jid, None)
                dirty.setdefault(jid, old[1] if old is not None else None)
                if old is not None:
                    held.take(old[1])
                r = found.get(jid)
                if r is not None:
                    x = r._mapping
                    view = job_view(r)
                    cache[jid] = (tuple(x[c.name] for c in ACTIVE_KEY), view)
                    held.add(view)
        if self._active_tuple[0] != held.version:  # (the same tuple as last time: see pending_views)
            new, gone = _moves(dirty, cache, frozenset())
            dirty.clear()
            self._active_tuple = (held.version, Views.of(map(_second, cache.values()),
                                                         self._active_tuple[1].serial, new, gone))
        return self._active_tuple[1]

    def _light(self, s: Session, pending: bool) -> tuple[dict[int, tuple], set[int] | None]:
        """The light rows of the pending (or active) jobs by id, and the ids of those read again
        (None when all were). Read whole on the first cycle and every FULL_READ_S, else kept from
        the last cycle and updated with the jobs committed transactions changed since (plus,
        for pending jobs, the new ones)."""
        conn = s.connection()
        mono = self.clock.monotonic()
        changed = self.store.take_changed_jobs()
        self._changed[0].update(changed)
        self._changed[1].update(changed)
        slot = 0 if pending else 1
        kept = self._pending_light if pending else self._active_light
        every, of_ids, after = _PENDING_LIGHT_READS if pending else _ACTIVE_LIGHT_READS
        touched: set[int] | None
        if kept is None or mono >= self._full_read_at:
            kept = {r[0]: tuple(r) for r in conn.execute(every)}
            touched = None
            if pending:
                self._full_read_at = mono + FULL_READ_S
                self._active_light = None  # read whole too, in this cycle
                self._max_id = max(self._max_id, conn.execute(_MAX_JOB_ID).scalar() or 0)
        else:
            touched = set(self._changed[slot])
            ids = sorted(touched)
            for i in range(0, len(ids), 500):
                chunk = ids[i:i + 500]
                found = {r[0]: tuple(r) for r in conn.execute(of_ids, {"ids": chunk})}
                for jid in chunk:
                    row = found.get(jid)
                    if row is None:
                        kept.pop(jid, None)
                    else:
                        kept[jid] = row
            if pending:
                for r in conn.execute(after, {"after": self._max_id}):
                    kept[r[0]] = tuple(r)
                    touched.add(r[0])
        self._changed[slot].clear()
        if pending:
            if touched is None:
                self._max_id = max(self._max_id, max(kept, default=0))
            elif touched:
                self._max_id = max(self._max_id, max(touched))
            self._pending_light = kept
        else:
            self._active_light = kept
        return kept, touched

    def _note_reasons(self, written: dict[int, dict[str, object]]) -> None:
        """The cycle wrote these columns of pending jobs (reason, estimated_start, reason_detail):
        keep its light rows in step without reading them again."""
        kept = self._pending_light
        if kept is None:
            return
        for jid, values in written.items():
            row = kept.get(jid)
            if row is not None:
                row = list(row)
                for name, value in values.items():
                    row[_PENDING_AT[name]] = value
                kept[jid] = tuple(row)

    def forget_light_rows(self) -> None:
        """Read every pending and active job again on the next cycle."""
        self._pending_light = self._active_light = self._node_views = None
        self._node_rows.forget()

    def snapshot(self, s: Session, now: float) -> tuple[Snapshot | None, Mapping[int, tuple]]:
        pending, rows = self.pending_views(s, now)
        if not pending:
            return None, {}
        # the columns the planner needs, as plain rows: a Node object per node per cycle (and
        # its health-check and telemetry columns) cost more than planning at 1,000 nodes
        nodes = self._node_rows.get(lambda: s.connection().execute(_NODE_ROWS).all())
        active = self.active_views(s)
        held = self._allocated  # kept in step with `active` by active_views()
        used, cpus_used, mem_used = held.gpus, held.cpus, held.mem
        # the node views change only with the node rows, what jobs hold, GPU health or links
        inputs = (self._node_rows.version, held.version, self.health.version, self.links.state_key())
        if self._node_views is not None and self._node_views[0] == inputs:
            return self._finish_snapshot(s, now, pending, active, self._node_views[1], rows)
        nothing: frozenset[int] = frozenset()
        node_views = []
        for n in nodes:
            taken = used.get(n.name, nothing)
            excluded = self.health.excluded_gpus(n.name)
            node_views.append(NodeView(
                name=n.name, gpus_total=n.gpus_total,
                free_gpus=tuple(g for g in n.gpu_indices if g not in taken and g not in excluded),
                cpus_total=n.cpus, cpus_free=n.cpus - cpus_used.get(n.name, 0),
                mem_total_mb=n.mem_mb, mem_free_mb=n.mem_mb - mem_used.get(n.name, 0),
                gpu_model=n.gpu_model, labels=node_labels(n.labels, n.runtime),
                schedulable=n.state == m.UP and self.links.connected(n.name),
            ))
        self._node_views = (inputs, tuple(node_views))
        return self._finish_snapshot(s, now, pending, active, self._node_views[1], rows)

    def _finish_snapshot(self, s: Session, now: float, pending: list[JobView], active: list[JobView],
                         node_views: tuple[NodeView, ...], rows: Mapping[int, tuple]):
        deps: set[int] = set()
        for j in self._dependent.values():  # (kept with the pending views: not a pass over the backlog)
            deps.update(depends_on(j.dependency))
        finished = {}
        if deps:
            finished = dict(rows_of(s, _STATES_BY_IDS, list(deps)))
        queues = {q.name: QueueView(q.name, q.priority, q.open, q.default_time_limit_s, q.max_time_limit_s)
                  for q in s.exec(_QUEUES).all()}
        snap = Snapshot(
            nodes=node_views, pending=pending, running=active, queues=queues,
            finished=finished, usage=self.ledger.decayed(now, active, self.policy.team_of),
        )
        return snap, rows

    # ---------------------------------------------------------------- 2-4. plan, commit, dispatch
    def run_once(self, waits_later: bool = False) -> int:
        """One cycle. With `waits_later` (the daemon's loop), a long backlog's reasons and
        estimated starts are left in `waits_pending` for `write_waits` to build off the event
        loop; otherwise they are written in the cycle's own transaction."""
        t0 = time.perf_counter()
        now = self.clock.time()
        started: list[Job] = []
        with self.store.tx() as s:
            snap, rows = self.snapshot(s, now)
            if snap is None:
                self.last_cycle_s = time.perf_counter() - t0
                return 0
            decisions = plan(snap, now, self.policy, self.order)
            starting = self.store.load_jobs(s, (st.job_id for st in decisions.starts))
            for st in decisions.starts:
                job = starting.get(st.job_id)
                if job is None or job.state != m.PENDING or job.held:
                    # the cycle's rows were out of date: never start it, and read them all again
                    log.warning("job %s was planned to start but is %s; re-reading the backlog",
                                st.job_id, "gone" if job is None else job.state)
                    self.forget_light_rows()
                    continue
                job.allocation = [{"node": n, "gpus": list(g)} for n, g in st.allocation]
                job.start_time = now
                job.estimated_start = None
                self.store.set_state(s, job, m.CONFIGURING, st.reason, allocation=job.allocation)
                started.append(job)
            mono = self.clock.monotonic()
            if len(snap.pending) < LONG_BACKLOG:
                # reasons every cycle (every REASONS_EVERY_S above REASONS_EVERY_CYCLE pending
                # jobs); their words ("waits for job N first") and estimated starts, which move
                # with every start and end, at most every ESTIMATES_EVERY_S in the daemon's loop
                estimates = not waits_later or mono >= self._estimates_due
                if estimates or len(snap.pending) <= REASONS_EVERY_CYCLE or mono >= self._reasons_due:
                    if estimates:
                        self._estimates_due = mono + ESTIMATES_EVERY_S
                    self._reasons_due = mono + REASONS_EVERY_S
                    if estimates and waits_later and len(snap.pending) > REASONS_EVERY_CYCLE:
                        # every pending job's words and estimate move with each start: 1,900
                        # rows were one 36 ms UPDATE that stalled the API; after the cycle,
                        # in pieces, the loop serving requests in between (write_waits)
                        self.waits_pending = (decisions, rows)
                    else:
                        self._commit_waits(s, decisions.waits, rows, estimates)
            elif mono >= self._waits_due:
                self._waits_due = mono + WAITS_EVERY_S
                if waits_later:
                    self.waits_pending = (decisions, rows)
                else:
                    self._commit_waits(s, decisions.waits, rows)
            for c in decisions.cancels:
                job = s.get(Job, c.job_id)
                job.end_time = now
                self.store.set_state(s, job, m.CANCELLED, c.reason)
            for p in decisions.preempts:
                job = s.get(Job, p.job_id)
                if job is None or job.state not in m.ACTIVE_STATES or job.kill_reason:
                    continue
                job.reason = p.reason
                job.kill_grace_s = p.grace_period_s
                self.lifecycle.kill(s, job, "preempt")
                self.store.record(s, "trainyard", "job.preempt", str(job.id),
                                  {"reason": p.reason, "for_job": p.for_job, "grace_s": p.grace_period_s})
        self.last_cycle_s = time.perf_counter() - t0
        self.metrics.schedule_cycle.observe(self.last_cycle_s)
        if self.on_cycle is not None:
            self.on_cycle(self.last_cycle_s, len(snap.pending), len(started))
        mono = self.clock.monotonic()
        for job in started:
            self.starting_since[job.id] = mono
            self.dispatcher.dispatch(job)
        return len(started)

    async def write_waits(self) -> None:
        """Build a long backlog's waits (O(backlog): ~0.3 s at 10,000 pending jobs) in a worker
        thread, so that the event loop goes on serving the API and the node links meanwhile (the
        interpreter switches threads every few milliseconds), then write what changed. No cycle
        runs in between (the loop awaits this), so the pass's state is not touched while it is
        read; a job held, released or ended meanwhile keeps what that change wrote (the UPDATE
        matches only jobs still pending with the hold the pass saw)."""
        decisions, rows = self.waits_pending
        self.waits_pending = None
        # while the build runs, the loop waits at most 0.5 ms (not 5) for the interpreter's lock
        # each time it has I/O to serve
        switch = sys.getswitchinterval()
        sys.setswitchinterval(WAITS_SWITCH_S)
        try:
            waits = await asyncio.to_thread(lambda: decisions.waits)
        finally:
            sys.setswitchinterval(switch)
        # written a chunk per transaction, the loop serving the API in between: the first pass
        # over thousands of new jobs changes every row (5,000 rows took 51 ms in one go)
        waits = list(waits)
        for i in range(0, len(waits), WAITS_WRITE_CHUNK):
            if i:
                await asyncio.sleep(0)
            with self.store.tx() as s:
                self._commit_waits(s, waits[i:i + WAITS_WRITE_CHUNK], rows)

    def _commit_waits(self, s: Session, waits, rows: Mapping[int, tuple], estimates: bool = True) -> None:
        """Write only the pending reasons, words and estimated starts that changed (one batched
        UPDATE). Without `estimates`, a job whose reason stays is not written: its words and
        estimated start name the jobs ahead of it and when they end, and move with every start
        and end (a job written for its reason gets its new words and estimate too)."""
        changed = []
        for w in waits:
            reason, est, held, detail = rows[w.job_id]
            new, words = w.reason, w.detail
            if new == HELD:  # Slurm tells a user's hold from an operator's
                new = m.HOLD_REASONS.get(held, m.HELD_USER)
            elif new == RESOURCES and self.refine_reason is not None:  # e.g. why a scale-up failed
                refined = self.refine_reason(w.job_id)
                if refined:
                    new, words = refined, ""
            if reason != new or (estimates and (est != w.estimated_start or (detail or "") != words)):
                changed.append({"b_id": w.job_id, "b_reason": new, "b_est": w.estimated_start,
                                "b_detail": words, "b_held": held})
        if changed:
            s.execute(_WAITS, changed)
            self._note_reasons({c["b_id"]: {"reason": c["b_reason"], "estimated_start": c["b_est"],
                                            "reason_detail": c["b_detail"]} for c in changed})

    async def loop(self, running) -> None:
        while running():
            # with nothing new, re-plan now and then (ages, reservations), but a big queue that
            # costs long cycles is re-planned less often when nothing changes
            idle = max(self.interval_s, 10 * self.last_cycle_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), idle)
            # Pace the cycles: a burst of submissions is planned together, and scheduling never
            # takes more than about a quarter of the event loop's time from the API. A daemon
            # that planned nothing for IDLE_PLAN_S plans a submission at once (after this turn
            # of the loop, so that submissions that came together are planned together); a
            # busy one waits 2 ms or 3x the last cycle, which gathers submissions into fewer
            # cycles.
            if time.perf_counter() - self._ended >= max(IDLE_PLAN_S, 10 * self.last_cycle_s):
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(min(0.25, max(0.002, 3 * self.last_cycle_s)))
            self._wake.clear()
            try:
                self.run_once(waits_later=True)
                if self.waits_pending is not None:
                    await self.write_waits()
            except Exception:
                self.waits_pending = None
                log.exception("scheduling cycle failed")
            self._ended = time.perf_counter()
