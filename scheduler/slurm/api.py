"""Slurm's commands talking to trainyard's API: the client, errors the way Slurm prints them,
and the job fields (states, reasons, times, node lists) in Slurm's words."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import click

from ..client import id_pages
from .hostlist import compress

EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE = 1, 2, 3

# trainyard's job states (today's and Slurm's words) -> squeue's compact codes
STATE_CODES = {
    "PENDING": "PD", "HELD": "PD", "STARTING": "CF", "CONFIGURING": "CF", "RUNNING": "R",
    "COMPLETING": "CG", "COMPLETED": "CD", "FAILED": "F", "CANCELLED": "CA", "TIMEOUT": "TO",
    "PREEMPTED": "PR", "NODE_FAIL": "NF", "OUT_OF_MEMORY": "OOM",
}
SLURM_STATE = {"HELD": "PENDING", "STARTING": "CONFIGURING"}  # today's words in Slurm's
ACTIVE = {"PENDING", "HELD", "STARTING", "CONFIGURING", "RUNNING", "COMPLETING"}
# the states the daemon stores and filters on (HELD, STARTING and COMPLETING are words it no
# longer stores); scheduler.models.JOB_STATES, which these commands do not import (sqlmodel
# would double their start-up), and a test keeps the two the same
DAEMON_STATES = frozenset(STATE_CODES) - set(SLURM_STATE) - {"COMPLETING"}


def client():
    from ..client import Client, NotConfigured

    try:
        return Client.from_env()
    except NotConfigured as e:
        fail(str(e), EXIT_UNREACHABLE)


def fail(message: str, code: int = EXIT_REFUSED, prog: str = "slurm") -> None:
    click.echo(f"{prog}: error: {message}", err=True)
    sys.exit(code)


def call(fn: Callable, *args, prog: str = "slurm", **kwargs):
    from ..client import ApiError, Unreachable

    try:
        return fn(*args, **kwargs)
    except ApiError as e:
        fail(e.detail, EXIT_REFUSED, prog)
    except Unreachable as e:
        fail(str(e), EXIT_UNREACHABLE, prog)


def slurm_state(job: dict) -> str:
    return SLURM_STATE.get(job["state"], job["state"])


def reason(job: dict) -> str:
    if job["state"] == "HELD":
        return job.get("reason") or "JobHeldUser"
    return job.get("reason") or "None"


def duration(seconds: float | None) -> str:
    from ..units import format_duration

    return format_duration(seconds) if seconds is not None else "0:00"


def nodelist(job: dict) -> str:
    return compress([a["node"] for a in job.get("allocation") or []])


def iso(ts: float | None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(ts)) if ts else "N/A"


def when(text: str) -> float:
    """sacct's -S/-E: Slurm's time formats (scheduler.accounting.slurm_when)."""
    from ..accounting import slurm_when

    try:
        return slurm_when(text, time.time())
    except ValueError as e:
        raise click.BadParameter(str(e)) from None


def squeue_time(seconds: float | None) -> str:
    """squeue's TIME and TIME_LIMIT: `time_limit`'s form, but M:SS under an hour."""
    if seconds is None or seconds >= 3600:
        return time_limit(seconds)
    m, s = divmod(max(0, int(seconds)), 60)
    return f"{m}:{s:02d}"


def sacct_time(seconds: float | None) -> str:
    """sacct's Elapsed and Timelimit: HH:MM:SS, D-HH:MM:SS; UNLIMITED for none."""
    from ..accounting import elapsed

    return "UNLIMITED" if seconds is None else elapsed(seconds)


# ----------------------------------------------------------------------------- job ids
_JOB_REF = re.compile(r"(\d+)(?:_(\d+|\[[\d,\-]+\]))?(?:\.(?:batch|extern|interactive|\d+))?")


@dataclass(frozen=True)
class JobRefs:
    """Jobs named as Slurm's commands name them: `ID` (a job; an array's id names each of its
    tasks), `ID_TASK` and `ID_[1-3,7]` (those tasks of the array ID), each with an optional
    step (`.batch`, `.extern`, `.0`), which names its job: trainyard runs no separate steps."""

    jobs: frozenset[int]
    tasks: frozenset[tuple[int, int]]  # (array id, task index)

    def ids(self) -> list[int]:
        """What to ask the daemon for (`ids`: those jobs and the tasks of those arrays)."""
        return sorted(self.jobs | {array for array, _ in self.tasks})

    def pages(self) -> Iterator[str]:
        """`ids` for each request (client.IDS_MAX in one at most)."""
        return id_pages(self.ids())

    def wants(self, job: dict) -> bool:
        """Whether `job` (as the API shows it) is one of these."""
        array = job.get("array_job_id")
        return (job["id"] in self.jobs or array in self.jobs
                or (array is not None and (array, job.get("array_task_id")) in self.tasks))


def job_refs(text: str) -> JobRefs:
    """Parse a comma list of job ids as Slurm's -j/--jobs takes it; an id that is not one is refused
    with its text (Slurm: "Invalid job id")."""
    jobs: set[int] = set()
    tasks: set[tuple[int, int]] = set()
    for raw in _split_outside_brackets(text):
        ref = raw.strip()
        if not ref:
            continue
        m = _JOB_REF.fullmatch(ref)
        if m is None:
            raise click.BadParameter(f"invalid job id {ref!r}: use ID, ID_TASK or ID_[FIRST-LAST,...]")
        job, task = int(m.group(1)), m.group(2)
        if task is None:
            jobs.add(job)
        elif task.startswith("["):
            tasks |= {(job, t) for t in _task_range(task[1:-1], ref)}
        else:
            tasks.add((job, int(task)))
    if not jobs and not tasks:
        raise click.BadParameter(f"no job id in {text!r}")
    return JobRefs(frozenset(jobs), frozenset(tasks))


def _split_outside_brackets(text: str) -> list[str]:
    parts, depth, cur = [], 0, []
    for ch in text:
        depth += (ch == "[") - (ch == "]")
        if ch == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    return [*parts, "".join(cur)]


def _task_range(body: str, ref: str, most: int = 100_000) -> set[int]:
    out: set[int] = set()
    for piece in body.split(","):
        first, _, last = piece.partition("-")
        if not first.isdigit() or (last and not last.isdigit()):
            raise click.BadParameter(f"invalid job id {ref!r}: task ranges are N or N-M, comma-separated")
        lo, hi = int(first), int(last or first)
        if hi < lo or hi - lo >= most or len(out) + hi - lo >= most:
            raise click.BadParameter(f"invalid job id {ref!r}: at most {most:,} tasks, first <= last")
        out.update(range(lo, hi + 1))
    return out


def refs_jobs(c, refs: JobRefs, prog: str) -> list[dict]:
    """The jobs `refs` names, in any state, as GET /v1/jobs shows them: a request per client.IDS_MAX ids."""
    return [j for ids in refs.pages() for j in call(c.jobs, prog=prog, all=True, ids=ids, limit=100_000)
            if refs.wants(j)]


def resolve_jobs(c, refs: JobRefs, prog: str, array_task: Callable[[dict], bool] | None = None
                 ) -> tuple[dict[int, str], list[str]]:
    """The jobs `refs` names, to act on one by one: (job id -> the name the caller gave it, the
    names that match no task). ID is that job, or each task of the array ID (only those for
    which `array_task(job)` holds, when given: scancel of an array leaves its ended tasks
    alone); ID_TASK is that task. An id this caller cannot see is kept, so that the daemon's
    answer says why."""
    seen = refs_jobs(c, refs, prog)
    by_array: dict[int, list[dict]] = {}
    for j in seen:
        if j.get("array_job_id") is not None:
            by_array.setdefault(j["array_job_id"], []).append(j)
    targets: dict[int, str] = {}
    for job_id in sorted(refs.jobs):
        tasks = by_array.get(job_id)
        if tasks:
            targets.update((j["id"], f"{job_id}_{j['array_task_id']}") for j in tasks
                           if array_task is None or array_task(j))
        else:
            targets[job_id] = str(job_id)
    by_task = {(j.get("array_job_id"), j.get("array_task_id")): j["id"] for j in seen}
    missing = []
    for array, task in sorted(refs.tasks):
        if (array, task) in by_task:
            targets.setdefault(by_task[array, task], f"{array}_{task}")
        else:
            missing.append(f"{array}_{task}")
    return dict(sorted(targets.items())), missing


def job_refs_option(_ctx, _param, value: str | None) -> JobRefs | None:
    """A click callback: -j/--jobs as JobRefs, refused with the option's name when it is not one."""
    return None if value is None else job_refs(value)


def time_limit(seconds: float | None) -> str:
    """Slurm's [days-]hours:minutes:seconds, or UNLIMITED."""
    if seconds is None:
        return "UNLIMITED"
    days, rest = divmod(int(seconds), 86400)
    hms = f"{rest // 3600}:{rest // 60 % 60:02d}:{rest % 60:02d}"
    return f"{days}-{hms.zfill(8)}" if days else hms


_FIELD = re.compile(r"%(\.)?(-)?(#|\d*)([a-zA-Z])")


def format_lines(fmt: str, rows: list[Callable[[str], str]], headers: dict[str, str],
                 header: bool = True) -> list[str]:
    """Lines for a Slurm -o/--format string: `%[.][width]X` fields, `.` right-justifies, `#`
    is the widest value of the column; each row is a function from a field letter to its text."""
    texts = [{m.group(4): value(m.group(4)) for m in _FIELD.finditer(fmt)} for value in rows]

    def width(letter: str) -> int:
        return max([len(headers.get(letter, letter.upper()))] + [len(t[letter]) for t in texts])

    def render(value: Callable[[str], str]) -> str:
        def one(m: re.Match) -> str:
            right, _left, size, letter = m.groups()
            text = value(letter)
            if size:
                w = width(letter) if size == "#" else int(size)
                text = text[:w]
                text = text.rjust(w) if right else text.ljust(w)
            return text

        return _FIELD.sub(one, fmt).rstrip()

    lines = [render(lambda letter: headers.get(letter, letter.upper()))] if header else []
    return lines + [render(lambda letter, t=t: t[letter]) for t in texts]


def api_fields(url: str) -> set[str] | None:
    """The job submit fields the daemon declares in its OpenAPI schema (None if it cannot tell)."""
    import httpx

    try:
        schema = httpx.get(f"{url.rstrip('/')}/openapi.json", timeout=10).json()
        for name, model in schema.get("components", {}).get("schemas", {}).items():
            if name == "JobSubmit":
                return set(model.get("properties", {}))
    except (httpx.HTTPError, ValueError):
        return None
    return None
