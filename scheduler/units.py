"""Durations and memory sizes as Slurm users write them: the one parser for both (and the
daemon's HOST:PORT, which the CLI and the configuration both read).

Stdlib only, so the CLI, the API, the configuration layer and the planner's callers give the
same answer and the same message for the same value.
"""

from __future__ import annotations

import math
import re

# Bounds keep every value inside a 64-bit database column and inside what a cluster can mean.
MAX_DURATION_S = 10 * 365 * 86400  # ten years
MAX_MEM_MIB = 64 * 1024**3  # 64 PiB
_MAX_TEXT = 64  # longer input is never a duration or a size; refuse before any regex or int()

DURATION_FORMATS = "seconds, MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS, or 90s, 30m, 2h, 1d"

_SLURM_TIME = re.compile(r"(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?", re.ASCII)
_SUFFIXED_TIME = re.compile(r"(\d+(?:\.\d+)?)\s*([smhd])", re.ASCII | re.IGNORECASE)
_SUFFIX_S = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_MEM = re.compile(r"(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?", re.ASCII | re.IGNORECASE)
_MEM_MIB = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024**2}


class UnitError(ValueError):
    """A value that is not a duration or a size; `problem` is the message without the key."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key}: {problem}" if key else problem)
        self.key = key
        self.problem = problem


def parse_duration(value: object, key: str = "time") -> float:
    """Seconds from a number of seconds, a Slurm time string, or a number with s/m/h/d.

    Slurm's formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS (so "90" is 90 minutes,
    as sbatch reads it). Zero is allowed; negative, NaN, infinite, boolean and more than ten
    years are refused with a message that names `key` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise UnitError(key, f"expected seconds or a time like 1:00:00, got {value!r}")
    if isinstance(value, str):
        seconds = _read_duration_text(value, key)
    elif isinstance(value, float) and not math.isfinite(value):
        raise UnitError(key, f"expected a finite number of seconds, got {value!r}")
    else:
        seconds = value
    if seconds < 0:
        raise UnitError(key, f"must be >= 0 seconds, got {value!r}")
    if seconds > MAX_DURATION_S:
        raise UnitError(key, f"{value!r} is longer than ten years ({MAX_DURATION_S} s)")
    return float(seconds)


def _read_duration_text(value: str, key: str) -> float:
    text = value.strip()
    if len(text) <= _MAX_TEXT:
        if m := _SLURM_TIME.fullmatch(text):
            days, a, b, c = m.groups()
            parts = [int(x) for x in (a, b, c) if x is not None]
            if days is not None:  # D-HH[:MM[:SS]]
                h, mi, s = parts + [0] * (3 - len(parts))
                return int(days) * 86400 + h * 3600 + mi * 60 + s
            if len(parts) == 1:  # MM
                return parts[0] * 60
            if len(parts) == 2:  # MM:SS
                return parts[0] * 60 + parts[1]
            h, mi, s = parts
            return h * 3600 + mi * 60 + s
        if m := _SUFFIXED_TIME.fullmatch(text):
            return float(m.group(1)) * _SUFFIX_S[m.group(2).lower()]
    raise UnitError(key, f"cannot read {value!r} as a duration; use {DURATION_FORMATS}")


def parse_time_limit(value: object, key: str = "time limit") -> int:
    """A job's time limit in whole seconds: a duration that must be more than zero."""
    seconds = parse_duration(value, key)
    if seconds < 1:
        raise UnitError(key, f"must be positive, got {value!r}; e.g. 1:00:00 for one hour")
    return int(seconds)


def format_duration(seconds: float | None) -> str:
    """Slurm's display form: H:MM:SS, or D-HH:MM:SS from one day on; '-' for none."""
    if seconds is None:
        return "-"
    days, rest = divmod(int(seconds), 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return f"{days}-{h:02d}:{m:02d}:{s:02d}" if days else f"{h:d}:{m:02d}:{s:02d}"


def parse_mem(value: object, key: str = "mem") -> int:
    """Memory in MiB from 16G, 512M, 1.5T, 100K or a plain number (MiB, Slurm's default unit).

    Fractions round up, so a request never becomes smaller than asked. Negative, non-finite,
    boolean and more than 64 PiB are refused with a message that names `key` and the value.
    """
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise UnitError(key, f"expected a size like 16G or 512M, got {value!r}")
    if isinstance(value, str):
        m = _MEM.fullmatch(value.strip()) if len(value) <= _MAX_TEXT else None
        if not m:
            raise UnitError(key, f"cannot read {value!r} as a size; use e.g. 16G, 512M or 1.5T")
        mib = float(m.group(1)) * _MEM_MIB[m.group(2).upper()]
    elif isinstance(value, float) and not math.isfinite(value):
        raise UnitError(key, f"expected a finite size, got {value!r}")
    else:
        mib = value
    if mib < 0:
        raise UnitError(key, f"must not be negative, got {value!r}")
    if mib > MAX_MEM_MIB:
        raise UnitError(key, f"{value!r} is more than 64 PiB ({MAX_MEM_MIB} MiB)")
    return math.ceil(mib)


def parse_listen(value: str) -> tuple[str, int]:
    """A listen address, HOST:PORT (an IPv6 host in brackets; no host: loopback)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--listen {value!r}: expected HOST:PORT, e.g. 127.0.0.1:8471")
    return host.strip("[]") or "127.0.0.1", int(port)
