"""Job requests: Slurm-style time/memory values, K=V env, and #SBATCH directives in scripts.

Stdlib only: the CLI validates here before it talks to the daemon, and the API validates the
same way, so a bad value gets the same message from both.
"""

from __future__ import annotations

import re
import shlex

_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
_MEM_RE = re.compile(r"^(\d+(?:\.\d+)?)\s*([KMGT]?)B?$", re.IGNORECASE)


def parse_time(value: str | int | float) -> int:
    """Slurm's time formats: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS; or seconds as a number."""
    if isinstance(value, bool):
        raise ValueError(f"time limit {value!r} is not a duration")
    if isinstance(value, int | float):
        if value <= 0:
            raise ValueError(f"time limit {value!r} must be positive")
        return int(value)
    text = value.strip()
    m = _TIME_RE.match(text)
    if not m:
        raise ValueError(
            f"time limit {value!r} is not a duration; use MM, HH:MM:SS or D-HH:MM:SS (e.g. 1:30:00)"
        )
    days, a, b, c = m.groups()
    parts = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-HH[:MM[:SS]]
        h, mi, s = (parts + [0, 0])[:3]
        seconds = int(days) * 86400 + h * 3600 + mi * 60 + s
    elif len(parts) == 1:  # MM
        seconds = parts[0] * 60
    elif len(parts) == 2:  # MM:SS
        seconds = parts[0] * 60 + parts[1]
    else:  # HH:MM:SS
        seconds = parts[0] * 3600 + parts[1] * 60 + parts[2]
    if seconds <= 0:
        raise ValueError(f"time limit {value!r} must be positive")
    return seconds


def format_time(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    seconds = int(seconds)
    days, rest = divmod(seconds, 86400)
    h, rest = divmod(rest, 3600)
    m, s = divmod(rest, 60)
    return f"{days}-{h:02d}:{m:02d}:{s:02d}" if days else f"{h:d}:{m:02d}:{s:02d}"


def parse_mem(value: str | int) -> int:
    """Memory in MB from 16G, 512M, 1.5T or a plain number of megabytes."""
    if isinstance(value, bool):
        raise ValueError(f"memory {value!r} is not a size")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"memory {value!r} must not be negative")
        return value
    m = _MEM_RE.match(value.strip())
    if not m:
        raise ValueError(f"memory {value!r} is not a size; use e.g. 16G or 512M")
    number, unit = float(m.group(1)), m.group(2).upper()
    factor = {"K": 1 / 1024, "": 1, "M": 1, "G": 1024, "T": 1024 * 1024}[unit]
    return int(number * factor)


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def parse_env(items: list[str] | tuple[str, ...]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep or not _ENV_NAME.match(key):
            raise ValueError(f"--env {item!r}: expected NAME=VALUE with a shell variable name")
        env[key] = val
    return env


def check_env_names(env: dict[str, str]) -> None:
    for key in env:
        if not _ENV_NAME.match(key):
            raise ValueError(f"env name {key!r} is not a shell variable name")


# #SBATCH options we understand, mapped to request fields.
_SBATCH_FIELDS = {
    "-J": "name", "--job-name": "name",
    "-p": "queue", "--partition": "queue",
    "-N": "nodes", "--nodes": "nodes",
    "-c": "cpus", "--cpus-per-task": "cpus",
    "--mem": "mem",
    "-t": "time_limit", "--time": "time_limit",
    "--gpus": "gpus", "--gpus-per-node": "gpus", "-G": "gpus",
    "--gres": "gres",
    "--nice": "priority_nice",
    "-a": "array", "--array": "array",
    "-d": "after", "--dependency": "after",
    "-D": "workdir", "--chdir": "workdir",
    "-C": "constraint", "--constraint": "constraint",
    "--exclusive": "exclusive",
}
_INT_FIELDS = {"nodes", "cpus", "gpus"}


def sbatch_directives(script: str) -> dict[str, object]:
    """Read the `#SBATCH` lines at the top of a batch script, as sbatch does.

    Directives stop at the first line that is not a comment or blank. Unknown options raise,
    naming the line, instead of being silently ignored.
    """
    out: dict[str, object] = {}
    for lineno, raw in enumerate(script.splitlines(), 1):
        line = raw.strip()
        if lineno == 1 and line.startswith("#!"):
            continue
        if not line or (line.startswith("#") and not line.startswith("#SBATCH")):
            continue
        if not line.startswith("#SBATCH"):
            break
        tokens = shlex.split(line[len("#SBATCH"):], comments=False)
        while tokens:
            opt = tokens.pop(0)
            if opt.startswith("#"):
                break
            flag, sep, value = opt.partition("=")
            if not sep and flag.startswith("-") and not flag.startswith("--") and len(flag) > 2:
                flag, value = flag[:2], flag[2:]
            field = _SBATCH_FIELDS.get(flag)
            if field is None:
                raise ValueError(f"script line {lineno}: unsupported #SBATCH option {flag!r}")
            if field == "exclusive":
                out["exclusive"] = True
                continue
            if not value and tokens and not tokens[0].startswith("-"):
                value = tokens.pop(0)  # `-N 2` as well as `-N2` and `--nodes=2`
            if not value:
                raise ValueError(f"script line {lineno}: #SBATCH {flag} needs a value ({flag}=VALUE)")
            if field == "gres":
                kind, _, count = value.partition(":")
                if kind != "gpu":
                    raise ValueError(f"script line {lineno}: only --gres=gpu:N is supported, not {value!r}")
                count = count.rpartition(":")[2] or "1"
                field, value = "gpus", count
            if field in _INT_FIELDS:
                if not value.isdigit():
                    raise ValueError(f"script line {lineno}: {flag}={value!r} is not a whole number")
                out[field] = int(value)
            elif field == "after":
                out[field] = value
            else:
                out[field] = value
    return out
