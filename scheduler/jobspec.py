"""Job requests as a Slurm user writes them: K=V env and #SBATCH directives in scripts.

Stdlib only: the CLI validates here before it talks to the daemon, and the API validates the
same way, so a bad value gets the same message from both. Times and sizes: scheduler.units.
"""

from __future__ import annotations

import re
import shlex

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
