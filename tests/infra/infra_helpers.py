"""Helpers of the infra tests: Pulumi mocks that record everything, sample configs, a fake daemon, the fake CLI's handle."""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pulumi
from pulumi.runtime.mocks import MockMonitor

import infra.scale

SSH_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIBmQ0rU1y1x7hHIl2Lr5o0o9tpKbRz6PZfEwGvcXIh0a ops@example"
DEFAULT_AMI = "ami-0d1a0d1a0d1a0d1a0"
ZONES = ["us-east-1a", "us-east-1b", "us-east-1c"]


@dataclass
class RecordingMocks(pulumi.runtime.Mocks):
    """Answers like AWS would, enough for the program, and keeps every invoke it answered."""

    calls: list[tuple[str, dict]] = field(default_factory=list)
    _n: itertools.count = field(default_factory=lambda: itertools.count(1))

    def new_resource(self, args: pulumi.runtime.MockResourceArgs):
        n = next(self._n)
        state = dict(args.inputs)
        extra = {
            "aws:ec2/instance:Instance": {"publicIp": f"198.51.100.{n}", "privateIp": f"10.42.0.{n}",
                                          "primaryNetworkInterfaceId": f"eni-{n:08x}"},
            "aws:ec2/eip:Eip": {"publicIp": f"203.0.113.{n}"},
            "aws:ec2/keyPair:KeyPair": {"keyName": f"{args.name}-{n}"},
            "aws:iam/role:Role": {"name": f"{args.name}-{n}"},
            "aws:iam/instanceProfile:InstanceProfile": {"arn": f"arn:aws:iam::123456789012:instance-profile/{args.name}"},
            "aws:ec2/launchTemplate:LaunchTemplate": {"latestVersion": 1},
            "aws:ec2/placementGroup:PlacementGroup": {"name": f"{args.name}-{n}"},
        }.get(args.typ, {})
        state.update(extra)
        return (f"{args.name}-id" if args.custom else ""), state

    def call(self, args: pulumi.runtime.MockCallArgs):
        self.calls.append((args.token, dict(args.args)))
        if args.token == "aws:index/getAvailabilityZones:getAvailabilityZones":
            return {"names": list(ZONES), "zoneIds": ["use1-az1", "use1-az2", "use1-az4"], "id": "us-east-1"}
        if args.token == "aws:ssm/getParameter:getParameter":
            return {"name": args.args["name"], "value": DEFAULT_AMI, "type": "String", "id": args.args["name"]}
        if args.token == "aws:ec2/getAmi:getAmi":
            image = args.args["filters"][0]["values"][0]
            return {"id": image, "imageId": image, "rootDeviceName": "/dev/sda1", "architecture": "x86_64"}
        raise AssertionError(f"unexpected invoke {args.token}")



@dataclass
class Res:
    """A registered resource as the engine saw it: its URN (with its parent's type) and its state."""

    urn: str
    type: str
    name: str
    parent_type: str
    state: dict[str, Any]

    @property
    def component(self) -> bool:
        return self.type.startswith("trainyard:infra:")


@dataclass
class Built:
    mocks: RecordingMocks
    resources: list[Res]
    inventory: list[dict]
    cluster: Any

    def of_type(self, typ: str) -> list[Res]:
        return [r for r in self.resources if r.type == typ]

    def named(self, name: str) -> Res:
        (found,) = [r for r in self.resources if r.name == name]
        return found


def _registered(monitor: MockMonitor) -> list[Res]:
    out = []
    for urn, reg in monitor.get_registered_resources().items():
        qualified, name = urn.split("::")[2], urn.split("::")[3]
        *parents, typ = qualified.split("$")
        out.append(Res(urn, typ, name, parents[-1] if parents else "", dict(reg.state or {})))
    return out


@contextlib.contextmanager
def quiet_pulumi_aws():
    """pulumi-aws warns about a deprecated resource of its own (never used here) when the engine loads it."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning, module="pulumi_aws")
        yield


def set_recording_mocks(stack: str = "test") -> tuple[RecordingMocks, MockMonitor]:
    mocks = RecordingMocks()
    monitor = MockMonitor(mocks)
    pulumi.runtime.set_mocks(mocks, project="trainyard", stack=stack, preview=False, monitor=monitor)
    return mocks, monitor


def build_cluster(raw: dict, stack: str = "test") -> Built:
    """Run the GpuCluster for one config under the mocks and collect what it created."""
    from infra.cluster import GpuCluster
    from infra.config import parse_config

    mocks, monitor = set_recording_mocks(stack)
    held: dict[str, Any] = {}

    @pulumi.runtime.test
    def run():
        cluster = GpuCluster(parse_config(raw, default_name=stack))
        held["cluster"] = cluster
        return cluster.inventory.apply(lambda inv: held.__setitem__("inventory", inv))

    with quiet_pulumi_aws():
        run()
    return Built(mocks, _registered(monitor), held["inventory"], held["cluster"])


def aws_pool(name: str = "a100", instance_type: str = "p4d.24xlarge", count: int = 2, **extra) -> dict:
    return {"name": name, "kind": "aws", "instanceType": instance_type, "count": count, **extra}


def onprem_pool(name: str = "lab", hosts: int = 2, **extra) -> dict:
    return {
        "name": name,
        "kind": "onprem",
        "hosts": [
            {"name": f"{name}-gpu-{i:02d}", "address": f"10.1.2.{10 + i}", "sshUser": "ops",
             "gpuModel": "NVIDIA A100-SXM4-80GB", "gpuCount": 8}
            for i in range(1, hosts + 1)
        ],
        **extra,
    }


def stack_config(*pools: dict, **extra) -> dict:
    return {"adminCidrs": ["203.0.113.0/24"], "sshPublicKey": SSH_KEY, "pools": [copy.deepcopy(p) for p in pools], **extra}


# -- the daemon, as infra.scale sees it ----------------------------------------------------------


@dataclass
class FakeDaemon:
    """The daemon's node list and drain, with jobs that end after a number of polls."""

    nodes: dict[str, dict]
    busy_polls: dict[str, int] = field(default_factory=dict)
    drained: list[tuple[str, str]] = field(default_factory=list)
    removed: list[tuple[str, bool]] = field(default_factory=list)
    polls: int = 0
    reachable: bool = True

    def list_nodes(self) -> list[dict]:
        if not self.reachable:
            raise infra.scale.DaemonUnreachable("trainyard daemon unreachable (connection refused)")
        self.polls += 1
        for name, node in self.nodes.items():
            if node["state"] == "DRAINING":
                left = self.busy_polls.get(name, 0)
                if left <= 0:
                    node.update(state="DRAINED", gpus_used=0)
                self.busy_polls[name] = left - 1
        return [dict(n) for n in self.nodes.values()]

    def drain_node(self, name: str, reason: str) -> dict:
        if not self.reachable:
            raise infra.scale.DaemonUnreachable("trainyard daemon unreachable (connection refused)")
        self.drained.append((name, reason))
        self.nodes[name]["state"] = "DRAINING"
        return self.nodes[name]

    def remove_node(self, name: str, force: bool) -> dict:
        if self.nodes[name]["state"] != "DRAINED" and not force:
            raise infra.scale.DrainRefused(f"the daemon refused: node {name} still runs jobs")
        self.removed.append((name, force))
        return self.nodes.pop(name)

    def callables(self):
        return self.list_nodes, self.drain_node, self.remove_node


def daemon(*states: tuple[str, str, int], busy_polls: dict | None = None) -> FakeDaemon:
    return FakeDaemon(
        {n: {"name": n, "pool": n.rsplit("-", 1)[0], "state": s, "gpus_used": g} for n, s, g in states},
        dict(busy_polls or {}),
    )



# -- the stand-in pulumi CLI ---------------------------------------------------------------------

FAKE_PULUMI = Path(__file__).with_name("fake_pulumi.py")


@dataclass
class FakePulumi:
    """Handle on the stand-in CLI of one test: its state, its call log, its project directory."""

    state_path: Path
    log_path: Path
    project_dir: Path

    def init_stack(self, name: str, config: dict, *, select: bool = True) -> None:
        state = self.state()
        state["stacks"][name] = {"config": {f"trainyard:{k}": v for k, v in config.items()}, "deployed": {}}
        if select:
            state["current"] = name
        self.state_path.write_text(json.dumps(state))

    def state(self) -> dict:
        return json.loads(self.state_path.read_text()) if self.state_path.exists() else {"current": None, "stacks": {}}

    def calls(self) -> list[list[str]]:
        if not self.log_path.exists():
            return []
        return [json.loads(line)["argv"] for line in self.log_path.read_text().splitlines()]

    def commands(self) -> list[str]:
        """Each call as its command words, e.g. 'stack select', 'config set', 'up'."""
        subcommands = {"select", "ls", "init", "output", "history", "get", "set"}
        out = []
        for argv in self.calls():
            words = [a for a in argv if a != "--non-interactive"]
            if words[0] in ("stack", "config") and len(words) > 1 and words[1] in subcommands:
                out.append(f"{words[0]} {words[1]}")
            else:
                out.append(words[0])
        return out
