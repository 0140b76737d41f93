"""The stack config under the `trainyard` namespace, read once into typed objects with errors for people."""

from __future__ import annotations

import difflib
import ipaddress
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from infra.instance_types import CATALOGUE, InstanceType

NAMESPACE = "trainyard"
# The keys the program reads; the structured ones arrive from Pulumi as JSON text.
TOP_LEVEL_KEYS = ("clusterName", "vpcCidr", "adminCidrs", "sshPublicKey", "pools")
STRUCTURED_KEYS = frozenset({"adminCidrs", "pools"})

DEFAULT_VPC_CIDR = "10.42.0.0/16"
DEFAULT_DISK_GB = 200
DEFAULT_SSH_USER = "ubuntu"  # the login of Ubuntu images, the default AMI's included
MAX_POOL_COUNT = 512

AWS_POOL_KEYS = (
    "name", "kind", "instanceType", "count", "spot", "maxPrice", "ami", "diskGb",
    "availabilityZone", "labels", "sshUser", "placementGroup",
)
ONPREM_POOL_KEYS = ("name", "kind", "hosts", "labels")
HOST_KEYS = ("name", "address", "sshUser", "sshPort", "gpuModel", "gpuCount", "labels")

_POOL_NAME = re.compile(r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$")
_HOST_NAME = re.compile(r"^[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?$")
_AMI = re.compile(r"^ami-[0-9a-f]{8,17}$")
_ZONE = re.compile(r"^[a-z]{2}-[a-z0-9-]*[0-9][a-z]$")
_SSH_KEY_TYPES = ("ssh-ed25519", "ssh-rsa")  # what EC2 key pairs accept
_EMPTY: Mapping[str, str] = MappingProxyType({})


class ConfigError(ValueError):
    """Every problem found in the stack config, each naming the key, the value and the fix."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"invalid stack config ({NAMESPACE}:*):\n{lines}")


@dataclass(frozen=True)
class OnPremHost:
    name: str
    address: str
    ssh_user: str = DEFAULT_SSH_USER
    ssh_port: int = 22
    gpu_model: str = ""
    gpu_count: int = 0
    labels: Mapping[str, str] = field(default_factory=lambda: _EMPTY)


@dataclass(frozen=True)
class OnPremPool:
    name: str
    hosts: tuple[OnPremHost, ...]
    labels: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    kind: str = field(default="onprem", init=False)


@dataclass(frozen=True)
class AwsPool:
    name: str
    instance_type: InstanceType
    count: int
    spot: bool = False
    max_price: str | None = None
    ami: str | None = None  # None: the default GPU-ready Ubuntu image (see cluster.DEFAULT_AMI_PARAMETER)
    disk_gb: int = DEFAULT_DISK_GB
    availability_zone: str | None = None  # None: the region's first available zone
    labels: Mapping[str, str] = field(default_factory=lambda: _EMPTY)
    ssh_user: str = DEFAULT_SSH_USER
    placement_group: bool = False
    kind: str = field(default="aws", init=False)

    @property
    def efa_interfaces(self) -> int:
        return self.instance_type.efa_interfaces

    def node_name(self, index: int) -> str:
        return f"{self.name}-{index}"

    def node_names(self, count: int | None = None) -> list[str]:
        return [self.node_name(i) for i in range(self.count if count is None else count)]


Pool = AwsPool | OnPremPool


@dataclass(frozen=True)
class ClusterConfig:
    name: str
    admin_cidrs: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    ssh_public_key: str | None = None
    pools: tuple[Pool, ...] = ()
    vpc_cidr: ipaddress.IPv4Network = ipaddress.IPv4Network(DEFAULT_VPC_CIDR)

    @property
    def aws_pools(self) -> tuple[AwsPool, ...]:
        return tuple(p for p in self.pools if isinstance(p, AwsPool))

    @property
    def onprem_pools(self) -> tuple[OnPremPool, ...]:
        return tuple(p for p in self.pools if isinstance(p, OnPremPool))

    def pool(self, name: str) -> Pool:
        for p in self.pools:
            if p.name == name:
                return p
        known = ", ".join(p.name for p in self.pools) or "none"
        raise ConfigError([f"no pool named {name!r} in {NAMESPACE}:pools (pools: {known})"])


def raw_from_strings(values: Mapping[str, str | None]) -> dict[str, Any]:
    """Pulumi hands config to programs (and `pulumi config --json` to us) as text; decode the structured keys."""
    raw: dict[str, Any] = {}
    for key, text in values.items():
        if text is None:
            continue
        if key in STRUCTURED_KEYS and isinstance(text, str):
            try:
                raw[key] = json.loads(text)
            except json.JSONDecodeError:
                raw[key] = text  # reported by parse_config as "must be a list"
        else:
            raw[key] = text
    return raw


def parse_config(raw: Mapping[str, Any], *, default_name: str) -> ClusterConfig:
    """Validate the whole config at once and report every problem, not just the first."""
    problems: list[str] = []
    name = _cluster_name(raw.get("clusterName"), default_name, problems)
    vpc_cidr = _vpc_cidr(raw.get("vpcCidr"), problems)
    pools = _pools(raw.get("pools"), problems)
    aws_pools = [p for p in pools if isinstance(p, AwsPool)]
    # Judged on what was asked for, so that one broken AWS pool does not hide a missing key too.
    wants_aws = isinstance(raw.get("pools"), list) and any(
        isinstance(p, dict) and p.get("kind") == "aws" for p in raw["pools"]
    )
    cidrs = _admin_cidrs(raw.get("adminCidrs"), problems, required=wants_aws)
    key = _ssh_public_key(raw.get("sshPublicKey"), problems, required=wants_aws)
    _check_unique_nodes(pools, problems)
    _check_zones(aws_pools, problems)
    if problems:
        raise ConfigError(problems)
    return ClusterConfig(name=name, admin_cidrs=cidrs, ssh_public_key=key, pools=tuple(pools), vpc_cidr=vpc_cidr)


def load_from_pulumi(default_name: str) -> ClusterConfig:
    """Read `trainyard:*` from the running stack (the program's only config read)."""
    import pulumi

    cfg = pulumi.Config(NAMESPACE)
    return parse_config(raw_from_strings({k: cfg.get(k) for k in TOP_LEVEL_KEYS}), default_name=default_name)


# -- pieces ------------------------------------------------------------------------------------


def _cluster_name(value: Any, default: str, problems: list[str]) -> str:
    name = default if value is None else value
    if not isinstance(name, str) or not _POOL_NAME.match(name):
        problems.append(
            f"clusterName {name!r} must be lowercase letters, digits and dashes (at most 32), "
            f"e.g. 'prod'; it prefixes every AWS resource name"
        )
        return str(default)
    return name


def _vpc_cidr(value: Any, problems: list[str]) -> ipaddress.IPv4Network:
    default = ipaddress.IPv4Network(DEFAULT_VPC_CIDR)
    if value is None:
        return default
    try:
        net = ipaddress.IPv4Network(str(value), strict=True)
    except ValueError:
        problems.append(f"vpcCidr {value!r} is not an IPv4 CIDR such as {DEFAULT_VPC_CIDR}")
        return default
    if not 16 <= net.prefixlen <= 24:
        problems.append(f"vpcCidr {value!r} must be between a /16 and a /24 (one subnet per zone is carved from it)")
        return default
    return net


def _admin_cidrs(value: Any, problems: list[str], *, required: bool) -> tuple:
    if value is None:
        value = []
    if not isinstance(value, list):
        problems.append(f"adminCidrs must be a list of CIDRs such as ['203.0.113.0/24'], got {value!r}")
        return ()
    if required and not value:
        problems.append(
            "adminCidrs is empty: SSH to the AWS nodes would be closed to everyone; "
            "add the CIDRs of your admins and of the trainyard daemon, e.g. ['203.0.113.7/32']"
        )
    nets = []
    for i, text in enumerate(value):
        try:
            net = ipaddress.ip_network(str(text), strict=True)
        except ValueError as exc:
            hint = ""
            if "has host bits set" in str(exc):
                hint = f"; did you mean {ipaddress.ip_network(str(text), strict=False)}?"
            problems.append(f"adminCidrs[{i}] {text!r} is not a CIDR (expected e.g. 203.0.113.0/24){hint}")
            continue
        if net.prefixlen == 0:
            problems.append(
                f"adminCidrs[{i}] {text!r} would open SSH to the whole internet; list your admins' networks instead"
            )
            continue
        nets.append(net)
    return tuple(nets)


def _ssh_public_key(value: Any, problems: list[str], *, required: bool) -> str | None:
    if value is None or value == "":
        if required:
            problems.append(
                "sshPublicKey is missing: set it to the content of your public key, e.g. "
                "pulumi config set trainyard:sshPublicKey \"$(cat ~/.ssh/id_ed25519.pub)\""
            )
        return None
    key = str(value).strip()
    if "PRIVATE KEY" in key:
        problems.append("sshPublicKey holds a private key; give the public key (the .pub file) instead")
        return None
    if key.split(" ", 1)[0] not in _SSH_KEY_TYPES or len(key.split()) < 2:
        problems.append(
            f"sshPublicKey {key[:24]!r}... is not an OpenSSH public key of a type EC2 accepts "
            f"({', '.join(_SSH_KEY_TYPES)})"
        )
        return None
    return key


def _pools(value: Any, problems: list[str]) -> list[Pool]:
    if value is None:
        return []
    if not isinstance(value, list):
        problems.append(f"pools must be a list of pool objects, got {value!r}")
        return []
    pools: list[Pool] = []
    seen: set[str] = set()
    for i, item in enumerate(value):
        where = f"pools[{i}]"
        if not isinstance(item, dict):
            problems.append(f"{where} must be an object with name and kind, got {item!r}")
            continue
        name = item.get("name")
        if name is None or name == "":
            problems.append(f"{where}: a pool needs a name (lowercase letters, digits, dashes), e.g. name: a100")
            continue
        where = f"pools[{i}] ({name})"
        if not isinstance(name, str) or not _POOL_NAME.match(name):
            problems.append(f"{where}: pool name {name!r} must be lowercase letters, digits and dashes (at most 32)")
            continue
        if name in seen:
            problems.append(f"{where}: another pool is already named {name!r}; pool names must be unique")
            continue
        seen.add(name)
        kind = item.get("kind")
        before = len(problems)
        if kind == "aws":
            _unknown_keys(item, AWS_POOL_KEYS, where, problems)
            pool: Pool | None = _aws_pool(name, item, where, problems)
        elif kind == "onprem":
            _unknown_keys(item, ONPREM_POOL_KEYS, where, problems)
            pool = _onprem_pool(name, item, where, problems)
        else:
            problems.append(f"{where}: kind must be 'aws' or 'onprem', got {kind!r}")
            continue
        if pool is not None and len(problems) == before:
            pools.append(pool)
    return pools


def _aws_pool(name: str, item: dict, where: str, problems: list[str]) -> AwsPool | None:
    itype_name = item.get("instanceType")
    itype = CATALOGUE.get(itype_name) if isinstance(itype_name, str) else None
    if itype is None:
        if itype_name is None:
            problems.append(f"{where}: instanceType is missing, e.g. instanceType: p5.48xlarge")
        else:
            close = difflib.get_close_matches(str(itype_name), CATALOGUE, n=3)
            hint = f"; did you mean {' or '.join(close)}?" if close else ""
            families = ", ".join(sorted({t.family for t in CATALOGUE.values()}))
            problems.append(f"{where}: unknown instance type {itype_name!r} (known GPU families: {families}){hint}")
    count = _int(item.get("count"), f"{where}: count", problems, minimum=0, maximum=MAX_POOL_COUNT)
    if "count" not in item:
        problems.append(f"{where}: count is missing (number of nodes, 0 or more)")
    spot = _bool(item.get("spot", False), f"{where}: spot", problems)
    max_price = item.get("maxPrice")
    if max_price is not None:
        try:
            price = float(max_price)
            if price <= 0:
                raise ValueError
            max_price = f"{price:g}"
        except (TypeError, ValueError):
            problems.append(f"{where}: maxPrice {max_price!r} must be a positive price in USD per hour, e.g. 12.5")
            max_price = None
        if not spot:
            problems.append(f"{where}: maxPrice applies to spot capacity only; set spot: true or remove maxPrice")
    ami = item.get("ami")
    if ami is not None and (not isinstance(ami, str) or not _AMI.match(ami)):
        problems.append(f"{where}: ami {ami!r} is not an AMI id such as ami-0123456789abcdef0")
    disk = _int(item.get("diskGb", DEFAULT_DISK_GB), f"{where}: diskGb", problems, minimum=8, maximum=16384)
    zone = item.get("availabilityZone")
    if zone is not None and (not isinstance(zone, str) or not _ZONE.match(zone)):
        problems.append(f"{where}: availabilityZone {zone!r} is not a zone name such as us-east-1a")
    labels = _labels(item.get("labels"), f"{where}: labels", problems)
    ssh_user = item.get("sshUser", DEFAULT_SSH_USER)
    if not isinstance(ssh_user, str) or not ssh_user:
        problems.append(f"{where}: sshUser must be a login name, got {ssh_user!r}")
    placement = item.get("placementGroup")
    if placement is not None:
        placement = _bool(placement, f"{where}: placementGroup", problems)
    if itype is None or count is None:
        return None
    return AwsPool(
        name=name,
        instance_type=itype,
        count=count,
        spot=bool(spot),
        max_price=max_price,
        ami=ami,
        disk_gb=disk or DEFAULT_DISK_GB,
        availability_zone=zone,
        labels=labels,
        ssh_user=str(ssh_user),
        placement_group=itype.built_for_multi_node if placement is None else bool(placement),
    )


def _onprem_pool(name: str, item: dict, where: str, problems: list[str]) -> OnPremPool | None:
    hosts_raw = item.get("hosts")
    if not isinstance(hosts_raw, list) or not hosts_raw:
        problems.append(f"{where}: an on-prem pool declares its machines in hosts: a non-empty list of {{name, address}}")
        return None
    labels = _labels(item.get("labels"), f"{where}: labels", problems)
    hosts = []
    for j, h in enumerate(hosts_raw):
        at = f"{where} hosts[{j}]"
        if not isinstance(h, dict):
            problems.append(f"{at} must be an object with name and address, got {h!r}")
            continue
        hname = h.get("name")
        if hname:
            at = f"{where} host {hname}"
        _unknown_keys(h, HOST_KEYS, at, problems)
        if not hname or not isinstance(hname, str) or not _HOST_NAME.match(hname):
            problems.append(f"{at}: name {hname!r} must be a host name such as gpu-01")
            continue
        address = h.get("address")
        if not address or not isinstance(address, str) or any(c.isspace() for c in address):
            problems.append(f"{at}: host {hname} has no address; set address to its IP or DNS name")
            continue
        port = _int(h.get("sshPort", 22), f"{at}: sshPort", problems, minimum=1, maximum=65535)
        gpus = _int(h.get("gpuCount", 0), f"{at}: gpuCount", problems, minimum=0, maximum=64)
        user = h.get("sshUser", DEFAULT_SSH_USER)
        if not isinstance(user, str) or not user:
            problems.append(f"{at}: sshUser must be a login name, got {user!r}")
        model = h.get("gpuModel", "")
        if not isinstance(model, str):
            problems.append(f"{at}: gpuModel must be text such as 'NVIDIA A100-SXM4-80GB', got {model!r}")
        host_labels = _labels(h.get("labels"), f"{at}: labels", problems)
        hosts.append(
            OnPremHost(
                name=hname,
                address=address,
                ssh_user=str(user),
                ssh_port=port or 22,
                gpu_model=str(model),
                gpu_count=gpus or 0,
                labels=MappingProxyType({**labels, **host_labels}),
            )
        )
    return OnPremPool(name=name, hosts=tuple(hosts), labels=labels)


def _check_unique_nodes(pools: list[Pool], problems: list[str]) -> None:
    owner: dict[str, str] = {}
    for pool in pools:
        names = pool.node_names() if isinstance(pool, AwsPool) else [h.name for h in pool.hosts]
        for n in names:
            if n in owner:
                problems.append(f"node name {n!r} is used by pool {owner[n]} and pool {pool.name}; node names must be unique")
            owner.setdefault(n, pool.name)


def _check_zones(pools: list[AwsPool], problems: list[str]) -> None:
    by_index: dict[int, str] = {}
    for pool in pools:
        zone = pool.availability_zone
        if zone is None:
            continue
        i = zone_index(zone)
        if not 0 <= i < 16:
            problems.append(f"{pool.name}: availabilityZone {zone!r} ends past the letter p; trainyard carves 16 zone subnets (a-p)")
        elif by_index.setdefault(i, zone) != zone:
            problems.append(f"zones {by_index[i]} and {zone} would share one subnet range; use zones with distinct letters")


def zone_index(zone: str) -> int:
    """Which subnet of the VPC a zone gets: fixed by its letter, so adding a zone never renumbers others."""
    return ord(zone[-1]) - ord("a")


def _unknown_keys(item: dict, known: Sequence[str], where: str, problems: list[str]) -> None:
    for key in item:
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            hint = f"; did you mean {close[0]}?" if close else f" (known: {', '.join(known)})"
            problems.append(f"{where}: unknown key {key!r}{hint}")


def _int(value: Any, what: str, problems: list[str], *, minimum: int, maximum: int) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not (isinstance(value, int) or (isinstance(value, str) and value.strip().lstrip("-").isdigit())):
        problems.append(f"{what} must be a whole number, got {value!r}")
        return None
    n = int(value)
    if n < minimum:
        problems.append(f"{what} must be {minimum} or more, got {n}")
        return None
    if n > maximum:
        problems.append(f"{what} must be at most {maximum}, got {n}")
        return None
    return n


def _bool(value: Any, what: str, problems: list[str]) -> bool | None:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    problems.append(f"{what} must be true or false, got {value!r}")
    return None


def _labels(value: Any, what: str, problems: list[str]) -> Mapping[str, str]:
    if value is None:
        return _EMPTY
    if not isinstance(value, dict) or not all(isinstance(k, str) and k for k in value):
        problems.append(f"{what} must be a map of key: value, got {value!r}")
        return _EMPTY
    bad = {k: v for k, v in value.items() if isinstance(v, (dict, list)) or v is None}
    if bad:
        problems.append(f"{what}: values must be text, numbers or booleans, got {bad!r}")
        return _EMPTY
    return MappingProxyType({k: (str(v).lower() if isinstance(v, bool) else str(v)) for k, v in value.items()})
