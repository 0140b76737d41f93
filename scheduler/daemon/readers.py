"""Long listings (job pages, sacct windows) built in reader processes: a page of 2,000 jobs is
~0.15 s of CPU in Python, and on one of the daemon's threads it holds the interpreter's lock in
5 ms slices that the event loop waits for after each of its system calls: with a script polling
that page, a submitter's p99 doubled (tests/bench/bench_tui_busy.py) though the daemon's core
was not full. A process of its own has its own interpreter lock: the loop only shares the
machine's cores with it.

What a reader does is a read of committed rows and its encoding (scheduler.daemon.jobs.list_jobs,
accounting.sacct_jobs, views.encoded): it sees what a read thread would, as both read what is
committed when they start. The processes are started from a fork server (never forked from the
daemon, which runs threads and an event loop), on demand, and end with the daemon (its stop, or
its death, which each reader watches for). A database only the daemon's process can open (SQLite
in memory) is read on the read threads.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import os
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any

log = logging.getLogger("trainyard.daemon")

_ENGINES: dict[str, Any] = {}  # in a reader process: one engine per database


def _engine(db_url: str):
    engine = _ENGINES.get(db_url)
    if engine is None:
        from ..store import make_engine

        engine = _ENGINES[db_url] = make_engine(db_url)
    return engine


def _watch(daemon_pid: int) -> None:
    """In a reader process: end when the daemon is gone. A reader's parent is the fork server,
    and its pipes to the daemon stay open in itself (a queue carries both of its ends), so a
    `kill -9` of the daemon is noticed by looking: every half second."""

    def watch() -> None:
        while True:
            time.sleep(0.5)
            try:
                os.kill(daemon_pid, 0)
                with open(f"/proc/{daemon_pid}/stat") as f:
                    gone = f.read().rpartition(")")[2].split()[0] in ("Z", "X")
            except (ProcessLookupError, FileNotFoundError):
                gone = True
            except (PermissionError, OSError):
                gone = False
            if gone:
                os._exit(0)

    threading.Thread(target=watch, name="daemon-watch", daemon=True).start()


def job_page(db_url: str, f, caller, uses_predictions: bool, accept_encoding: str | None
             ) -> tuple[bytes, bool, float]:
    """In a reader process: a page of `GET /v1/jobs`, whether it is gzip-compressed, and the
    CPU seconds it took (charged to the caller's share of the reads)."""
    from .jobs import list_jobs

    return _timed_page(lambda: list_jobs(_engine(db_url), caller, f, uses_predictions), accept_encoding)


def sacct_page(db_url: str, q, accept_encoding: str | None) -> tuple[bytes, bool, float]:
    """In a reader process: `GET /v1/accounting/jobs` for a checked request (accounting.Sacct),
    as job_page."""
    from .accounting import sacct_jobs

    return _timed_page(lambda: sacct_jobs(_engine(db_url), q), accept_encoding)


def event_page(db_url: str, since: int | None, limit: int, accept_encoding: str | None
               ) -> tuple[bytes, bool, float]:
    """In a reader process: a page of `GET /v1/events` (the audit trail), as job_page."""
    from .overview import list_events

    return _timed_page(lambda: list_events(_engine(db_url), since, limit), accept_encoding)


def _timed_page(read, accept_encoding: str | None) -> tuple[bytes, bool, float]:
    from .views import encoded

    t0 = time.thread_time()
    body, gzipped = encoded(read(), accept_encoding)
    return body, gzipped, time.thread_time() - t0


def shared_database(db_url: str) -> bool:
    """Whether another process can open this database (not SQLite in memory)."""
    url = db_url.lower()
    return ":memory:" not in url and "mode=memory" not in url


def warm(db_url: str) -> bool:
    """In a reader process: what the first page would open, opened."""
    from sqlalchemy import text

    with _engine(db_url).connect() as conn:
        conn.execute(text("SELECT 1"))
    return True


# A page that may hold this many jobs goes to a reader. A shorter one costs the daemon's threads
# a few tens of milliseconds at most, less than waking a process on a loaded machine can (on the
# two busy cores of bench_cluster_size.py at 1,000 nodes, a 100-job page's p50 was 47 ms from a
# reader against 33 ms from a thread in the run before, on a stretch as slow).
READER_FROM = 500

# The readers start once a long page built on a thread cost this much CPU: a daemon whose
# pages are all cheap (a small cluster, the tests' daemons) never pays for the processes.
READERS_WORTH_S = 0.02

# what a reader runs, imported once by the fork server: readers fork with it in memory
PRELOAD = ["scheduler.daemon.readers", "scheduler.daemon.jobs", "scheduler.daemon.accounting",
           "scheduler.daemon.overview", "scheduler.daemon.views", "scheduler.store"]


class ReaderProcesses:
    """Up to `workers` reader processes (0: none, the read threads do it all). They start when
    a long page first costs READERS_WORTH_S on a thread; until they are up (about a second),
    pages are built on the read threads: no page waits for a process to start, and a daemon
    whose pages are all cheap starts none."""

    def __init__(self, db_url: str, workers: int):
        self.db_url = db_url
        self.workers = workers if shared_database(db_url) else 0
        self._pool: ProcessPoolExecutor | None = None
        self._ready = False
        self.served = 0  # pages the readers built

    @property
    def on(self) -> bool:
        return self.workers > 0

    @property
    def ready(self) -> bool:
        """Whether the readers are up: a long listing goes to one."""
        return self._ready

    def start(self) -> None:
        """Start the readers unless they are started (or starting), or turned off."""
        if self.on and self._pool is None:
            self._start()

    def _start(self) -> None:
        """Start the fork server and every reader on a thread of their own: a process is
        started by the thread that submits work to the pool, and the first waits for the fork
        server to import what it preloads (a second and more: on the event loop, every request
        waited that out)."""
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        self._pool = pool = ProcessPoolExecutor(self.workers, mp_context=ctx, initializer=_watch,
                                                initargs=(os.getpid(),))
        self._ready = False

        def boot() -> None:
            try:  # submitted together, so that each finds no idle reader and starts its own
                started = [pool.submit(warm, self.db_url) for _ in range(self.workers)]
                for fut in started:
                    fut.result()
            except Exception as e:  # processes cannot start here, or the database cannot be read
                log.warning("the reader processes did not start (%s); listings stay on the read threads", e)
                return
            if self._pool is pool:
                self._ready = True

        threading.Thread(target=boot, name="readers-start", daemon=True).start()

    async def run(self, fn, *args):
        """`fn(db_url, *args)` in a reader process; raises BrokenProcessPool when a reader died
        under it (the next call starts new ones)."""
        pool = self._pool
        assert pool is not None
        try:
            result = await asyncio.get_running_loop().run_in_executor(pool, fn, self.db_url, *args)
            self.served += 1
            return result
        except BrokenProcessPool:
            if self._pool is pool:
                self._pool, self._ready = None, False
                log.warning("a reader process died; new ones start at the next listing")
                pool.shutdown(wait=False, cancel_futures=True)
            raise

    def stop(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool, self._ready = None, False
