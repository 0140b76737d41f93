"""Slurm's filename patterns for --output, --error and --input: %j %x %A %a %N %u %t %% ...

Stdlib only: the node agent expands them where the file is opened.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

NO_ARRAY_TASK = 4294967294  # what Slurm prints for %a of a job that is not an array task
_PATTERN = re.compile(r"%(\d*)([%AaJjNnstuxb])")


@dataclass(frozen=True)
class PatternContext:
    """What one output file's name may refer to."""

    job_id: int
    job_name: str
    user: str
    node: str  # the first node of the job for the batch step
    array_job_id: int | None = None
    array_task_id: int | None = None
    step: str = "batch"
    node_index: int = 0
    task: int = 0


def expand(pattern: str, ctx: PatternContext) -> str:
    """'slurm-%A_%a.out' -> 'slurm-41_3.out'. A backslash anywhere turns substitution off, as in
    Slurm; a number after % zero-pads (%4j); unknown specifiers stay as written."""
    if "\\" in pattern:
        return pattern.replace("\\", "")
    array_job = ctx.array_job_id if ctx.array_task_id is not None else ctx.job_id
    array_task = ctx.array_task_id if ctx.array_task_id is not None else NO_ARRAY_TASK

    def one(m: re.Match) -> str:
        width, spec = m.groups()
        if spec == "%":
            return "%" if not width else m.group(0)
        value = {
            "A": array_job, "a": array_task, "j": ctx.job_id, "J": f"{ctx.job_id}.{ctx.step}",
            "N": ctx.node.split(".")[0], "n": ctx.node_index, "s": ctx.step, "t": ctx.task,
            "u": ctx.user, "x": ctx.job_name, "b": array_task % 10,
        }[spec]
        text = str(value)
        return text.zfill(int(width)) if width and isinstance(value, int) else text

    return _PATTERN.sub(one, pattern)


def output_path(pattern: str, ctx: PatternContext, workdir: str) -> str:
    """The absolute path of an output file: relative patterns are under the working directory."""
    name = expand(pattern, ctx)
    return name if name.startswith("/") else f"{workdir.rstrip('/')}/{name}"
