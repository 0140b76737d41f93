"""Accounting in the daemon: job history for sacct, GPU idle history, and sreport-like usage.

The job history is the jobs table (one record per job: its last run). GPU idle time comes from
telemetry: for each GPU the daemon keeps the spans during which its utilisation was under
`[accounting] idle_threshold_pct` (a sample stands until the next, for at most
`max_sample_gap_s`), bounded to `util_history_days`, and appends each closed span to
`<home>/usage/idle.jsonl` so a restart keeps them. The sums are scheduler/accounting.py's.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sqlalchemy import select as sa_select
from sqlalchemy import union_all
from sqlmodel import or_, select

from .. import accounting as acct
from ..models import Job, Node
from ..planner.policy import DEFAULT_TEAM
from ..settings import AccountingSettings
from ..store import row_objects
from .caller import Caller
from .clock import Clock
from .errors import Forbidden, Invalid
from .state import StateStore, jobs_and_tasks, state_among

log = logging.getLogger("trainyard.accounting")

MAX_SPANS_PER_GPU = 100_000


class IdleHistory:
    """Per-GPU idle spans from telemetry samples, bounded in time and count."""

    def __init__(self, path: Path, threshold_pct: float, max_gap_s: float, keep_s: float):
        self.path = path
        self.threshold = threshold_pct
        self.max_gap = max_gap_s
        self.keep_s = keep_s
        self.spans: dict[tuple[str, int], list[tuple[float, float]]] = {}
        self.last: dict[tuple[str, int], tuple[float, bool]] = {}  # GPU -> (time, idle)
        # closed spans not yet on disk: written at most once a second (a 1,000-node cluster
        # closes thousands a second), so a crash loses at most the last second of idle time
        self._unwritten: list[dict] = []
        self._written_at = 0.0

    def load(self, now: float) -> None:
        """Read the spans kept before a restart (older than the history are left out, and
        the file is rewritten without them)."""
        try:
            lines = self.path.read_text().splitlines()
        except FileNotFoundError:
            return
        for line in lines:
            try:
                r = json.loads(line)
                self._add((str(r["node"]), int(r["gpu"])), float(r["start"]), float(r["end"]))
            except (ValueError, KeyError, TypeError):
                continue
        self.trim(now)
        self._rewrite()

    def observe(self, node: str, sample: dict) -> None:
        """One telemetry sample of a node: close the span its previous sample opened."""
        t = sample.get("time")
        if not isinstance(t, int | float):
            return
        closed = []
        for g in sample.get("gpus") or ():
            util, index = g.get("util_gpu"), g.get("index")
            if not isinstance(index, int) or not isinstance(util, int | float):
                continue
            key = (node, index)
            prev = self.last.get(key)
            if prev is not None and prev[1] and t > prev[0]:
                end = min(t, prev[0] + self.max_gap)
                self._add(key, prev[0], end)
                closed.append({"node": node, "gpu": index, "start": prev[0], "end": end})
            self.last[key] = (float(t), util < self.threshold)
        if closed:
            self._unwritten.extend(closed)
            if t - self._written_at >= 1.0 or t < self._written_at:
                self.flush(t)

    def flush(self, now: float) -> None:
        """Write the closed spans kept in memory since the last write."""
        rows, self._unwritten = self._unwritten, []
        self._written_at = now
        if rows:
            self._append(rows)

    def _add(self, key: tuple[str, int], a: float, b: float) -> None:
        spans = self.spans.setdefault(key, [])
        if spans and spans[-1][1] >= a and spans[-1][0] <= a:
            spans[-1] = (spans[-1][0], max(b, spans[-1][1]))
        else:
            spans.append((a, b))
        if len(spans) > MAX_SPANS_PER_GPU:
            del spans[: len(spans) - MAX_SPANS_PER_GPU]

    def trim(self, now: float) -> None:
        cutoff = now - self.keep_s
        for key, spans in list(self.spans.items()):
            kept = [s for s in spans if s[1] > cutoff]
            if kept:
                self.spans[key] = kept
            else:
                del self.spans[key]

    def index(self, now: float) -> acct.UtilIndex:
        """Every span, with the ones the latest samples opened, up to now."""
        spans = {k: list(v) for k, v in self.spans.items()}
        for key, (t, idle) in self.last.items():
            if idle and now > t:
                spans.setdefault(key, []).append((t, min(now, t + self.max_gap)))
        return acct.UtilIndex.from_spans(spans)

    def _append(self, rows: list[dict]) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with open(self.path, "a") as f:
                f.writelines(json.dumps(r) + "\n" for r in rows)
        except OSError as e:  # the history in memory goes on; only a restart would lose these
            log.warning("cannot keep GPU idle spans in %s: %s", self.path, e)

    def _rewrite(self) -> None:
        rows = [{"node": n, "gpu": g, "start": a, "end": b}
                for (n, g), spans in self.spans.items() for a, b in spans]
        tmp = self.path.with_suffix(".tmp")
        try:
            tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
            tmp.replace(self.path)
        except OSError as e:
            log.warning("cannot rewrite %s: %s", self.path, e)


def record_of(job, team_of: Callable[[str], str]) -> acct.JobRecord:
    return acct.JobRecord(
        id=job.id, user=job.user, account=job.account or team_of(job.user), queue=job.queue,
        start=job.start_time, end=job.end_time,
        allocation=tuple((a["node"], tuple(a["gpus"])) for a in job.allocation or ()),
        name=job.name, state=job.state, submit=job.submit_time, exit_code=job.exit_code)


def record_json(r: acct.JobRecord) -> dict[str, Any]:
    # field by field: dataclasses.asdict deep-copies, a third of a day's sacct at 2,000 jobs
    return {"id": r.id, "user": r.user, "account": r.account, "queue": r.queue, "start": r.start, "end": r.end,
            "allocation": [{"node": n, "gpus": list(g)} for n, g in r.allocation], "name": r.name,
            "state": r.state, "submit": r.submit, "exit_code": r.exit_code}


def request_json(job) -> dict[str, Any]:
    """What the job asked for and why it waits, beside its accounting record: sacct's ReqCPUS,
    ReqMem, Timelimit and AllocGRES, and its array (JobID as ARRAY_TASK)."""
    return {"gpus": job.gpus, "nodes": job.nodes, "cpus": job.cpus, "mem": job.mem_mb,
            "time_limit": job.time_limit_s, "reason": job.reason, "held": job.held,
            "array_job_id": job.array_parent, "array_task_id": job.array_task_id}


_RECORD_FIELDS = frozenset(acct.JobRecord.__dataclass_fields__)


def record_from_json(d: dict[str, Any]) -> acct.JobRecord:
    """The client's way back from the API's records to the pure accounting's (the request's
    fields beside them are not the accounting's)."""
    alloc = tuple((a["node"], tuple(a["gpus"])) for a in d.get("allocation") or ())
    return acct.JobRecord(**{**{k: v for k, v in d.items() if k in _RECORD_FIELDS}, "allocation": alloc})


def history_query(a: float, b: float, user: str | None = None, states: frozenset[str] = frozenset(),
                  limit: int = 100_000, ids: frozenset[int] = frozenset()):
    """The jobs that existed in [a, b), oldest first: submitted before b, not ended before a.
    The window leads the plan: the live jobs (no end_time) and a range of the end_time index, a
    small part of a table that holds every job ever run, where the ordering by id would make a
    planner without statistics scan it all; the states never lead (`state_among`). With `ids`,
    the jobs of those ids and the tasks of the arrays among them lead instead (sacct -j)."""
    t = Job.__table__.c
    if ids:
        q = sa_select(Job.__table__).where(jobs_and_tasks(ids), t.submit_time < b,
                                           or_(t.end_time.is_(None), t.end_time >= a))
    else:
        window = union_all(sa_select(t.id).where(t.end_time.is_(None)), sa_select(t.id).where(t.end_time >= a))
        q = sa_select(Job.__table__).where(t.id.in_(window), t.submit_time < b)
    if user is not None:
        q = q.where(t.user == user)
    if states:
        q = q.where(state_among(states))
    return q.order_by(t.id).limit(limit)


def usage_query(a: float, b: float):
    """The runs that overlap [a, b): started before b, not ended before a (the end_time index)."""
    t = Job.__table__.c
    return sa_select(Job.__table__).where(t.start_time.is_not(None), t.start_time < b,
                                          or_(t.end_time.is_(None), t.end_time >= a))


@dataclass(frozen=True)
class Sacct:
    """A checked sacct request: the window [start, end), `now` as it was asked, and what
    narrows it; `teams` is each user's team (the account of a job that names none)."""

    start: float
    end: float
    now: float
    user: str | None
    states: frozenset[str]
    limit: int
    ids: frozenset[int]
    teams: dict[str, str]


def sacct_jobs(engine, q: Sacct) -> dict[str, Any]:
    """sacct's answer: a read of committed rows and nothing else, so it runs on the daemon's
    read threads or in a reader process (scheduler.daemon.readers)."""
    with engine.connect() as conn:
        rows = row_objects(conn.execute(history_query(q.start, q.end, q.user, q.states, q.limit, q.ids)))
    teams = q.teams

    def team_of(user: str) -> str:
        return teams.get(user, DEFAULT_TEAM)

    records = [{**record_json(record_of(j, team_of)), **request_json(j)} for j in rows]
    return {"start": q.start, "end": q.end, "now": q.now, "jobs": records}


class Accounting:
    """Answers sacct and sreport from the jobs table and the idle history."""

    def __init__(self, store: StateStore, settings: AccountingSettings, home: Path, clock: Clock,
                 teams: Callable[[], Mapping[str, str]]):
        self.store = store
        self.settings = settings
        self.prices = settings.price_book()
        self.clock = clock
        self.teams = teams  # each user's team, as configured now
        self.idle = IdleHistory(home / "usage" / "idle.jsonl", settings.idle_threshold_pct,
                                settings.max_sample_gap_s, settings.util_history_days * 86400)

    def team_of(self, user: str) -> str:
        return self.teams().get(user, DEFAULT_TEAM)

    def load(self) -> None:
        self.idle.load(self.clock.time())

    def observe(self, node: str, sample: dict) -> None:
        self.idle.observe(node, sample)

    @staticmethod
    def window(start: float | None, end: float | None, now: float) -> tuple[float, float]:
        end = now if end is None else end
        start = end - 86400 if start is None else start
        if end <= start:
            raise Invalid(f"end: the window ends ({end:.0f}) before it starts ({start:.0f}); "
                          "give -E after -S", "end")
        return start, end

    def sacct(self, caller: Caller, start: float | None, end: float | None, user: str | None = None,
              states: frozenset[str] = frozenset(), limit: int = 100_000,
              ids: frozenset[int] = frozenset()) -> Sacct:
        """A sacct request, checked (Invalid, Forbidden) but not yet read: jobs that existed in
        [start, end), by default the last 24 hours; a user's own unless the caller operates.
        With `ids`: those jobs and the tasks of the arrays among them, at any time unless a
        start is given (as sacct -j)."""
        now = self.clock.time()
        if ids and start is None:
            start = 0.0
        a, b = self.window(start, end, now)
        if user is None and not caller.at_least("operator"):
            user = caller.user
        if user is not None and user != caller.user and not caller.at_least("operator"):
            raise Forbidden(f"{caller.user} may read only their own jobs' accounting, not {user}'s")
        return Sacct(a, b, now, user, states, limit, ids, dict(self.teams()))

    def jobs(self, caller: Caller, start: float | None, end: float | None, user: str | None = None,
             states: frozenset[str] = frozenset(), limit: int = 100_000,
             ids: frozenset[int] = frozenset()) -> dict[str, Any]:
        """sacct's answer, read here (`sacct` and `sacct_jobs`)."""
        return sacct_jobs(self.store.engine, self.sacct(caller, start, end, user, states, limit, ids))

    def report(self, caller: Caller, by: str, start: float | None, end: float | None) -> dict[str, Any]:
        """Allocated GPU-hours, idle GPU-hours and cost per user, account or queue over [start, end)."""
        if not caller.at_least("operator"):
            raise Forbidden(f"usage reports need the operator role; {caller.user} is {caller.role}")
        if by not in acct.GROUPINGS:
            raise Invalid(f"by: cannot group by {by!r}; use one of {', '.join(acct.GROUPINGS)}", "by")
        now = self.clock.time()
        a, b = self.window(start, end, now)
        with self.store.read() as s:
            records = [record_of(j, self.team_of) for j in row_objects(s.connection().execute(usage_query(a, b)))]
            pools = {n.name: n.pool for n in s.exec(select(Node)).all()}
        rows = acct.usage(records, (a, b), pools, self.prices, self.idle.index(now), by, now)
        cur = self.prices.currency
        return {"by": by, "start": a, "end": b, "currency": cur,
                "idle_threshold_pct": self.settings.idle_threshold_pct,
                "rows": acct.report_rows(rows, cur), "total": acct.report_rows([acct.totals(rows)], cur)[0]}
