"""Slurm hostlists: expand "gpu-[01-04,07],cpu1" into names and compress names back.

Stdlib only and free of package imports: the `scontrol` and `srun` shims load this very file
on the nodes, next to them.
"""

from __future__ import annotations

import re

MAX_HOSTS = 65536  # a hostlist that expands to more is a typo, not a cluster

_BRACKET = re.compile(r"\[([^\[\]]*)\]")
_NUMBERED = re.compile(r"^(.*?)(\d+)(\D*)$")


class HostlistError(ValueError):
    """A hostlist that cannot be read."""


def _split_top(text: str) -> list[str]:
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"hostlist {text!r}: brackets inside brackets")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"hostlist {text!r}: ']' without '['")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise HostlistError(f"hostlist {text!r}: '[' is not closed")
    parts.append(text[start:])
    return parts


def _range(text: str, item: str) -> list[str]:
    out = []
    for part in item.split(","):
        lo, dash, hi = part.partition("-")
        if not lo.isdigit() or (dash and not hi.isdigit()):
            raise HostlistError(f"hostlist {text!r}: cannot read range {part!r}; use e.g. [01-04,07]")
        if not dash:
            out.append(lo)
            continue
        first, last = int(lo), int(hi)
        if last < first:
            raise HostlistError(f"hostlist {text!r}: range {part!r} ends before it starts")
        if last - first >= MAX_HOSTS:
            raise HostlistError(f"hostlist {text!r}: range {part!r} has more than {MAX_HOSTS} hosts")
        width = len(lo) if lo.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(first, last + 1))
    return out


def expand(hostlist: str) -> list[str]:
    """'gpu-[01-02],cpu1' -> ['gpu-01', 'gpu-02', 'cpu1']; several brackets multiply out.

    Order is kept and duplicates are dropped, as `scontrol show hostnames` prints them.
    """
    text = hostlist.strip()
    names: list[str] = []
    seen: set[str] = set()
    for part in _split_top(text):
        part = part.strip()
        if not part:
            continue
        expanded = [""]
        pos = 0
        for m in _BRACKET.finditer(part):
            literal = part[pos:m.start()]
            choices = _range(text, m.group(1))
            expanded = [e + literal + c for e in expanded for c in choices]
            if len(expanded) > MAX_HOSTS:
                raise HostlistError(f"hostlist {text!r} has more than {MAX_HOSTS} hosts")
            pos = m.end()
        tail = part[pos:]
        if "[" in tail or "]" in tail:
            raise HostlistError(f"hostlist {text!r}: unbalanced brackets in {part!r}")
        for name in (e + tail for e in expanded):
            if name not in seen:
                seen.add(name)
                names.append(name)
    return names


def compress(names: list[str] | tuple[str, ...], sort: bool = True) -> str:
    """['gpu-01', 'gpu-02', 'gpu-04', 'cpu1'] -> 'cpu1,gpu-[01-02,04]' (Slurm's ranged form).

    Names that share a prefix, a suffix and a number width fold into one bracket. With
    sort=True (as Slurm prints SLURM_JOB_NODELIST) groups and numbers come out in order.
    """
    groups: dict[tuple[str, str, int], list[int]] = {}
    order: list[tuple[str, str, int] | str] = []
    unique = list(dict.fromkeys(names))
    padded: dict[tuple[str, str], set[int]] = {}  # zero-padded widths seen per prefix and suffix
    for name in unique:
        m = _NUMBERED.match(name)
        if m and m.group(2).startswith("0") and len(m.group(2)) > 1:
            padded.setdefault((m.group(1), m.group(3)), set()).add(len(m.group(2)))
    for name in unique:
        m = _NUMBERED.match(name)
        if not m:
            order.append(name)
            continue
        prefix, digits, suffix = m.groups()
        if digits.startswith("0") and len(digits) > 1:
            width = len(digits)
        else:  # "10" joins "09" (width 2); "9" stays apart from "09"
            width = max((w for w in padded.get((prefix, suffix), ()) if w <= len(digits)), default=0)
            width = width if width and len(digits) == width else 0
        key = (prefix, suffix, width)
        if key not in groups:
            groups[key] = []
            order.append(key)
        groups[key].append(int(digits))
    if sort:
        order.sort(key=lambda k: (k, "", 0) if isinstance(k, str) else k)
    out = []
    for key in order:
        if isinstance(key, str):
            out.append(key)
            continue
        prefix, suffix, width = key
        numbers = sorted(set(groups[key])) if sort else groups[key]
        if len(numbers) == 1:
            out.append(f"{prefix}{str(numbers[0]).zfill(width)}{suffix}")
            continue
        runs: list[list[int]] = []
        for n in numbers:
            if runs and n == runs[-1][1] + 1:
                runs[-1][1] = n
            else:
                runs.append([n, n])
        ranges = ",".join(str(a).zfill(width) if a == b else f"{str(a).zfill(width)}-{str(b).zfill(width)}"
                          for a, b in runs)
        out.append(f"{prefix}[{ranges}]{suffix}")
    return ",".join(out)
