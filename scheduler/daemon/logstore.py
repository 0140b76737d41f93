"""Central job logs: the agents' output streams, kept per job attempt and rank, and read back.

The agent of each node streams every job's output (stdout and stderr as written) as `output`
events; this module appends them to `<logs>/<job>/<attempt>/<rank>.out`, acknowledges by
offset (`output_ack`) and ends a stream (`done`) once its `eof` is stored or the job's
attempt reached `[logs] max_bytes_per_job`. What arrives twice (an agent resending after a
daemon restart) is skipped by offset; output for a job the node does not run is dropped and
audited. A write that fails (a full disk) is not acknowledged, so the node keeps the output
and resends it; the daemon records the problem once and the jobs run on. Files older than
`[logs] retention_days` are removed. Readers get the stored output, or the node's copy while
nothing is stored yet. With `[logs] bucket` set these files are the spool: a rank whose stream
ended is shipped to the bucket (logbucket.py) and read back from there once its file is gone.
Why output cannot be stored or shipped now is `problem`, shown by `GET /v1/cluster` and recorded
as a `logs.problem` event each time it changes.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models import ACTIVE_STATES, Job
from ..nodefiles import write_atomic, write_file
from .caller import Caller
from .clock import Clock
from .errors import DomainError, Forbidden, NotFound
from .lifecycle import parse_key
from .links import NodeLinks
from .logbucket import BucketError, LogBucket, Shipper
from .state import StateStore

log = logging.getLogger("trainyard.logs")

NODES_FILE = "nodes.json"  # rank -> node of one attempt, kept beside its output
# with a bucket: a stream that never ended (its node left) is shipped this long after its job did
ABANDONED_AFTER_S = 3600.0


@dataclass
class _Stream:
    """One rank of one attempt as it arrives."""

    path: Path
    size: int
    complete: bool
    finishing: bool = False  # its `.done` is being written: a duplicate end waits for that


class LogStore:
    """Files under `root`, one directory per job and attempt; the daemon's side of the streams."""

    def __init__(self, root: Path, store: StateStore, links: NodeLinks, clock: Clock,
                 retention_days: float = 30.0, max_bytes_per_job: int = 1 << 30,
                 internal: Callable[[str], bool] = lambda key: False, bucket: LogBucket | None = None):
        self.root = root
        self.store = store
        self.links = links
        self.clock = clock
        self.retention_s = retention_days * 86400
        self.max_bytes = max_bytes_per_job
        self.internal = internal  # the daemon's own jobs (health checks): their output is not kept
        self._disk_problem = ""  # why output cannot be written to the files now ("" when it can)
        self._reported = ""  # the problem as last recorded in an event
        self.bucket = bucket
        self.shipper = Shipper(bucket, root, lambda why: self._report("")) if bucket else None
        self._owner: dict[tuple[str, str], tuple[int, int, int] | None] = {}
        self._streams: dict[tuple[int, int, int], _Stream] = {}
        # (job, attempt) -> the bytes stored for it, and how many of its streams are open: kept
        # while a stream of the attempt is open, read from its files again when one opens later
        self._totals: dict[tuple[int, int], int] = {}
        self._open: dict[tuple[int, int], int] = {}
        # (job, attempt) -> [its ranks' nodes, how many of its streams ended]: an attempt's
        # directory and nodes.json are written with its first byte of output, not at dispatch,
        # so a job that prints nothing costs no file at all; until then its ranks are known here
        self._unwritten: dict[tuple[int, int], list] = {}
        # the files written once per job (an attempt's nodes.json at dispatch, a stream's .done
        # at its end) are created by one thread, in order, so that the event loop never waits on
        # the disk for them (a file's creation took 0.3-0.6 ms of the loop under load). Those
        # asked for in one turn of the loop go to the thread together, and their callbacks come
        # back together: two thread switches per burst of dispatches or ends, not per file
        self._files = ThreadPoolExecutor(max_workers=1, thread_name_prefix="logstore")
        self._queued: list[tuple[Callable[[], None], Callable[[OSError | None], None]]] = []
        self._stopping = False
        root.mkdir(parents=True, exist_ok=True, mode=0o700)

    @property
    def problem(self) -> str:
        """Why jobs' output cannot be stored or shipped now; "" when it can."""
        bucket = self.shipper.problem if self.shipper else ""
        return "; ".join(p for p in (self._disk_problem, bucket) if p)

    def start(self) -> None:
        """On the event loop: ship what the spool holds to the bucket, when one is set."""
        if self.shipper:
            self.shipper.start()

    async def stop(self) -> None:
        self._stopping = True
        self._hand_over()
        await asyncio.to_thread(self._files.shutdown)  # what was handed to it is written
        if self.shipper:
            await self.shipper.stop()

    def _in_background(self, write: Callable[[], None], then: Callable[[OSError | None], None]) -> None:
        """Run `write` on the file thread, then `then(error)` on the event loop (`error`: the
        OSError it raised, else None), in the order asked. Without a running loop (a direct
        call), both at once."""
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            loop = None
        if loop is None or self._stopping:  # a direct call, or the daemon stops: write it now
            then(_attempt(write))
            return
        self._queued.append((write, then))
        if len(self._queued) == 1:
            loop.call_soon(self._hand_over)

    def _hand_over(self) -> None:
        """The writes asked for in this turn of the loop, to the file thread in one piece."""
        batch, self._queued = self._queued, []
        if not batch:
            return
        loop = asyncio.get_running_loop()

        def work() -> None:
            errors = [_attempt(write) for write, _ in batch]
            with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: the files are written
                loop.call_soon_threadsafe(_answer, [then for _, then in batch], errors)

        self._files.submit(work)

    # ---------------------------------------------------------------- paths
    def attempt_dir(self, job_id: int, attempt: int) -> Path:
        return self.root / str(job_id) / str(attempt)

    def rank_path(self, job_id: int, attempt: int, rank: int) -> Path:
        return self.attempt_dir(job_id, attempt) / f"{rank}.out"

    def ranks(self, job_id: int, attempt: int) -> list[str]:
        """The node of each rank of an attempt, as recorded at its dispatch (in memory until its
        first output, in its nodes.json from then on)."""
        unwritten = self._unwritten.get((job_id, attempt))
        if unwritten is not None:
            return list(unwritten[0])
        try:
            return json.loads((self.attempt_dir(job_id, attempt) / NODES_FILE).read_text())
        except (OSError, ValueError):
            return []

    # ---------------------------------------------------------------- the streams
    def on_output(self, node: str, msg: dict) -> None:
        """One `output` event from a node's agent: store it and acknowledge what is held."""
        key = str(msg.get("key", ""))
        where = self._owner_of(node, key)
        if where is None:
            self._ack(node, key, int(msg.get("offset") or 0), done=True)
            return
        st = self._stream(where)
        if st.complete:
            self._ack(node, key, st.size, done=True)
            return
        if st.finishing:  # sent again before its end was stored: acknowledged once it is
            return
        try:
            data = base64.b64decode(str(msg.get("data", "")), validate=True)
            offset = int(msg.get("offset") or 0)
        except (binascii.Error, ValueError, TypeError):
            log.warning("node %s: dropped output of %s that is not base64 at a whole offset", node, key)
            return
        if offset > st.size:  # a piece is missing before this one: ask again from what is held
            self._ack(node, key, st.size)
            return
        fresh = data[st.size - offset:]
        capped = False
        if fresh:
            total = self._totals.get(where[:2], 0)
            room = self.max_bytes - total
            if len(fresh) > room:
                fresh, capped = fresh[:max(room, 0)], True
            if not self._write(st, fresh, node):
                return  # not acknowledged: the node keeps it and sends it again
            self._totals[where[:2]] = total + len(fresh)
            if where[:2] in self._unwritten:
                self._first_output(where[:2], node)
        if capped:
            self._write(st, (f"\ntrainyard: output cut at {self.max_bytes} bytes for this job "
                             f"([logs] max_bytes_per_job); the rest is on {node} only\n").encode(), node)
            self._finish(st, where, node, key, "capped")
        elif msg.get("eof") and offset + len(data) <= st.size:
            self._finish(st, where, node, key, "eof")
        else:
            self._ack(node, key, st.size)

    def _owner_of(self, node: str, key: str) -> tuple[int, int, int] | None:
        """(job, attempt, rank) of a node's stream; None (audited once) when it is not the node's."""
        if (node, key) in self._owner:
            return self._owner[(node, key)]
        where = None
        if self.internal(key):
            return None
        try:
            job_id, attempt = parse_key(key)
        except ValueError:
            job_id, attempt = -1, -1
        if job_id > 0 and attempt >= 0:
            with self.store.read() as s:
                job = s.get(Job, job_id)
                current = job is not None and job.attempt == attempt
                nodes = [a["node"] for a in job.allocation] if current else []
            recorded = self.ranks(job_id, attempt)
            if current and node in nodes:
                if not recorded:  # written with the attempt's first output, as at dispatch
                    self._unwritten.setdefault((job_id, attempt), [list(nodes), 0])
                where = (job_id, attempt, nodes.index(node))
            elif node in recorded:  # an earlier attempt of a requeued job, still arriving
                where = (job_id, attempt, recorded.index(node))
        if where is None:
            self.store.audit("trainyard", "log.refused", key[:64],
                             {"node": node, "why": f"node {node} does not run {key!r}"})
        self._owner[(node, key)] = where
        return where

    def record_ranks(self, job_id: int, attempt: int, nodes: list[str]) -> None:
        """At dispatch: output of this attempt is the job's even if it arrives after a requeue.
        Its streams are known from here on, so their output needs no database read. Nothing is
        written yet: the file that says so after a restart (nodes.json) is written on the file
        thread with the attempt's first output (`_first_output`), and never for an attempt
        that prints nothing."""
        for rank, node in enumerate(nodes):
            self._owner[(node, f"{job_id}.{attempt}")] = (job_id, attempt, rank)
        self._unwritten[(job_id, attempt)] = [list(nodes), 0]

    def _first_output(self, attempt: tuple[int, int], node: str) -> None:
        """The attempt's first bytes are stored: its nodes.json, on the file thread."""
        unwritten = self._unwritten.pop(attempt, None)
        if unwritten is None:  # written already (or by an earlier daemon)
            return
        nodes = unwritten[0]

        def then(error: OSError | None) -> None:
            if error is not None:  # tried again with the attempt's next stored output
                self._unwritten.setdefault(attempt, unwritten)
                self._disk_failed(error, node)
        self._in_background(lambda: self._record_ranks(*attempt, nodes), then)

    def _stream_ended(self, attempt: tuple[int, int]) -> None:
        """One more stream of the attempt ended: with its last, what is kept of an attempt that
        printed nothing goes."""
        unwritten = self._unwritten.get(attempt)
        if unwritten is not None:
            unwritten[1] += 1
            if unwritten[1] >= len(unwritten[0]):
                del self._unwritten[attempt]

    def _record_ranks(self, job_id: int, attempt: int, nodes: list[str]) -> None:
        # plain os calls on the file thread: it holds the interpreter's lock for less
        job_dir = os.path.join(self.root, str(job_id))
        d = os.path.join(job_dir, str(attempt))
        try:
            if attempt == 0:  # the job's first attempt: its directory is new as well
                with contextlib.suppress(FileExistsError):
                    os.mkdir(job_dir)
            os.mkdir(d)
        except FileExistsError:
            pass
        except FileNotFoundError:  # the root went away (or a first attempt numbered otherwise)
            os.makedirs(d, exist_ok=True)
        write_atomic(os.path.join(d, NODES_FILE), json.dumps(nodes))

    def _stream(self, where: tuple[int, int, int]) -> _Stream:
        st = self._streams.get(where)
        if st is None:
            # what the attempt's directory holds: this rank's size and end, and every rank's
            # bytes (one scan; nothing there for a stream that opens at its job's start)
            attempt, out, done = where[:2], f"{where[2]}.out", f"{where[2]}.done"
            size, complete, total = 0, False, 0
            try:
                with os.scandir(self.attempt_dir(*attempt)) as entries:
                    for e in entries:
                        if e.name.endswith(".out") and not e.name.startswith("."):
                            n = e.stat().st_size
                            total += n
                            if e.name == out:
                                size = n
                        elif e.name == done:
                            complete = True
            except OSError:  # none yet; or it cannot be read, and writing there says why
                pass
            st = _Stream(self.rank_path(*where), size, complete)
            self._streams[where] = st
            self._totals.setdefault(attempt, total)
            self._open[attempt] = self._open.get(attempt, 0) + 1
        return st

    def _close(self, where: tuple[int, int, int]) -> None:
        """The stream is no longer followed here; with the last of its attempt, its total."""
        if self._streams.pop(where, None) is None:
            return
        attempt = where[:2]
        left = self._open.pop(attempt, 1) - 1
        if left > 0:
            self._open[attempt] = left
        else:
            self._totals.pop(attempt, None)

    def _write(self, st: _Stream, data: bytes, node: str) -> bool:
        try:
            try:
                f = open(st.path, "ab")
            except FileNotFoundError:  # the attempt's first output, or its directory was removed
                st.path.parent.mkdir(parents=True, exist_ok=True)
                f = open(st.path, "ab")
            with f:
                f.write(data)
        except OSError as e:
            with contextlib.suppress(OSError), open(st.path, "ab") as f:
                f.truncate(st.size)  # what a partial write left behind is not kept
            self._disk_failed(e, node)
            return False
        st.size += len(data)
        if self._disk_problem:
            self._disk_problem = ""
            self._report(node)
        return True

    def _disk_failed(self, error: OSError, node: str) -> None:
        self._problem(f"cannot store jobs' output under {self.root}: {error.strerror or error}; the "
                      "nodes keep it and send it again", node)

    def _problem(self, why: str, node: str) -> None:
        if why != self._disk_problem:
            self._disk_problem = why
            self._report(node)

    def _report(self, node: str) -> None:
        """One `logs.problem` event each time the problem changes ("" once it is gone)."""
        now = self.problem
        if now == self._reported:
            return
        was, self._reported = self._reported, now
        (log.warning if now else log.info)("%s", now or "jobs' output is stored again")
        detail = {"problem": now, "was": was, **({"node": node} if node else {})}
        try:
            self.store.audit("trainyard", "logs.problem", "logs", detail)
        except Exception:  # the database may sit on the same full disk
            log.exception("cannot record logs.problem")

    def _finish(self, st: _Stream, where: tuple[int, int, int], node: str, key: str, how: str) -> None:
        """Mark the stream complete on disk (on the file thread), then acknowledge its end. A
        stream that stored nothing has nothing on disk to mark: its end is acknowledged at once
        (a late duplicate of it finds nothing stored, and is acknowledged the same way)."""
        st.finishing = True

        def then(error: OSError | None) -> None:
            st.finishing = False
            if error is not None:
                self._ack(node, key, st.size)  # not finished: the agent sends its end again
                return
            st.complete = True
            self._close(where)
            self._stream_ended(where[:2])
            self._owner.pop((node, key), None)  # a late duplicate finds the stream complete on disk
            self._ack(node, key, st.size, done=True)
            if self.shipper and st.size:
                self.shipper.ship(*where[:2])

        if not st.size:
            then(None)
            return
        done = str(st.path.with_suffix(".done"))
        self._in_background(lambda: write_file(done, how), then)

    def _ack(self, node: str, key: str, offset: int, done: bool = False) -> None:
        self.links.send(node, {"op": "output_ack", "key": key, "offset": offset, "done": done})

    # ---------------------------------------------------------------- reading
    def read(self, job_id: int, attempt: int, rank: int, offset: int, limit: int) -> dict[str, Any] | None:
        """Stored output of one rank from `offset`; None when nothing of it is stored."""
        path = self.rank_path(job_id, attempt, rank)
        try:
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                f.seek(min(offset, size))
                data = f.read(limit)
        except FileNotFoundError:
            return None
        complete = path.with_suffix(".done").exists()
        if not (complete and offset + len(data) >= size):
            data = data[:whole_utf8(data)]
        return {"data": data.decode("utf-8", "replace"), "next": min(offset, size) + len(data),
                "size": size, "complete": complete}

    def may_be_shipped(self, job_id: int, attempt: int, rank: int) -> bool:
        """Whether the bucket may hold a rank that the spool does not: it ended, or the spool
        no longer knows the attempt at all (removed, or another daemon's disk)."""
        if (job_id, attempt) in self._unwritten:  # dispatched, nothing of it stored yet: nor shipped
            return False
        d = self.attempt_dir(job_id, attempt)
        return not (d / NODES_FILE).exists() or self.rank_path(job_id, attempt, rank).with_suffix(".done").exists()

    # ---------------------------------------------------------------- retention
    def expire(self, now: float | None = None) -> int:
        """Remove the output of attempts untouched for the retention period (files, and objects in
        the bucket); how many attempts' files."""
        now = self.clock.time() if now is None else now
        cutoff = now - self.retention_s
        if self.shipper:
            self.shipper.expire(cutoff)
            self._ship_abandoned(now)
        removed = 0
        for job_dir in list(self.root.iterdir()):
            for attempt_dir in list(job_dir.iterdir()) if job_dir.is_dir() else ():
                try:
                    newest = max((p.stat().st_mtime for p in attempt_dir.iterdir()),
                                 default=attempt_dir.stat().st_mtime)
                except OSError:
                    continue
                if newest < cutoff:
                    shutil.rmtree(attempt_dir, ignore_errors=True)
                    removed += 1
                    self._forget(job_dir.name, attempt_dir.name)
            if job_dir.is_dir() and not any(job_dir.iterdir()):
                job_dir.rmdir()
        return removed

    def _ship_abandoned(self, now: float) -> None:
        """Ranks whose stream never ended (the node left with the job) and that nothing touched for
        a while after the attempt stopped running: finished as they are, and shipped."""
        for out in self.root.glob("*/*/*.out"):
            job, attempt = out.parent.parent.name, out.parent.name
            try:
                idle = now - out.stat().st_mtime >= ABANDONED_AFTER_S
            except OSError:
                continue
            if not (idle and job.isdigit() and attempt.isdigit()) or out.with_suffix(".done").exists():
                continue
            with self.store.read() as s:
                j = s.get(Job, int(job))
                running = j is not None and j.attempt == int(attempt) and j.state in ACTIVE_STATES
            if not running:
                with contextlib.suppress(OSError):
                    out.with_suffix(".done").write_text("abandoned")
                    if out.stem.isdigit():
                        self._close((int(job), int(attempt), int(out.stem)))
                    self.shipper.ship(int(job), int(attempt))

    def _forget(self, job: str, attempt: str) -> None:
        if not (job.isdigit() and attempt.isdigit()):
            return
        key = (int(job), int(attempt))
        for where in [w for w in self._streams if w[:2] == key]:
            self._close(where)
        self._totals.pop(key, None)


def _answer(thens: list[Callable[[OSError | None], None]], errors: list[OSError | None]) -> None:
    for then, error in zip(thens, errors, strict=True):
        try:
            then(error)
        except Exception:  # one callback's failure does not stop the others'
            log.exception("after writing a job's log file")


def _attempt(write: Callable[[], None]) -> OSError | None:
    try:
        write()
    except OSError as e:
        return e
    return None


def whole_utf8(data: bytes) -> int:
    """Length of `data` without a UTF-8 character cut at its end (it comes whole next time)."""
    for back in range(1, min(4, len(data)) + 1):
        b = data[-back]
        if b & 0xC0 != 0x80:  # the first byte of the last character
            need = 2 if b & 0xE0 == 0xC0 else 3 if b & 0xF0 == 0xE0 else 4 if b & 0xF8 == 0xF0 else 1
            return len(data) - back if need > back else len(data)
    return len(data)


class JobLogs:
    """What `GET /v1/jobs/{id}/log` answers: the stored output, else the node's own copy."""

    def __init__(self, logs: LogStore, store: StateStore, links: NodeLinks):
        self.logs = logs
        self.store = store
        self.links = links

    async def read(self, caller: Caller, job_id: int, offset: int, rank: int, limit: int,
                   attempt: int | None = None) -> dict[str, Any]:
        with self.store.read() as s:
            job = s.get(Job, job_id)
            if job is None:
                raise NotFound(f"job {job_id} does not exist")
            s.expunge(job)
        if not caller.may_act_on(job.user):
            raise Forbidden(f"job {job_id} belongs to {job.user}; {caller.user} may read only their own "
                            "jobs' logs")
        attempt = job.attempt if attempt is None else attempt
        if attempt > job.attempt:
            raise NotFound(f"attempt: job {job_id} has run attempts 0..{job.attempt}, not {attempt}",
                           "attempt")
        current = [a["node"] for a in job.allocation] if attempt == job.attempt else []
        nodes = self.logs.ranks(job_id, attempt) or current
        if not nodes and (attempt < job.attempt or job.state != "PENDING"):  # it ran: maybe shipped
            nodes = await self._shipped_ranks(job_id, attempt)
        out = {"state": job.state, "attempt": attempt, "rank": rank}
        if not nodes:
            if rank:
                raise NotFound(f"rank: attempt {attempt} of job {job_id} has no rank {rank}; "
                               "it has not run", "rank")
            return {**out, "data": "", "next": offset, "node": None, "size": 0, "complete": False,
                    "source": "none"}
        if rank >= len(nodes):
            raise NotFound(f"rank: attempt {attempt} of job {job_id} has ranks 0..{len(nodes) - 1}, "
                           f"not {rank}", "rank")
        node = nodes[rank]
        stored = self.logs.read(job_id, attempt, rank, offset, limit)
        if stored is not None:
            return {**out, **stored, "node": node, "source": "store"}
        shipped = await self._shipped(job_id, attempt, rank, offset, limit)
        if shipped is not None:
            return {**out, **shipped, "node": node, "source": "bucket"}
        if node in self.links.names() and self.links.connected(node):
            try:
                reply = await self.links.request(node, {"op": "log", "key": f"{job_id}.{attempt}",
                                                        "offset": offset, "limit": limit})
                return {**out, "data": reply.get("data", ""), "next": reply.get("next", offset),
                        "node": node, "size": reply.get("size", 0), "complete": False,
                        "source": "node"}
            except DomainError:
                pass
        return {**out, "data": "", "next": offset, "node": node, "size": 0, "complete": False,
                "source": "none"}


    async def _shipped_ranks(self, job_id: int, attempt: int) -> list[str]:
        bucket = self.logs.bucket
        if bucket is None:
            return []
        try:
            return await asyncio.to_thread(bucket.ranks, job_id, attempt)
        except BucketError as e:
            log.warning("%s", e)
            return []

    async def _shipped(self, job_id: int, attempt: int, rank: int, offset: int,
                       limit: int) -> dict[str, Any] | None:
        """A rank's output from the bucket (a ranged GET), None when it holds none or is down."""
        bucket = self.logs.bucket
        if bucket is None or not self.logs.may_be_shipped(job_id, attempt, rank):
            return None
        try:
            got = await asyncio.to_thread(bucket.read, job_id, attempt, rank, offset, limit)
        except BucketError as e:
            log.warning("%s", e)
            return None
        if got is None:
            return None
        data, size = got
        start = min(offset, size)
        if start + len(data) < size:  # a character cut by the range comes whole next time
            data = data[:whole_utf8(data)]
        return {"data": data.decode("utf-8", "replace"), "next": start + len(data), "size": size,
                "complete": True}


def log_root(home: Path, configured: str) -> Path:
    return Path(configured).expanduser() if configured else home / "logs"


__all__ = ["JobLogs", "LogStore", "log_root", "whole_utf8"]
