"""Reads Prometheus text format exactly as written (prometheus_client's parser renames counters)."""

from __future__ import annotations

import re

SAMPLE = re.compile(r'^([A-Za-z_:][A-Za-z0-9_:]*)(?:\{(.*)\})? (\S+)$')
LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)",?')


def parse(text: str) -> dict[str, dict]:
    """{family name: {"type", "help", "samples": [(name, labels, value)]}}; a sample whose name
    has no family of its own goes to the family it extends (_bucket, _sum, _count, _total)."""
    fams: dict[str, dict] = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, doc = line[7:].partition(" ")
            fams.setdefault(name, {"type": None, "help": None, "samples": []})["help"] = doc
        elif line.startswith("# TYPE "):
            name, _, typ = line[7:].partition(" ")
            fams.setdefault(name, {"type": None, "help": None, "samples": []})["type"] = typ
        elif line and not line.startswith("#"):
            m = SAMPLE.match(line)
            assert m, f"not a sample line: {line!r}"
            name, body, value = m.groups()
            labels = {k: v.replace(r"\"", '"').replace(r"\n", "\n").replace("\\\\", "\\")
                      for k, v in LABEL.findall(body or "")}
            family = name if name in fams else re.sub(r"_(bucket|sum|count|total|created)$", "", name)
            fams[family]["samples"].append((name, labels, float(value)))
    return fams


def series(fams: dict, name: str) -> dict[str, tuple[dict, float]]:
    """One family's samples keyed by their `gpu` label (or "" when they have none)."""
    return {s[1].get("gpu", ""): (s[1], s[2]) for s in fams[name]["samples"]}
