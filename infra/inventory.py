"""The inventory document (DESIGN.md boundary 6): the nodes infra hands to the playbooks and the scheduler."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from infra.config import AwsPool, OnPremPool

FIELDS = ("name", "address", "ssh_user", "ssh_port", "pool", "provider", "gpu_model", "gpu_count", "labels")
PROVIDERS = ("aws", "onprem")


def aws_node(pool: AwsPool, index: int, address: str) -> dict[str, Any]:
    labels = {
        "instance-type": pool.instance_type.name,
        "capacity": "spot" if pool.spot else "on-demand",
        **pool.labels,
    }
    return {
        "name": pool.node_name(index),
        "address": address,
        "ssh_user": pool.ssh_user,
        "ssh_port": 22,
        "pool": pool.name,
        "provider": "aws",
        "gpu_model": pool.instance_type.gpu_model,
        "gpu_count": pool.instance_type.gpu_count,
        "labels": labels,
    }


def onprem_nodes(pool: OnPremPool) -> list[dict[str, Any]]:
    return [
        {
            "name": h.name,
            "address": h.address,
            "ssh_user": h.ssh_user,
            "ssh_port": h.ssh_port,
            "pool": pool.name,
            "provider": "onprem",
            "gpu_model": h.gpu_model,
            "gpu_count": h.gpu_count,
            "labels": dict(h.labels),
        }
        for h in pool.hosts
    ]


def problems(doc: Any) -> list[str]:
    """What is wrong with an inventory document; empty when it is well formed."""
    if not isinstance(doc, list):
        return [f"an inventory is a JSON list of nodes, got {type(doc).__name__}"]
    found: list[str] = []
    names: set[str] = set()
    for i, node in enumerate(doc):
        if not isinstance(node, Mapping):
            found.append(f"[{i}] is not an object")
            continue
        missing = [f for f in FIELDS if f not in node]
        if missing:
            found.append(f"[{i}] ({node.get('name', '?')}) lacks {', '.join(missing)}")
            continue
        if node["name"] in names:
            found.append(f"[{i}] repeats the node name {node['name']!r}")
        names.add(node["name"])
        if node["provider"] not in PROVIDERS:
            found.append(f"[{i}] ({node['name']}) provider must be aws or onprem, got {node['provider']!r}")
        if not isinstance(node["ssh_port"], int) or not isinstance(node["gpu_count"], int):
            found.append(f"[{i}] ({node['name']}) ssh_port and gpu_count must be whole numbers")
        if not isinstance(node["labels"], Mapping):
            found.append(f"[{i}] ({node['name']}) labels must be an object")
        if not node["address"]:
            found.append(f"[{i}] ({node['name']}) has no address yet")
    return found


def dumps(nodes: Iterable[Mapping[str, Any]]) -> str:
    return json.dumps([{f: n[f] for f in FIELDS} for n in nodes], indent=2) + "\n"


def write(path: Path, nodes: Iterable[Mapping[str, Any]]) -> None:
    nodes = list(nodes)
    bad = problems(nodes)
    if bad:
        raise ValueError("refusing to write a malformed inventory: " + "; ".join(bad))
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(dumps(nodes))
    tmp.replace(path)


def load(path: Path) -> list[dict[str, Any]]:
    """Read and check an inventory file (for `trainyard node import` and `trainyard bootstrap`)."""
    try:
        doc = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise ValueError(f"{path} is not JSON: {exc}") from None
    bad = problems(doc)
    if bad:
        raise ValueError(f"{path} is not a trainyard inventory: " + "; ".join(bad))
    return doc
