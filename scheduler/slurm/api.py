"""Slurm's commands talking to trainyard's API: the client, errors the way Slurm prints them,
and the job fields (states, reasons, times, node lists) in Slurm's words."""

from __future__ import annotations

import re
import sys
import time
from collections.abc import Callable

import click

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
    from datetime import datetime

    for fmt in ("%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M", "%Y-%m-%d", "%m/%d/%y"):
        try:
            return datetime.strptime(text, fmt).timestamp()
        except ValueError:
            pass
    raise click.BadParameter(f"{text!r} is not a time; use YYYY-MM-DD[THH:MM[:SS]]")


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
