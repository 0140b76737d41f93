"""Ended jobs' directories on a node: removed a retention period after nothing of them is needed.

Part of the agent's bundle (standard library, Python 3.8). A job's directory (`<dir>/jobs/<key>`:
its spec, its status files, the node's copy of its output and its default working directory)
is needed until the daemon has recorded the job's end (`forget`: the `forgotten` file) and
stored every byte of its output (the stream's `done`: the `log.done` file). From the later of
the two it is kept `keep_s` more, for an operator's look on the node, and then removed, as
slurmd removes a job's spool directory. Before this every job ever run kept its directory: a
node's disk filled with its jobs' output, and each `sync` (every reconnect, every takeover)
and each agent start read every directory the node ever had.
"""

from __future__ import annotations

import collections
import os
import shutil
import time

DEFAULT_KEEP_S = 3600.0
# directories removed in one turn of the agent's loop at most: a backlog (an agent started after
# a long time away) goes in pieces between the agent's other work
BATCH = 64
DONE_FILES = ("forgotten", "log.done")


class JobDirs:
    """The ended jobs' directories of one agent, in the order they become removable."""

    def __init__(self, jobs_dir: str, keep_s: float = DEFAULT_KEEP_S, clock=time.time):
        self.jobs_dir = jobs_dir
        self.keep_s = max(0.0, keep_s)
        self.clock = clock
        self.due: collections.deque = collections.deque()  # (removed at, key), oldest first
        self.queued: set = set()

    def load(self, keys: list) -> None:
        """At the agent's start, of the job directories `keys`: those that became removable
        before it, by the time they did (a retention already past is removed at the first sweeps)."""
        found = []
        for key in keys:
            since = self._removable_since(key)
            if since is not None:
                found.append((since + self.keep_s, key))
        for entry in sorted(found):
            self._queue(*entry)

    def ended(self, key: str) -> None:
        """The job's end was recorded, or its output's end stored: removable once both are."""
        if key in self.queued:
            return
        since = self._removable_since(key)
        if since is not None:
            self._queue(max(since, self.clock()) + self.keep_s, key)

    def sweep(self, now: float | None = None) -> int:
        """Remove what is due (at most BATCH directories); how many."""
        now = self.clock() if now is None else now
        removed = 0
        while self.due and self.due[0][0] <= now and removed < BATCH:
            _, key = self.due.popleft()
            self.queued.discard(key)
            shutil.rmtree(os.path.join(self.jobs_dir, key), ignore_errors=True)
            removed += 1
        return removed

    def _removable_since(self, key: str) -> float | None:
        """When the later of the two end files was written; None while one is missing."""
        d = os.path.join(self.jobs_dir, key)
        try:
            return max(os.stat(os.path.join(d, name)).st_mtime for name in DONE_FILES)
        except OSError:
            return None

    def _queue(self, at: float, key: str) -> None:
        # the same retention for all: entries come in the order they became removable, except
        # an end seen by this agent with a clock behind a file's time; keep the deque sorted
        if self.due and at < self.due[-1][0]:
            at = self.due[-1][0]
        self.due.append((at, key))
        self.queued.add(key)
