"""State and audit: transactions, the audit/event trail, publishing to streams, the active-job index
and the finished jobs' counts."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Iterator
from itertools import chain
from types import SimpleNamespace
from typing import Generic, TypeVar

from sqlalchemy import ColumnElement, Select, bindparam, event, func, insert, union_all
from sqlalchemy import select as sa_select
from sqlalchemy.engine import Engine
from sqlmodel import Session, col
from sqlmodel import select as sm_select

from .. import models as m
from ..models import Event, Job, Node, Queue
from .clock import Clock

log = logging.getLogger("trainyard.daemon")

STREAM_BACKLOG_MAX = 10000  # a reader this far behind is dropped rather than grow without bound

# built once, their values bound at each execution: constructing a statement (and working out
# its cache key) each time cost more than running it (see scheduling.py's statements)
_JOBS_BY_IDS = sm_select(Job).where(col(Job.id).in_(bindparam("ids", expanding=True)))
_EVENT_INSERT = insert(Event.__table__)
_EVENT_INSERT_IDS = insert(Event.__table__).returning(Event.__table__.c.id, sort_by_parameter_order=True)


def _counts_of(states) -> Select:
    t = Job.__table__.c
    return (sa_select(t.state, t.queue, func.count()).where(t.state.in_(sorted(states)))
            .group_by(t.state, t.queue))


def jobs_and_tasks(ids) -> ColumnElement[bool]:
    """`job.id` is one of `ids` or a task of an array among them (`sacct -j`, `squeue -j`, a
    listing's `ids`): the primary key and the array_parent index lead, whatever else filters."""
    t = Job.__table__.c
    chosen = sorted(ids)
    return t.id.in_(union_all(sa_select(t.id).where(t.id.in_(chosen)),
                              sa_select(t.id).where(t.array_parent.in_(chosen))))


def state_among(states) -> ColumnElement[bool]:
    """`job.state IN states`, written so that no index on `state` can lead the plan: over a
    long history that index leads through every job of those states ever run, then sorts them,
    where the query's own lead (a window of end_time, a list of ids) reads a few. SQLite plans
    without statistics and took that path (1.5-2 s at 500,000 jobs)."""
    return func.coalesce(Job.__table__.c.state, "").in_(sorted(states))


# jobs by (state, queue): the live states are a range of the (state, queue) index; the final
# states hold every job ever run
LIVE_STATES = frozenset(m.JOB_STATES) - m.FINAL_STATES
_LIVE_COUNTS = _counts_of(LIVE_STATES)
_FINAL_COUNTS = _counts_of(m.FINAL_STATES)


T = TypeVar("T")


class ActiveIndex:
    """Which active jobs hold an allocation on which node, and how many GPUs each node has
    allocated: O(jobs on the node) per question, never a scan of every active job. Kept from the
    allocations of committed transactions (StateStore.load_index, after-commit hooks)."""

    def __init__(self) -> None:
        self.by_node: dict[str, set[int]] = {}
        self.nodes_of: dict[int, tuple[str, ...]] = {}
        self.held: dict[int, tuple[tuple[int, ...], ...]] = {}  # GPU indexes per node, as nodes_of
        self.gpus_on: dict[str, int] = {}  # the sum of len(held) per node

    def add_allocation(self, job_id: int, allocation) -> None:
        """Index a job by its allocation column ([{"node": ..., "gpus": [...]}, ...])."""
        self.discard(job_id)
        alloc = allocation or ()
        nodes = self.nodes_of[job_id] = tuple(a["node"] for a in alloc)
        held = self.held[job_id] = tuple(tuple(int(g) for g in a["gpus"]) for a in alloc)
        for n, gpus in zip(nodes, held, strict=True):
            self.by_node.setdefault(n, set()).add(job_id)
            self.gpus_on[n] = self.gpus_on.get(n, 0) + len(gpus)

    def discard(self, job_id: int) -> None:
        for n, gpus in zip(self.nodes_of.pop(job_id, ()), self.held.pop(job_id, ()), strict=True):
            left = self.gpus_on.get(n, 0) - len(gpus)
            if left > 0:
                self.gpus_on[n] = left
            else:
                self.gpus_on.pop(n, None)
            ids = self.by_node.get(n)
            if ids is not None:
                ids.discard(job_id)
                if not ids:
                    del self.by_node[n]

    def on(self, node: str) -> set[int]:
        return set(self.by_node.get(node, ()))

    def gpus_held_on(self, node: str) -> dict[int, int]:
        """GPU index -> the active job allocated it, on `node` (jobs indexed by allocation)."""
        out: dict[int, int] = {}
        for jid in self.by_node.get(node, ()):
            for n, gpus in zip(self.nodes_of[jid], self.held.get(jid, ()), strict=False):
                if n == node:
                    out.update(dict.fromkeys(gpus, jid))
        return out

    def gpus_used(self) -> dict[str, int]:
        """GPUs allocated to active jobs, by node."""
        return dict(self.gpus_on)

    def __len__(self) -> int:
        return len(self.nodes_of)


class TableCache(Generic[T]):
    """A value derived from a table ("node" or "queue"), computed again only after a committed
    transaction of this process wrote that table (StateStore.versions) or it took office. Valid
    where this daemon's writes are the only ones, the leader; a standby asks with `fresh=True`."""

    def __init__(self, store: StateStore, table: str) -> None:
        self.versions, self.table = store.versions, table
        self._seen: tuple[int, T] | None = None

    def get(self, compute: Callable[[], T], fresh: bool = False) -> T:
        version = self.versions[self.table]
        if fresh:
            self._seen = None
            return compute()
        if self._seen is None or self._seen[0] != version:
            self._seen = (version, compute())
        return self._seen[1]

    @property
    def version(self) -> int:
        """The table's version the value was computed at (-1: none yet)."""
        return -1 if self._seen is None else self._seen[0]

    def forget(self) -> None:
        self._seen = None


@event.listens_for(Session, "after_flush")
def _note_flushed_jobs(session: Session, _context) -> None:
    """Collect the ids of the jobs a transaction of StateStore.tx() wrote (see changed_jobs)."""
    touched = session.info.get("jobs_touched")
    if touched is not None:
        for obj in chain(session.new, session.dirty, session.deleted):
            if isinstance(obj, Job) and obj.id is not None:
                touched.add(obj.id)
            elif isinstance(obj, (Node, Queue)):
                session.info["tables_touched"].add(obj.__tablename__)


class StateStore:
    """One transaction per change; events and index updates take effect only after the commit."""

    def __init__(self, engine: Engine, clock: Clock):
        self.engine = engine
        self.clock = clock
        self.active = ActiveIndex()
        self.subscribers: set[asyncio.Queue] = set()
        self.on_job_state: list[Callable[[Job, str], None]] = []  # metrics, notifications
        # set by the leadership: aborts a write transaction of a daemon that does not lead
        self.fence: Callable[[object], None] | None = None
        # ids of jobs whose rows committed transactions changed through the ORM (every change of
        # an existing job does; new jobs are Core inserts with higher ids): what the scheduling
        # cycle re-reads instead of the whole backlog (take_changed_jobs)
        self.changed_jobs: set[int] = set()
        # the same, for the second reader: the deadlines of time limits and kills (Deadlines)
        self.deadline_changes: set[int] = set()
        # per table, bumped by every committed transaction that wrote it: what the caches of
        # its rows compare (TableCache)
        self.versions: dict[str, int] = {"node": 0, "queue": 0}
        # jobs in final states by (state, queue), kept from the committed state changes while
        # `keeps_counts()` (the leader: a standby does not see the leader's commits, and counts
        # in the database); None until first asked for (job_counts)
        self._final: dict[tuple[str, str], int] | None = None
        self.keeps_counts: Callable[[], bool] = lambda: True

    def load_index(self) -> None:
        t = Job.__table__.c
        with self.engine.connect() as conn:
            rows = conn.execute(sa_select(t.id, t.allocation).where(t.state.in_(m.ACTIVE_STATES))).all()
        for jid, alloc in rows:
            self.active.add_allocation(jid, alloc)

    def forget_cached(self) -> None:
        """On taking office: another daemon may have written nodes, queues and final states
        meanwhile, which this process's versions did not see. Every TableCache computes again;
        final states are counted again."""
        for table in self.versions:
            self.versions[table] += 1
        self.forget_counts()

    @contextlib.contextmanager
    def tx(self) -> Iterator[Session]:
        """One transaction; what it recorded is published only once it has committed."""
        s = Session(self.engine, expire_on_commit=False)
        events: list[dict] = []
        after: list[Callable[[], None]] = []
        touched: set[int] = set()
        s.info["events"] = events
        s.info["after"] = after
        s.info["jobs_touched"] = touched
        s.info["tables_touched"] = tables = set()
        try:
            if self.fence is not None:
                self.fence(s.connection())
            yield s
            if events:
                self._insert_events(s, events)
            s.commit()
        except BaseException:
            s.rollback()
            raise
        finally:
            s.close()
        self.changed_jobs |= touched
        self.deadline_changes |= touched
        for table in tables:
            if table in self.versions:
                self.versions[table] += 1
        for fn in after:
            try:
                fn()
            except Exception:  # a hook (metrics, notifications) never undoes or stops the others
                log.exception("after-commit hook failed")
        for ev in events:
            self.publish(ev)

    def take_changed_jobs(self) -> set[int]:
        """The jobs changed since the last call (for one reader: the scheduling cycle)."""
        out, self.changed_jobs = self.changed_jobs, set()
        return out

    def take_deadline_changes(self) -> set[int]:
        """The jobs changed since the last call (for one reader: housekeeping's Deadlines)."""
        out, self.deadline_changes = self.deadline_changes, set()
        return out

    def read(self) -> Session:
        return Session(self.engine)

    # ---------------------------------------------------------------- job counts
    def job_counts(self, s: Session, final: bool = True) -> list[tuple[str, str, int]]:
        """Jobs by (state, queue). The live states are counted in the database; the final ones
        (every job ever run: 120 ms to count at a million jobs, and the TUI asks on every
        refresh) are counted there once and then kept from the committed state changes."""
        conn = s.connection()
        rows = [tuple(r) for r in conn.execute(_LIVE_COUNTS).all()]
        if final:
            keep = self.keeps_counts()  # a standby counts every time: the leader changes them
            counts = self._final if keep else None
            if counts is None:
                counts = {(st, q): n for st, q, n in conn.execute(_FINAL_COUNTS).all()}
                self._final = counts if keep else None
            rows += [(st, q, n) for (st, q), n in counts.items() if n]
        return rows

    def forget_counts(self) -> None:
        """Count the final states in the database again (another daemon may have led meanwhile)."""
        self._final = None

    def removed_final(self, jobs: list[tuple[str, str]]) -> None:
        """Finished jobs, as (state, queue), were removed from the table (retention)."""
        for state, queue in jobs:
            self._count_final(state, "", queue)

    def _count_final(self, old: str, new: str, queue: str) -> None:
        counts = self._final
        if counts is None:  # not counted yet: the count, when it is made, sees this commit
            return
        if old in m.FINAL_STATES:
            counts[old, queue] = counts.get((old, queue), 0) - 1
        if new in m.FINAL_STATES:
            counts[new, queue] = counts.get((new, queue), 0) + 1

    @staticmethod
    def load_jobs(s: Session, ids) -> dict[int, Job]:
        """The jobs of `ids` in `s`, read with one SELECT per 500: a loop over several jobs that
        called `s.get` for each would flush the previous one's changes and read the next one
        alone; after this, `s.get` finds them in the session, and their UPDATEs are flushed
        together."""
        ids = sorted(set(ids))
        out: dict[int, Job] = {}
        for i in range(0, len(ids), 500):
            for job in s.exec(_JOBS_BY_IDS, params={"ids": ids[i:i + 500]}).all():
                out[job.id] = job
        return out

    def record(self, s: Session, actor: str, action: str, target: str, detail: dict | None = None,
               address: str = "") -> dict:
        """Add an audit/state event to the transaction; published once the transaction commits."""
        ev = {"time": self.clock.time(), "actor": actor, "action": action, "target": target,
              "address": address, "detail": detail or {}}
        s.info["events"].append(ev)  # written by tx() just before it commits, with the others
        return ev

    @staticmethod
    def _insert_events(s: Session, events: list[dict]) -> None:
        """A transaction's events in one Core INSERT (executemany; ids returned in order): events
        are written on every change, and a statement each (with the ORM flush each one forced
        before it) cost more than the rows."""
        if len(events) == 1:  # the common case: a plain INSERT costs less than one with RETURNING
            ev = events[0]
            ev["id"] = s.execute(_EVENT_INSERT, ev).inserted_primary_key[0]
            return
        ids = s.execute(_EVENT_INSERT_IDS, events).scalars().all()
        for ev, eid in zip(events, ids, strict=True):
            ev["id"] = eid

    def audit(self, actor: str, action: str, target: str, detail: dict | None = None,
              address: str = "") -> None:
        """Record one event in a transaction of its own (refused calls, node problems)."""
        with self.tx() as s:
            self.record(s, actor, action, target, detail, address)

    def after_commit(self, s: Session, fn: Callable[[], None]) -> None:
        s.info["after"].append(fn)

    def set_state(self, s: Session, job: Job, state: str, reason: str = "", actor: str = "trainyard",
                  **detail) -> None:
        old = job.state
        job.state = state
        job.reason = reason
        job.reason_detail = ""  # the planner's words for a pending reason; set again while pending
        s.add(job)
        self.record(s, actor, "job.state", str(job.id),
                    {"state": state, "reason": reason, "user": job.user, **detail})
        jid = job.id
        if state in m.ACTIVE_STATES:
            alloc = [{"node": a["node"], "gpus": a["gpus"]} for a in job.allocation]
            self.after_commit(s, lambda: self.active.add_allocation(jid, alloc))
        elif old in m.ACTIVE_STATES:
            self.after_commit(s, lambda: self.active.discard(jid))
        if state != old and (state in m.FINAL_STATES or old in m.FINAL_STATES):
            queue = job.queue
            self.after_commit(s, lambda: self._count_final(old, state, queue))
        if self.on_job_state:
            seen = SimpleNamespace(id=jid, user=job.user, account=job.account, queue=job.queue, state=state,
                                   name=job.name, gpus=job.gpus, nodes=job.nodes,
                                   attained_gpu_s=job.attained_gpu_s, allocation=list(job.allocation or ()),
                                   mail_type=job.mail_type or "", mail_user=job.mail_user or "",
                                   notify_url=job.notify_url or "",
                                   start_time=job.start_time, end_time=job.end_time, reason=reason,
                                   exit_code=detail.get("exit_code", job.exit_code))
            for hook in self.on_job_state:
                self.after_commit(s, lambda hook=hook, seen=seen, old=old: hook(seen, old))

    # ---------------------------------------------------------------- streams
    def subscribe(self) -> asyncio.Queue:
        q: asyncio.Queue = asyncio.Queue()
        self.subscribers.add(q)
        return q

    def unsubscribe(self, q: asyncio.Queue) -> None:
        self.subscribers.discard(q)

    def publish(self, data: dict) -> None:
        for q in list(self.subscribers):
            if q.qsize() > STREAM_BACKLOG_MAX:
                self.subscribers.discard(q)
                q.put_nowait(None)
                continue
            q.put_nowait(data)

    def close_streams(self) -> None:
        """End every server-sent event stream (their readers reconnect to the next daemon)."""
        for q in list(self.subscribers):
            q.put_nowait(None)
        self.subscribers.clear()


def event_json(ev: Event) -> dict:
    return {"id": ev.id, "time": ev.time, "actor": ev.actor, "action": ev.action, "target": ev.target,
            "address": ev.address, "detail": ev.detail}
