"""Job arrays: parse `--array 0-99%10` and hold an array to its concurrency limit."""

from __future__ import annotations

import re

MAX_TASKS = 10000  # tasks in one array request
MAX_INDEX = 1_000_000

_PART = re.compile(r"^(\d+)(?:-(\d+)(?::(\d+))?)?$")


def parse_array(spec: str) -> tuple[tuple[int, ...], int | None]:
    """'0-99%10' -> ((0, ..., 99), 10). Accepts lists and steps: '1,3,5-11:2%4'. Limit None = none."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError("array: expected task indices such as 0-99, 1,3,5 or 0-99%10, got an empty value")
    text = spec.strip().replace(" ", "")
    body, sep, limit_text = text.partition("%")
    limit: int | None = None
    if sep:
        if not limit_text.isdigit() or int(limit_text) < 1:
            raise ValueError(
                f"array {spec!r}: the concurrency limit after % must be a whole number >= 1, "
                f"got {limit_text!r}"
            )
        limit = int(limit_text)
    indices: set[int] = set()
    for part in body.split(","):
        m = _PART.match(part)
        if not m:
            raise ValueError(
                f"array {spec!r}: cannot read {part!r}; use N, N-M, N-M:STEP, separated by commas, "
                "optionally followed by %LIMIT"
            )
        start, end, step = m.groups()
        first = int(start)
        last = int(end) if end is not None else first
        stride = int(step) if step is not None else 1
        if last < first:
            raise ValueError(f"array {spec!r}: range {part!r} ends before it starts")
        if stride < 1:
            raise ValueError(f"array {spec!r}: step in {part!r} must be >= 1")
        if last > MAX_INDEX:
            raise ValueError(f"array {spec!r}: index {last} is above the maximum {MAX_INDEX}")
        if (last - first) // stride + 1 + len(indices) > MAX_TASKS:
            raise ValueError(f"array {spec!r}: more than {MAX_TASKS} tasks in one array")
        indices.update(range(first, last + 1, stride))
    return tuple(sorted(indices)), limit
