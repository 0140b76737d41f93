"""Accounting (pure): allocated GPU-hours, cost and idle waste per user, team and queue; sacct/sreport.

Inputs are plain records: the job history (one `JobRecord` per run of a job) and per-GPU
utilisation samples. A run counts from its start to its end (or `now` while it runs), clipped
to the report's window [S, E). Cost comes from per-pool prices (`PriceBook`): an AWS pool
pays its instance's on-demand or spot price per hour divided by the instance's GPUs, an
on-prem pool a configured price per GPU-hour. Waste is allocated GPU-time during which the
GPU's telemetry showed utilisation under a threshold (default 5 %); a sample stands until the
next one of that GPU, for at most `max_sample_gap_s`, and time without telemetry is not waste.
"""

from __future__ import annotations

import bisect
import csv
import io
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field

IDLE_THRESHOLD_PCT = 5.0
MAX_SAMPLE_GAP_S = 300.0
GROUPINGS = ("user", "account", "queue")


@dataclass(frozen=True)
class JobRecord:
    """One run of a job: who, where and when. allocation: ((node, (GPU index, ...)), ...)."""

    id: int | str
    user: str
    account: str  # the team the run is charged to
    queue: str
    start: float | None
    end: float | None  # None while it runs
    allocation: tuple[tuple[str, tuple[int, ...]], ...] = ()
    name: str = ""
    state: str = ""
    submit: float | None = None
    exit_code: int | None = None

    @property
    def gpus(self) -> int:
        return sum(len(g) for _, g in self.allocation)


@dataclass(frozen=True)
class UtilSample:
    node: str
    gpu: int
    time: float
    util: float  # %


class PriceError(ValueError):
    """The price table is wrong or lacks an entry; the message says which and what to write."""


@dataclass(frozen=True)
class PriceBook:
    """Price of one GPU-hour in each pool, from the `[accounting]` config table:

        [accounting.instances."p5.48xlarge"]     # AWS: per instance-hour, and its GPUs
        on_demand = 98.32
        spot = 31.46
        gpus = 8
        [accounting.pools.train-spot]
        kind = "aws"
        instance_type = "p5.48xlarge"
        spot = true
        [accounting.pools.lab]
        kind = "onprem"
        gpu_hour = 1.10
    """

    gpu_hour: Mapping[str, float] = field(default_factory=dict)
    currency: str = "USD"

    @classmethod
    def from_dict(cls, cfg: Mapping) -> PriceBook:
        instances = cfg.get("instances", {}) or {}
        prices = {}
        for pool, p in (cfg.get("pools", {}) or {}).items():
            kind = p.get("kind")
            if kind == "onprem":
                prices[pool] = _price(p.get("gpu_hour"), f"accounting.pools.{pool}.gpu_hour")
            elif kind == "aws":
                itype = p.get("instance_type")
                inst = instances.get(itype)
                if inst is None:
                    raise PriceError(f"pool {pool} runs {itype!r} but accounting.instances has no price "
                                     f"for it; add [accounting.instances.\"{itype}\"] with on_demand, "
                                     f"spot and gpus")
                which = "spot" if p.get("spot") else "on_demand"
                per_hour = _price(inst.get(which), f"accounting.instances.\"{itype}\".{which}")
                gpus = inst.get("gpus")
                if not isinstance(gpus, int) or isinstance(gpus, bool) or gpus <= 0:
                    raise PriceError(f"accounting.instances.\"{itype}\".gpus must be a whole number "
                                     f"above 0, not {gpus!r}")
                prices[pool] = per_hour / gpus
            else:
                raise PriceError(f"accounting.pools.{pool}.kind must be \"aws\" or \"onprem\", "
                                 f"not {kind!r}")
        return cls(prices, str(cfg.get("currency", "USD")))

    def price(self, pool: str) -> float:
        """A GPU-hour in that pool; 0 for a pool without a price (reported, not guessed)."""
        return self.gpu_hour.get(pool, 0.0)


def _price(v, where: str) -> float:
    if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
        raise PriceError(f"{where} must be a price (a number of 0 or more), not {v!r}")
    return float(v)


@dataclass
class Usage:
    """Totals for one user, team or queue over the window."""

    key: str
    jobs: int = 0
    gpu_hours: float = 0.0
    idle_gpu_hours: float = 0.0
    cost: float = 0.0
    unpriced_gpu_hours: float = 0.0  # in pools the price book has no price for

    @property
    def idle_pct(self) -> float:
        return 100.0 * self.idle_gpu_hours / self.gpu_hours if self.gpu_hours else 0.0


class UtilIndex:
    """Per-GPU samples sorted by time, answering "how long was this GPU idle in [a, b)"."""

    def __init__(self, samples: Iterable[UtilSample], threshold_pct: float = IDLE_THRESHOLD_PCT,
                 max_gap_s: float = MAX_SAMPLE_GAP_S):
        self.threshold = threshold_pct
        self.max_gap = max_gap_s
        by_gpu: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for s in samples:
            by_gpu.setdefault((s.node, s.gpu), []).append((s.time, s.util))
        self.times: dict[tuple[str, int], list[float]] = {}
        self.idle: dict[tuple[str, int], list[tuple[float, float]]] = {}
        for key, points in by_gpu.items():
            points.sort()
            spans = []
            for i, (t, util) in enumerate(points):
                stop = t + self.max_gap
                if i + 1 < len(points):
                    stop = min(stop, points[i + 1][0])
                if util < self.threshold and stop > t:
                    spans.append((t, stop))
            self.idle[key] = spans
            self.times[key] = [a for a, _ in spans]

    @classmethod
    def from_spans(cls, spans: Mapping[tuple[str, int], list[tuple[float, float]]]) -> UtilIndex:
        """An index over idle spans already worked out (the daemon keeps them, not samples)."""
        index = cls(())
        for key, found in spans.items():
            ordered = sorted(found)
            index.idle[key] = ordered
            index.times[key] = [a for a, _ in ordered]
        return index

    def idle_seconds(self, node: str, gpu: int, a: float, b: float) -> float:
        spans = self.idle.get((node, gpu))
        if not spans or b <= a:
            return 0.0
        i = max(0, bisect.bisect_right(self.times[(node, gpu)], a) - 1)
        total = 0.0
        while i < len(spans) and spans[i][0] < b:
            lo, hi = max(spans[i][0], a), min(spans[i][1], b)
            if hi > lo:
                total += hi - lo
            i += 1
        return total


def clip(start: float | None, end: float | None, window: tuple[float, float], now: float) -> float:
    """Seconds of [start, end or now) inside the window [S, E)."""
    if start is None:
        return 0.0
    lo = max(start, window[0])
    hi = min(now if end is None else end, window[1])
    return max(0.0, hi - lo)


def usage(jobs: Iterable[JobRecord], window: tuple[float, float], node_pools: Mapping[str, str],
          prices: PriceBook, util: UtilIndex | None = None, by: str = "user",
          now: float | None = None) -> list[Usage]:
    """Allocated GPU-hours, idle GPU-hours and cost over [S, E) per user, account or queue,
    largest first. node_pools: node -> its pool (a node not listed is in pool "")."""
    if by not in GROUPINGS:
        raise ValueError(f"cannot group by {by!r}; use one of {', '.join(GROUPINGS)}")
    if window[1] <= window[0]:
        raise ValueError(f"the window ends ({window[1]}) before it starts ({window[0]})")
    now = time.time() if now is None else now
    rows: dict[str, Usage] = {}
    for job in jobs:
        seconds = clip(job.start, job.end, window, now)
        if seconds <= 0 or not job.allocation:
            continue
        lo = max(job.start, window[0])
        hi = lo + seconds
        key = getattr(job, by) or "(none)"
        row = rows.setdefault(key, Usage(key))
        row.jobs += 1
        for node, gpus in job.allocation:
            pool = node_pools.get(node, "")
            hours = seconds * len(gpus) / 3600
            row.gpu_hours += hours
            if pool in prices.gpu_hour:
                row.cost += hours * prices.price(pool)
            else:
                row.unpriced_gpu_hours += hours
            if util is not None:
                row.idle_gpu_hours += sum(util.idle_seconds(node, g, lo, hi) for g in gpus) / 3600
    return sorted(rows.values(), key=lambda r: (-r.gpu_hours, r.key))


def totals(rows: Iterable[Usage]) -> Usage:
    t = Usage("TOTAL")
    for r in rows:
        t.jobs += r.jobs
        t.gpu_hours += r.gpu_hours
        t.idle_gpu_hours += r.idle_gpu_hours
        t.cost += r.cost
        t.unpriced_gpu_hours += r.unpriced_gpu_hours
    return t


# ---------------------------------------------------------------- sacct

_UNITS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 7 * 86400}


# Slurm's named times of day (today's)
_NAMED = {"today": 0, "midnight": 0, "noon": 12, "fika": 15, "teatime": 16}
_DATES = ("%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M", "%Y-%m-%d", "%m/%d/%y-%H:%M:%S", "%m/%d/%y-%H:%M", "%m/%d/%y",
          "%m/%d-%H:%M:%S", "%m/%d-%H:%M", "%m/%d")


def slurm_when(text: str, now: float) -> float:
    """A time as sacct's -S/-E take it: YYYY-MM-DD[THH:MM[:SS]], MM/DD[/YY][-HH:MM[:SS]],
    HH:MM[:SS] (today), today, midnight, noon, fika, teatime, `now`, or
    `now{+|-}N[seconds|minutes|hours|days|weeks]` (N alone is seconds); ValueError says how."""
    from datetime import datetime  # noqa: PLC0415

    t = text.strip()
    low = t.lower()
    day = datetime.fromtimestamp(now).replace(hour=0, minute=0, second=0, microsecond=0)
    if low in _NAMED:
        return day.replace(hour=_NAMED[low]).timestamp()
    if low.startswith("now"):
        rest = t[3:].strip()
        if not rest:
            return now
        sign, body = rest[0], rest[1:].strip().lower()
        number = body.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = body[len(number):].rstrip("s") or "second"
        if sign in "+-" and number.isdigit() and unit in _UNITS:
            return now + (1 if sign == "+" else -1) * int(number) * _UNITS[unit]
    for fmt in ("%H:%M:%S", "%H:%M"):
        try:
            clock = datetime.strptime(t, fmt)
        except ValueError:
            continue
        return day.replace(hour=clock.hour, minute=clock.minute, second=clock.second).timestamp()
    for fmt in _DATES:
        try:
            when = datetime.strptime(t, fmt)
        except ValueError:
            continue
        if "%y" not in fmt and "%Y" not in fmt:
            when = when.replace(year=day.year)
        return when.timestamp()
    raise ValueError(f"{text!r} is not a time; use YYYY-MM-DD[THH:MM[:SS]], MM/DD[/YY][-HH:MM[:SS]], "
                     "HH:MM[:SS], today, midnight, noon or now-N[minutes|hours|days|weeks]")


def slurm_time(t: float | None) -> str:
    return "Unknown" if t is None else time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(t))


def elapsed(seconds: float) -> str:
    """Slurm's [D-]HH:MM:SS."""
    s = int(max(0, seconds))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return f"{d}-{h:02d}:{m:02d}:{s:02d}" if d else f"{h:02d}:{m:02d}:{s:02d}"


def run_seconds(j: JobRecord, now: float) -> float:
    return clip(j.start, j.end, (float("-inf"), float("inf")), now)


SACCT_FIELDS = {
    "jobid": ("JobID", lambda j, now: str(j.id)),
    "jobname": ("JobName", lambda j, now: j.name),
    "user": ("User", lambda j, now: j.user),
    "account": ("Account", lambda j, now: j.account),
    "partition": ("Partition", lambda j, now: j.queue),
    "state": ("State", lambda j, now: j.state),
    "submit": ("Submit", lambda j, now: slurm_time(j.submit)),
    "start": ("Start", lambda j, now: slurm_time(j.start)),
    "end": ("End", lambda j, now: slurm_time(j.end)),
    "elapsed": ("Elapsed", lambda j, now: elapsed(run_seconds(j, now))),
    "allocgpus": ("AllocGPUS", lambda j, now: str(j.gpus)),
    "nnodes": ("NNodes", lambda j, now: str(len(j.allocation))),
    "nodelist": ("NodeList", lambda j, now: ",".join(n for n, _ in j.allocation) or "None assigned"),
    "exitcode": ("ExitCode", lambda j, now: "" if j.exit_code is None else f"{j.exit_code}:0"),
    "gpuhours": ("GPUHours", lambda j, now: f"{run_seconds(j, now) * j.gpus / 3600:.2f}"),
}
SACCT_DEFAULT = "JobID,JobName,Partition,Account,AllocGPUS,State,ExitCode"


def parse_format(spec: str) -> list[tuple[str, int | None]]:
    """`--format JobID,User%12,...` -> [(field, width)]; an unknown field says which exist."""
    out = []
    for item in (s.strip() for s in spec.split(",")):
        if not item:
            continue
        name, _, width = item.partition("%")
        if name.lower() not in SACCT_FIELDS:
            raise ValueError(f"unknown sacct field {name!r}; fields: "
                             f"{', '.join(h for h, _ in SACCT_FIELDS.values())}")
        if width and not width.isdigit():
            raise ValueError(f"field width in {item!r} must be a whole number, as in {name}%12")
        out.append((name.lower(), int(width) if width else None))
    return out


def sacct_rows(jobs: Iterable[JobRecord], fmt: str = SACCT_DEFAULT,
               now: float | None = None) -> tuple[list[str], list[list[str]]]:
    now = time.time() if now is None else now
    fields = parse_format(fmt)
    headers = [SACCT_FIELDS[f][0] for f, _ in fields]
    return headers, [[SACCT_FIELDS[f][1](j, now) for f, _ in fields] for j in jobs]


def render_sacct(jobs: Iterable[JobRecord], fmt: str = SACCT_DEFAULT, output: str = "text",
                 now: float | None = None) -> str:
    """sacct's fixed-width table (default width 10, a value too long ends in '+'), or
    `parsable` (|-separated, as --parsable2), `csv` or `json`."""
    headers, rows = sacct_rows(jobs, fmt, now)
    if output == "json":
        return json.dumps([dict(zip(headers, r, strict=True)) for r in rows], indent=2)
    if output == "csv":
        return _csv(headers, rows)
    if output == "parsable":
        return "\n".join("|".join(r) for r in [headers, *rows]) + "\n"
    widths = [w or 10 for _, w in parse_format(fmt)]

    def cell(v: str, w: int) -> str:
        return (v[: w - 1] + "+" if len(v) > w else v).rjust(w)

    lines = [" ".join(cell(h, w) for h, w in zip(headers, widths, strict=True)),
             " ".join("-" * w for w in widths)]
    lines += [" ".join(cell(v, w) for v, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- sreport

REPORT_HEADERS = ["GPU-hours", "Idle GPU-hours", "Idle %", "Cost", "Jobs"]


def report_rows(rows: list[Usage], currency: str = "USD") -> list[dict]:
    return [{"key": r.key, "jobs": r.jobs, "gpu_hours": round(r.gpu_hours, 4),
             "idle_gpu_hours": round(r.idle_gpu_hours, 4), "idle_pct": round(r.idle_pct, 2),
             "cost": round(r.cost, 2), "currency": currency,
             "unpriced_gpu_hours": round(r.unpriced_gpu_hours, 4)} for r in rows]


def render_report(rows: list[Usage], by: str, window: tuple[float, float], output: str = "text",
                  currency: str = "USD") -> str:
    """An sreport-like usage report: a rich table (text), `json` or `csv`; the last row is the total."""
    every = [*rows, totals(rows)]
    if output == "json":
        return json.dumps({"by": by, "start": window[0], "end": window[1],
                           "rows": report_rows(rows, currency),
                           "total": report_rows([every[-1]], currency)[0]}, indent=2)
    label = {"user": "User", "account": "Account", "queue": "Partition"}[by]
    if output == "csv":
        return _csv([label, *REPORT_HEADERS],
                    [[r.key, f"{r.gpu_hours:.2f}", f"{r.idle_gpu_hours:.2f}", f"{r.idle_pct:.1f}",
                      f"{r.cost:.2f}", str(r.jobs)] for r in every])
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"GPU usage by {by}, {slurm_time(window[0])} - {slurm_time(window[1])}",
                  title_justify="left")
    table.add_column(label)
    for h in REPORT_HEADERS:
        table.add_column(f"{h} ({currency})" if h == "Cost" else h, justify="right")
    for i, r in enumerate(every):
        table.add_row(r.key, f"{r.gpu_hours:.2f}", f"{r.idle_gpu_hours:.2f}", f"{r.idle_pct:.1f}",
                      f"{r.cost:.2f}", str(r.jobs), end_section=i == len(every) - 2)
    buf = io.StringIO()
    Console(file=buf, width=100, color_system=None).print(table)
    return buf.getvalue()


def _csv(headers: list[str], rows: list[list[str]]) -> str:
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(headers)
    w.writerows(rows)
    return buf.getvalue()
