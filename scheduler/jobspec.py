"""Job requests as a user writes them: K=V environment pairs (batch scripts: scheduler/slurm/sbatch.py).

Stdlib only: the CLI validates here before it talks to the daemon, and the API validates the
same way, so a bad value gets the same message from both. Times and sizes: scheduler.units.
"""

from __future__ import annotations

import re

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
