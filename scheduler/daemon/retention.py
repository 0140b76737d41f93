"""How long finished jobs and events are kept: `[accounting] purge_jobs_after_days` and
`purge_events_after_days`, as slurmdbd's PurgeJobAfter and PurgeEventAfter. Unset (the
default), nothing is ever removed, as in Slurm.

The leader removes what is past its age a batch per housekeeping tick, each batch a transaction
of its own read through an index (end_time for jobs, time for events), so a first purge of a
long history never holds the event loop or the database for long. What stays, whatever its age:

- jobs that have not ended, and jobs a waiting job's dependency names (`afterok:ID` reads its
  state, and a job that is gone would make it wait forever);
- the runs the fair-share ledger is rebuilt from when a daemon takes office (ten half-lives);
- the newest job and the newest event: SQLite numbers a new row after the largest id there is,
  so an emptied table would hand out job ids (and event ids, which stream readers resume from)
  a second time.

A purged job is gone from `sacct`, `sreport` and the listings, as in Slurm; its stored output
follows `[logs] retention_days`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from sqlalchemy import delete, func
from sqlalchemy import select as sa_select

from .. import models as m
from ..models import Event, Job
from ..planner import depends_on
from .state import StateStore, state_among

log = logging.getLogger("trainyard.daemon")

BATCH = 1000  # rows a transaction removes: a few ms of the event loop each
DAY = 86400.0


@dataclass
class Purged:
    jobs: int = 0
    events: int = 0


class Retention:
    def __init__(self, store: StateStore, jobs_after_days: float | None, events_after_days: float | None,
                 ledger_window_s: float, batch: int = BATCH):
        self.store = store
        self.jobs_after_s = jobs_after_days * DAY if jobs_after_days else None
        self.events_after_s = events_after_days * DAY if events_after_days else None
        self.ledger_window_s = ledger_window_s
        self.batch = batch
        self.total = Purged()

    @property
    def active(self) -> bool:
        return self.jobs_after_s is not None or self.events_after_s is not None

    def jobs_cutoff(self, now: float) -> float | None:
        """Jobs that ended before this go (the fair-share ledger's window stays)."""
        if self.jobs_after_s is None:
            return None
        return now - max(self.jobs_after_s, self.ledger_window_s)

    def step(self, now: float) -> Purged:
        """One batch of each kind; what it removed (less than a batch each: nothing is left)."""
        done = Purged()
        cutoff = self.jobs_cutoff(now)
        if cutoff is not None:
            done.jobs = self._jobs(cutoff)
        if self.events_after_s is not None:
            done.events = self._events(now - self.events_after_s)
        if done.jobs or done.events:
            self.total.jobs += done.jobs
            self.total.events += done.events
            log.info("retention: removed %d finished jobs (ended before %s) and %d events; %d and %d so far",
                     done.jobs, _day(cutoff), done.events, self.total.jobs, self.total.events)
        return done

    def _jobs(self, cutoff: float) -> int:
        t = Job.__table__.c
        with self.store.tx() as s:
            kept = {s.execute(sa_select(func.max(t.id))).scalar()}
            for dep in s.execute(sa_select(t.dependency).where(state_among(m.WAITING_STATES), t.dependency != "")
                                 ).scalars():
                kept.update(depends_on(dep))
            rows = s.execute(sa_select(t.id, t.state, t.queue)
                             .where(t.end_time < cutoff, state_among(m.FINAL_STATES),
                                    t.id.not_in(sorted(i for i in kept if i is not None)))
                             .order_by(t.end_time).limit(self.batch)).all()
            if rows:
                s.execute(delete(Job.__table__).where(t.id.in_([r.id for r in rows])))
                gone = [(r.state, r.queue) for r in rows]
                self.store.after_commit(s, lambda: self.store.removed_final(gone))
        return len(rows)

    def _events(self, cutoff: float) -> int:
        t = Event.__table__.c
        with self.store.tx() as s:
            newest = s.execute(sa_select(func.max(t.id))).scalar()
            ids = s.execute(sa_select(t.id).where(t.time < cutoff, t.id != newest).order_by(t.time)
                            .limit(self.batch)).scalars().all()
            if ids:
                s.execute(delete(Event.__table__).where(t.id.in_(ids)))
        return len(ids)


def _day(t: float | None) -> str:
    return "-" if t is None else time.strftime("%Y-%m-%d %H:%M", time.localtime(t))
