#!/usr/bin/env python3
"""Ansible inventory script: turns trainyard's inventory document (DESIGN.md boundary 6) into groups.

Usage: TRAINYARD_INVENTORY=inventory.json ansible-playbook -i trainyard_inventory.py site.yml
Stdlib only, so Ansible can run it with any Python 3.
"""

from __future__ import annotations

import json
import os
import re
import sys

REQUIRED = ("name", "address", "ssh_user", "ssh_port", "pool", "provider", "gpu_model", "gpu_count")
PROVIDERS = ("aws", "onprem")


class InventoryError(ValueError):
    """The inventory document is not what boundary 6 describes."""


def group_name(prefix: str, value: str) -> str:
    """A valid Ansible group name for a pool or provider (letters, digits, underscores)."""
    return f"{prefix}_{re.sub(r'[^A-Za-z0-9_]', '_', str(value))}"


def validate(doc: object) -> list[dict]:
    """Check the document's shape; raise InventoryError naming the node and the field."""
    if not isinstance(doc, list):
        raise InventoryError(
            f"the inventory document must be a JSON list of nodes, got {type(doc).__name__}"
        )
    seen: set[str] = set()
    for i, node in enumerate(doc):
        if not isinstance(node, dict):
            raise InventoryError(f"node #{i} must be an object, got {type(node).__name__}")
        label = node.get("name", f"#{i}")
        missing = [key for key in REQUIRED if key not in node]
        if missing:
            raise InventoryError(f"node {label!r} lacks {', '.join(missing)}")
        if node["provider"] not in PROVIDERS:
            raise InventoryError(
                f"node {label!r}: provider {node['provider']!r} is not one of {', '.join(PROVIDERS)}"
            )
        for key in ("ssh_port", "gpu_count"):
            if not isinstance(node[key], int) or isinstance(node[key], bool) or node[key] < 0:
                raise InventoryError(
                    f"node {label!r}: {key} must be a non-negative integer, got {node[key]!r}"
                )
        if not isinstance(node.get("labels", {}), dict):
            raise InventoryError(f"node {label!r}: labels must be an object of key/value pairs")
        if node["name"] in seen:
            raise InventoryError(f"node name {node['name']!r} appears twice")
        seen.add(node["name"])
    return doc


def to_inventory(doc: object) -> dict:
    """The Ansible inventory (YAML/JSON inventory shape) for an inventory document."""
    nodes = validate(doc)
    hosts: dict[str, dict] = {}
    children: dict[str, dict] = {}
    for node in nodes:
        hosts[node["name"]] = {
            "ansible_host": node["address"],
            "ansible_user": node["ssh_user"],
            "ansible_port": node["ssh_port"],
            "trainyard_pool": node["pool"],
            "trainyard_provider": node["provider"],
            "trainyard_gpu_model": node["gpu_model"],
            "trainyard_gpu_count": node["gpu_count"],
            "trainyard_labels": dict(node.get("labels") or {}),
        }
        for group in (group_name("pool", node["pool"]), group_name("provider", node["provider"])):
            children.setdefault(group, {"hosts": {}})["hosts"][node["name"]] = {}
    return {"all": {"hosts": hosts, "children": children}}


def to_script_output(inventory: dict) -> dict:
    """The `--list` answer of an inventory script (groups plus _meta.hostvars)."""
    out: dict = {"_meta": {"hostvars": inventory["all"]["hosts"]}}
    out["all"] = {"hosts": sorted(inventory["all"]["hosts"]), "children": sorted(inventory["all"]["children"])}
    for group, body in inventory["all"]["children"].items():
        out[group] = {"hosts": sorted(body["hosts"])}
    return out


def load(path: str) -> dict:
    try:
        with open(path, encoding="utf-8") as fh:
            doc = json.load(fh)
    except FileNotFoundError:
        raise InventoryError(
            f"inventory document {path} does not exist; export it with `pulumi stack output "
            "inventory --json > inventory.json` or set TRAINYARD_INVENTORY"
        ) from None
    except json.JSONDecodeError as exc:
        raise InventoryError(f"inventory document {path} is not valid JSON: {exc}") from None
    return to_inventory(doc)


def main(argv: list[str]) -> int:
    path = os.environ.get("TRAINYARD_INVENTORY", "inventory.json")
    try:
        inventory = load(path)
    except InventoryError as exc:
        print(f"trainyard inventory: {exc}", file=sys.stderr)
        return 1
    if "--host" in argv:
        name = argv[argv.index("--host") + 1] if argv.index("--host") + 1 < len(argv) else ""
        json.dump(inventory["all"]["hosts"].get(name, {}), sys.stdout)
    else:
        json.dump(to_script_output(inventory), sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
