"""The Pulumi program: read the stack config once, build the `GpuCluster`, export the inventory."""

from __future__ import annotations

import re

import pulumi

from infra.config import ConfigError, load_from_pulumi


def default_cluster_name(stack: str) -> str:
    """A stack name made fit for AWS resource names (`Prod_EU` -> `prod-eu`)."""
    name = re.sub(r"[^a-z0-9-]+", "-", stack.lower()).strip("-")[:32].strip("-")
    return name or "trainyard"


def main() -> None:
    from infra.cluster import GpuCluster

    try:
        config = load_from_pulumi(default_cluster_name(pulumi.get_stack()))
    except ConfigError as exc:
        # RunError ends the program with the message alone: a config mistake is not a bug.
        raise pulumi.RunError(str(exc)) from None
    cluster = GpuCluster(config)
    pulumi.export("cluster", config.name)
    pulumi.export("inventory", cluster.inventory)
