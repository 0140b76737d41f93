"""Incremental job order: pending jobs kept in runs whose inner order never changes, merged per pass.

A pass needs the pending jobs best first, but only as far as it gets: under a long backlog it
stops early (see `core.py`). Re-sorting every pending job on every pass is what made a pass
cost O(backlog log backlog). Here a job's sort key is split in two: a *class* (the attributes
that can reorder it against other jobs as time passes: user, queue, ...) and a *sequence*
(what orders it inside its class and never changes: submit time, id). Each class is a sorted
run, updated only for jobs that arrived or left since the last pass; a pass merges the runs'
heads with the policy's full key, computing it only for jobs it actually reaches.

`PendingOrder` is a cache: a pass with a fresh one gives the same order as with a warm one.
It is also where a caller's other per-pass caches live (the running jobs' expected ends for
backfill, the node table, the running jobs a policy may evict), so the daemon and a replay
keep them by keeping one object.
"""

from __future__ import annotations

import heapq
from bisect import bisect_left, insort
from collections.abc import Callable, Iterator, Sequence

from .backfill import RunningEnds
from .changes import changes, serial_of
from .placement import NodeTable
from .preemption import ServiceIndex
from .types import JobView


class PendingOrder:
    """The pending jobs of the last pass, as sorted runs per class (reused across passes),
    and what else a pass derives from the snapshot that changes little from one to the next.
    What changed is found by the views' identities: a caller that hands over the same view
    object for an unchanged job (a replay does) pays only for what changed."""

    def __init__(self):
        self._sig: object = None
        self._synced: tuple | None = None  # the tuple of the last sync (tuples do not change)
        self._seen: int | None = None  # its serial, when it was a `Views`
        self._entries: dict[int, tuple] = {}  # job id -> (class, entry)
        self._runs: dict[tuple, list[tuple]] = {}  # class -> sorted [(*sequence, id, view)]
        self._views: dict[int, JobView] = {}  # id(view) -> view, for every job in the runs
        self._classes: list[tuple] | None = None  # the runs' classes, sorted (None: to do)
        self.queues: dict[str, int] = {}  # queue -> its pending jobs
        self.dependent: dict[int, JobView] = {}  # pending jobs with a dependency
        # the other things a pass derives from the snapshot that change little between passes
        self.ends = RunningEnds()  # the running jobs' expected ends, for backfill
        self.nodes = NodeTable()  # the nodes' free GPUs, CPUs and memory
        self.service = ServiceIndex()  # the running jobs a policy may evict, by service

    def sync(self, pending: Sequence[JobView], sig: object,
             class_of: Callable[[JobView], tuple], seq_of: Callable[[JobView], tuple]) -> None:
        """Bring the runs up to date with `pending`; `sig` names how keys are computed."""
        if pending is self._synced and sig == self._sig:  # the same tuple again: nothing changed
            return
        if sig != self._sig:
            self._sig = sig
            self._seen = None
            self._entries = {}
            self._runs = {}
            self._views = {}
            self._classes = None
            self.queues = {}
            self.dependent = {}
        # only the jobs whose views came or went are placed or removed (see changes.py)
        views = self._views
        gone, new = changes(pending, views.keys(), self._seen)
        self._synced = pending if isinstance(pending, tuple) else None
        self._seen = None  # (until the change is applied)
        entries = self._entries
        for key in gone:
            job = views.pop(key)
            self._remove(job.id, entries[job.id])
        runs = self._runs
        for job in new:
            key = id(job)
            jid = job.id
            old = entries.get(jid)
            if old is not None:  # the same job twice in `pending`: the last view counts
                self._remove(jid, old)
                views.pop(id(old[1][-1]), None)
            views[key] = job
            cls = class_of(job)
            entry = (*seq_of(job), jid, job)
            entries[jid] = (cls, entry)
            self.queues[job.queue] = self.queues.get(job.queue, 0) + 1
            if job.dependency:
                self.dependent[jid] = job
            run = runs.get(cls)
            if run is None:
                runs[cls] = [entry]
                self._classes = None
            else:
                insort(run, entry)
        self._seen = serial_of(pending)

    def _remove(self, jid: int, old: tuple) -> None:
        cls, entry = old
        run = self._runs[cls]
        del run[bisect_left(run, entry)]
        if not run:
            del self._runs[cls]
            self._classes = None
        del self._entries[jid]
        job = entry[-1]
        left = self.queues[job.queue] - 1
        if left:
            self.queues[job.queue] = left
        else:
            del self.queues[job.queue]
        self.dependent.pop(jid, None)

    def representatives(self) -> list[JobView]:
        """One job per class: enough for aggregates over classes (queues, users, teams)."""
        return [run[0][-1] for run in self._runs.values()]

    def __len__(self) -> int:
        return len(self._entries)

    def ordered(self, key: Callable[[JobView], tuple] | None) -> OrderedJobs:
        """The jobs best first. `key` is the full sort key (None: sequences order all runs)."""
        runs = self._runs
        if len(runs) <= 1:
            return OrderedJobs(list(runs.values()), key)
        if self._classes is None:  # sorted again only when a class comes or goes
            self._classes = sorted(runs)
        return OrderedJobs([runs[c] for c in self._classes], key)


class OrderedJobs:
    """A lazy merge of sorted runs; `rest()` hands back what the pass did not reach."""

    def __init__(self, runs: list[list[tuple]], key: Callable[[JobView], tuple] | None):
        self._runs = runs
        self._pos = [0] * len(runs)
        self._key = key
        self._heap: list | None = None
        if key is None and len(runs) > 1:  # sequences are comparable across runs
            self._key = lambda j: ()
            self._seq = True
        else:
            self._seq = False

    def __iter__(self) -> Iterator[JobView]:
        runs, pos = self._runs, self._pos
        if len(runs) == 1:
            run = runs[0]
            while pos[0] < len(run):
                pos[0] += 1
                yield run[pos[0] - 1][-1]
            return
        key, seq = self._key, self._seq
        heap = self._heap = []
        for i, run in enumerate(runs):
            if run:
                e = run[0]
                heap.append((e[:-1] if seq else key(e[-1]), i))
        heapq.heapify(heap)
        while heap:
            _, i = heap[0]
            run = runs[i]
            job = run[pos[i]][-1]
            pos[i] += 1
            if pos[i] < len(run):
                e = run[pos[i]]
                heapq.heapreplace(heap, (e[:-1] if seq else key(e[-1]), i))
            else:
                heapq.heappop(heap)
            yield job

    def rest(self) -> list[list[tuple]]:
        """The entries not yet handed out, per run (copies: later passes may change the runs)."""
        return [run[p:] for run, p in zip(self._runs, self._pos, strict=True) if p < len(run)]
