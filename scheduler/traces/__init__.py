"""Job traces: read Philly, Helios-family, Alibaba GPU (2023) and generic CSVs into jobs; count
the rows not usable."""

from __future__ import annotations

import calendar
import contextlib
import csv
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

PHILLY_COLUMNS = {"timestamp", "duration", "num_gpus", "cluster"}
# SenseTime's Helios cluster_log.csv (SC'21) and InternLM's AcmeTrace (Seren/Kalos) share these
HELIOS_COLUMNS = {"job_id", "vc", "gpu_num", "submit_time", "duration"}
# Alibaba's cluster-trace-gpu-v2023 pod lists (Weng et al., ATC'23: openb_pod_list_*.csv)
ALIBABA_COLUMNS = {"name", "num_gpu", "creation_time", "scheduled_time", "deletion_time"}
GENERIC_COLUMNS = {"submit_time", "duration", "gpus"}
TIME_FORMATS = ("%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M:%S", "%Y-%m-%d")


class TraceError(ValueError):
    """A trace file that cannot be read at all (not one bad row): names the file and line."""


@dataclass(slots=True)
class TraceJob:
    """One job of a trace: when it was submitted, how long it ran, how many GPUs it used."""

    id: int
    submit: float  # seconds from the first submission
    duration: float
    gpus: int
    vc: str = ""  # the trace's virtual cluster / queue name ("" if none)
    user: str = ""
    team: str = ""
    nodes: int | None = None  # gang size when the trace says so
    name: str = ""  # the job's name, when the trace has one


@dataclass
class Trace:
    jobs: list[TraceJob]
    format: str
    start: float  # absolute time of the first submission (or of the window's start)
    end: float  # absolute time of the last submission (or of the window's end)
    skipped: Counter = field(default_factory=Counter)  # reason -> rows
    adjusted: Counter = field(default_factory=Counter)  # rows read with a change -> rows

    @property
    def span_s(self) -> float:
        return max(0.0, self.end - self.start)


def parse_time(text: str) -> float:
    """Seconds since the epoch from a number or a date/time (read as UTC, as the traces are)."""
    text = text.strip()
    try:
        return float(text)
    except ValueError:
        pass
    from datetime import datetime

    for fmt in TIME_FORMATS:
        try:
            return float(calendar.timegm(datetime.strptime(text, fmt).timetuple()))
        except ValueError:
            continue
    raise ValueError(f"cannot read {text!r} as a time; use seconds or YYYY-MM-DD[ HH:MM:SS]")


def parse_window(start: str, end: str) -> tuple[float, float]:
    """[start, end) in absolute seconds; an END given as a bare date includes that whole day."""
    lo, hi = parse_time(start), parse_time(end)
    if len(end.strip()) == 10 and end.strip()[4] == "-":
        hi += 86400.0
    if hi <= lo:
        raise ValueError(f"window end {end!r} is not after its start {start!r}")
    return lo, hi


class _Skip(Exception):
    pass


def _num(row: dict, key: str, cast=float):
    v = row.get(key)
    if v is None or not v.strip():
        raise _Skip(f"missing {key}")
    try:
        x = cast(float(v)) if cast is int else cast(v)
    except ValueError:
        raise _Skip(f"malformed {key}") from None
    if x != x:  # NaN
        raise _Skip(f"malformed {key}")
    return x


def _philly(i: int, row: dict) -> TraceJob:
    ts = row.get("timestamp") or ""
    if not ts.strip():
        raise _Skip("missing timestamp")
    try:
        submit = parse_time(ts)
    except ValueError:
        raise _Skip("malformed timestamp") from None
    return TraceJob(i, submit, _num(row, "duration"), _num(row, "num_gpus", int),
                    row.get("cluster") or "")


def _helios(i: int, row: dict) -> TraceJob:
    ts = row.get("submit_time") or ""
    if not ts.strip():
        raise _Skip("missing submit_time")
    try:
        submit = parse_time(ts)
    except ValueError:
        raise _Skip("malformed submit_time") from None
    nodes = _num(row, "node_num", int) if (row.get("node_num") or "").strip() else None
    return TraceJob(i, submit, _num(row, "duration"), _num(row, "gpu_num", int),
                    row.get("vc") or "", row.get("user") or "", "", nodes or None,
                    row.get("job_name") or row.get("jobname") or "")


def _alibaba(i: int, row: dict) -> TraceJob:
    """A pod of Alibaba's GPU cluster: it ran from scheduled_time to deletion_time (seconds
    from the trace's start); the queue is its QoS class (LS, BE, Burstable, Guaranteed).
    A pod never scheduled (pod_phase Pending, no scheduled_time) did not run."""
    if not (row.get("scheduled_time") or "").strip() or row.get("pod_phase", "") == "Pending":
        raise _Skip("never scheduled")
    created = _num(row, "creation_time")
    started = _num(row, "scheduled_time")
    if started < created:
        raise _Skip("scheduled before created")
    return TraceJob(i, created, _num(row, "deletion_time") - started, _num(row, "num_gpu", int),
                    (row.get("qos") or "").strip(), "", "", None, "")


class _AlibabaPods:
    """What a pod list tells only as a whole: where the trace ends (its last deletion, of any
    pod), so that pods still Running then, whose run time is unknown, are not read as jobs;
    and which pods asked for part of a GPU (trainyard gives each a whole one)."""

    def __init__(self):
        self.end = 0.0
        self.running: dict[int, float] = {}  # job id -> its deletion time, while Running
        self.shared: set[int] = set()

    def see(self, row: dict) -> None:
        with contextlib.suppress(ValueError):
            self.end = max(self.end, float(row["deletion_time"]))

    def keep(self, job: TraceJob, row: dict) -> None:
        if row.get("pod_phase", "") == "Running":
            self.running[job.id] = float(row["deletion_time"])
        milli = (row.get("gpu_milli") or "").strip()
        if job.gpus == 1 and milli and milli != "1000":
            self.shared.add(job.id)

    def finish(self, jobs: list, skipped: Counter, adjusted: Counter) -> list:
        cut = {i for i, t in self.running.items() if t >= self.end}
        if cut:
            jobs = [j for j in jobs if j.id not in cut]
            skipped["still running at the trace's end"] += len(cut)
        if self.shared - cut:
            adjusted["GPU-sharing pod given a whole GPU"] = len(self.shared - cut)
        return jobs


def _generic(i: int, row: dict) -> TraceJob:
    nodes = _num(row, "nodes", int) if (row.get("nodes") or "").strip() else None
    return TraceJob(i, _num(row, "submit_time"), _num(row, "duration"), _num(row, "gpus", int),
                    row.get("queue") or "", row.get("user") or "", row.get("team") or "", nodes,
                    row.get("name") or "")


FORMATS = (("philly", PHILLY_COLUMNS, _philly), ("helios", HELIOS_COLUMNS, _helios),
           ("alibaba", ALIBABA_COLUMNS, _alibaba), ("generic", GENERIC_COLUMNS, _generic))


def read_trace(path: str | Path, window: tuple[float, float] | None = None) -> Trace:
    """Jobs of a trace sorted by submit time (ties keep file order), submit times from the
    first job (or from the window's start). Rows that cannot be a job are skipped and counted
    by reason; a file that is not a trace raises TraceError with the line number."""
    path = Path(path)
    with path.open(newline="") as f:
        reader = csv.reader(f)
        try:
            header = next(reader, None)
        except csv.Error as e:
            raise TraceError(f"{path}, line 1: {e}") from e
        cols = [c.strip() for c in header or ()]
        fmt, parse = next(((f, p) for f, need, p in FORMATS if set(cols) >= need), (None, None))
        if parse is None:
            raise TraceError(
                f"{path}, line 1: unknown trace columns {sorted(cols)}; expected Philly's "
                f"{sorted(PHILLY_COLUMNS)}, Helios' {sorted(HELIOS_COLUMNS)}, Alibaba's "
                f"{sorted(ALIBABA_COLUMNS)} or {sorted(GENERIC_COLUMNS)} "
                "(+ nodes, queue, user, team, name)")
        jobs: list[TraceJob] = []
        skipped: Counter = Counter()
        adjusted: Counter = Counter()
        state_col = "state" if fmt == "helios" and "state" in cols else None
        pods = _AlibabaPods() if fmt == "alibaba" else None
        while True:
            try:
                fields = next(reader)
            except StopIteration:
                break
            except csv.Error as e:
                raise TraceError(f"{path}, line {reader.line_num}: {e}") from e
            if not fields or not any(x.strip() for x in fields):
                continue  # blank lines (Philly's file ends with one)
            if len(fields) != len(cols):
                raise TraceError(f"{path}, line {reader.line_num}: {len(fields)} fields, the "
                                 f"header has {len(cols)}; is the file cut or mixed?")
            row = dict(zip(cols, fields, strict=True))
            if pods is not None:
                pods.see(row)
            try:
                job = parse(reader.line_num, row)
                if job.duration < 0:
                    raise _Skip("negative duration")
                if job.gpus <= 0:
                    raise _Skip("no GPUs")
                if job.nodes is not None and job.nodes <= 0:
                    raise _Skip("malformed nodes")
                if state_col and row[state_col].strip().upper() in ("PENDING", "RUNNING"):
                    raise _Skip("never ended")
            except _Skip as s:
                skipped[str(s)] += 1
                continue
            if window is not None and not window[0] <= job.submit < window[1]:
                skipped["outside the window"] += 1
                continue
            if pods is not None:
                pods.keep(job, row)
            jobs.append(job)
    if pods is not None:
        jobs = pods.finish(jobs, skipped, adjusted)
    jobs.sort(key=lambda j: (j.submit, j.id))
    if window is not None:
        t0, t1 = window
    else:
        t0 = jobs[0].submit if jobs else 0.0
        t1 = jobs[-1].submit if jobs else 0.0
    for j in jobs:
        j.submit -= t0
    return Trace(jobs, fmt, t0, t1, skipped, adjusted)


def load_trace(path: str | Path) -> list[TraceJob]:
    """The jobs of a trace (see read_trace)."""
    return read_trace(path).jobs
