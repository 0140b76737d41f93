"""The stack config: what a valid config becomes, and the message for every mistake."""

from __future__ import annotations

import json

import pytest
from infra_helpers import SSH_KEY, aws_pool, onprem_pool, stack_config

from infra.config import (
    DEFAULT_DISK_GB,
    AwsPool,
    ConfigError,
    OnPremPool,
    parse_config,
    raw_from_strings,
)


def parse(raw: dict):
    return parse_config(raw, default_name="dev")


def problems_of(raw: dict) -> list[str]:
    with pytest.raises(ConfigError) as info:
        parse(raw)
    return info.value.problems


def test_a_hybrid_config_becomes_typed_pools(hybrid_config):
    config = parse(hybrid_config)

    assert config.name == "dev"
    assert [str(c) for c in config.admin_cidrs] == ["203.0.113.0/24"]
    h100, l4, lab = config.pools
    assert isinstance(h100, AwsPool) and h100.instance_type.gpu_count == 8 and h100.count == 2
    assert h100.availability_zone == "us-east-1b" and h100.ami is None and h100.disk_gb == DEFAULT_DISK_GB
    assert l4.spot is True and l4.max_price == "0.5"
    assert isinstance(lab, OnPremPool) and [h.name for h in lab.hosts] == ["lab-gpu-01", "lab-gpu-02"]
    assert lab.hosts[0].ssh_user == "ops" and lab.hosts[0].ssh_port == 22 and lab.hosts[0].gpu_count == 8


def test_structured_keys_arrive_as_json_text_from_pulumi(hybrid_config):
    as_text = {k: (v if isinstance(v, str) else json.dumps(v)) for k, v in hybrid_config.items()}
    assert parse(raw_from_strings(as_text)) == parse(hybrid_config)


def test_placement_group_defaults_to_multi_node_types_and_can_be_overridden():
    config = parse(
        stack_config(
            aws_pool("a", "p4d.24xlarge"),
            aws_pool("b", "g5.48xlarge"),
            aws_pool("c", "g5.12xlarge"),
            aws_pool("d", "g6.xlarge"),
            aws_pool("e", "p5.48xlarge", placementGroup=False),
            aws_pool("f", "g5.12xlarge", placementGroup=True),
        )
    )
    assert {p.name: p.placement_group for p in config.pools} == {
        "a": True, "b": True, "c": False, "d": False, "e": False, "f": True,
    }


def test_only_onprem_pools_need_neither_admin_cidrs_nor_a_key():
    config = parse({"pools": [onprem_pool()]})
    assert config.aws_pools == () and config.ssh_public_key is None


def test_pool_labels_reach_every_host_and_host_labels_win():
    pool = onprem_pool(labels={"site": "lab", "rack": "r1"})
    pool["hosts"][1]["labels"] = {"rack": "r2", "ib": True}
    (lab,) = parse({"pools": [pool]}).pools
    assert dict(lab.hosts[0].labels) == {"site": "lab", "rack": "r1"}
    assert dict(lab.hosts[1].labels) == {"site": "lab", "rack": "r2", "ib": "true"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda c: c["pools"][0].update(instanceType="p4.24xlarge"),
         "pools[0] (a100): unknown instance type 'p4.24xlarge' (known GPU families: g4dn, g5, g6, g6e, p4d, p4de, p5, p5e); did you mean p4d.24xlarge"),
        (lambda c: c["pools"][0].update(instanceType="m5.large"), "unknown instance type 'm5.large'"),
        (lambda c: c["pools"][0].pop("instanceType"), "pools[0] (a100): instanceType is missing"),
        (lambda c: c["pools"][0].update(count=-1), "pools[0] (a100): count must be 0 or more, got -1"),
        (lambda c: c["pools"][0].update(count="three"), "pools[0] (a100): count must be a whole number, got 'three'"),
        (lambda c: c["pools"][0].update(count=True), "count must be a whole number, got True"),
        (lambda c: c["pools"][0].pop("count"), "pools[0] (a100): count is missing"),
        (lambda c: c["pools"][0].pop("name"), "pools[0]: a pool needs a name"),
        (lambda c: c["pools"][0].update(name=""), "pools[0]: a pool needs a name"),
        (lambda c: c["pools"][0].update(name="A100_pool"), "pool name 'A100_pool' must be lowercase letters, digits and dashes"),
        (lambda c: c["pools"].append(aws_pool("a100")), "pools[1] (a100): another pool is already named 'a100'"),
        (lambda c: c["pools"][0].update(kind="gcp"), "pools[0] (a100): kind must be 'aws' or 'onprem', got 'gcp'"),
        (lambda c: c["pools"][0].update(instancetype="x"), "pools[0] (a100): unknown key 'instancetype'; did you mean instanceType?"),
        (lambda c: c["pools"][0].update(spot="yes"), "pools[0] (a100): spot must be true or false, got 'yes'"),
        (lambda c: c["pools"][0].update(maxPrice=3), "maxPrice applies to spot capacity only"),
        (lambda c: c["pools"][0].update(spot=True, maxPrice="cheap"), "maxPrice 'cheap' must be a positive price"),
        (lambda c: c["pools"][0].update(ami="ubuntu-24.04"), "ami 'ubuntu-24.04' is not an AMI id"),
        (lambda c: c["pools"][0].update(diskGb=2), "pools[0] (a100): diskGb must be 8 or more, got 2"),
        (lambda c: c["pools"][0].update(availabilityZone="east"), "availabilityZone 'east' is not a zone name"),
        (lambda c: c["pools"][0].update(labels=["gpu"]), "pools[0] (a100): labels must be a map"),
        (lambda c: c["pools"].append(aws_pool("b", "g5.xlarge", 1, availabilityZone="us-east-1a"))
         or c["pools"].append(aws_pool("c", "g5.xlarge", 1, availabilityZone="us-west-2a")),
         "zones us-east-1a and us-west-2a would share one subnet range"),
        (lambda c: c["pools"].append({"name": "rack", "kind": "onprem", "hosts": [{"name": "a100-1", "address": "10.0.0.9"}]}),
         "node name 'a100-1' is used by pool a100 and pool rack"),
        (lambda c: c.update(pools={"a100": {}}), "pools must be a list of pool objects"),
        (lambda c: c.update(adminCidrs=["10.0.0.300/32"]),
         "adminCidrs[0] '10.0.0.300/32' is not a CIDR (expected e.g. 203.0.113.0/24)"),
        (lambda c: c.update(adminCidrs=["office"]), "adminCidrs[0] 'office' is not a CIDR"),
        (lambda c: c.update(adminCidrs=["10.0.0.1/24"]), "adminCidrs[0] '10.0.0.1/24' is not a CIDR (expected e.g. 203.0.113.0/24); did you mean 10.0.0.0/24?"),
        (lambda c: c.update(adminCidrs=["0.0.0.0/0"]), "adminCidrs[0] '0.0.0.0/0' would open SSH to the whole internet"),
        (lambda c: c.update(adminCidrs=["::/0"]), "adminCidrs[0] '::/0' would open SSH to the whole internet"),
        (lambda c: c.update(adminCidrs=[]), "adminCidrs is empty: SSH to the AWS nodes would be closed to everyone"),
        (lambda c: c.update(adminCidrs="203.0.113.0/24"), "adminCidrs must be a list of CIDRs"),
        (lambda c: c.pop("sshPublicKey"), "sshPublicKey is missing"),
        (lambda c: c.update(sshPublicKey="-----BEGIN OPENSSH PRIVATE KEY-----\nb3Bl"), "sshPublicKey holds a private key"),
        (lambda c: c.update(sshPublicKey="ecdsa-sha2-nistp256 AAAAE2 me@x"), "is not an OpenSSH public key of a type EC2 accepts"),
        (lambda c: c.update(clusterName="Prod EU"), "clusterName 'Prod EU' must be lowercase letters"),
        (lambda c: c.update(vpcCidr="10.0.0.0/8"), "vpcCidr '10.0.0.0/8' must be between a /16 and a /24"),
        (lambda c: c.update(vpcCidr="10.0.0.0/33"), "vpcCidr '10.0.0.0/33' is not an IPv4 CIDR"),
    ],
)
def test_every_config_mistake_is_reported_with_its_fix(change, message):
    raw = stack_config(aws_pool())
    change(raw)
    found = problems_of(raw)
    assert any(message in p for p in found), found


@pytest.mark.parametrize(
    ("host_change", "message"),
    [
        (lambda h: h.pop("address"), "pools[0] (lab) host lab-gpu-01: host lab-gpu-01 has no address"),
        (lambda h: h.update(address=""), "host lab-gpu-01 has no address"),
        (lambda h: h.pop("name"), "pools[0] (lab) hosts[0]: name None must be a host name"),
        (lambda h: h.update(sshPort=70000), "sshPort must be at most 65535, got 70000"),
        (lambda h: h.update(gpuCount=-2), "gpuCount must be 0 or more, got -2"),
        (lambda h: h.update(gpuModel=8), "gpuModel must be text"),
        (lambda h: h.update(port=22), "unknown key 'port'"),
    ],
)
def test_every_onprem_host_mistake_is_reported(host_change, message):
    raw = {"pools": [onprem_pool("lab", 1)]}
    host_change(raw["pools"][0]["hosts"][0])
    found = problems_of(raw)
    assert any(message in p for p in found), found


def test_an_onprem_pool_without_hosts_is_an_error():
    assert any("an on-prem pool declares its machines in hosts" in p for p in problems_of({"pools": [{"name": "lab", "kind": "onprem"}]}))


def test_all_problems_are_reported_at_once_in_one_message():
    raw = stack_config(aws_pool(count=-1), {"kind": "aws"}, adminCidrs=["nope"], sshPublicKey="")
    with pytest.raises(ConfigError) as info:
        parse(raw)
    text = str(info.value)
    assert text.startswith("invalid stack config (trainyard:*):")
    for needle in ("count must be 0 or more", "a pool needs a name", "'nope' is not a CIDR", "sshPublicKey is missing"):
        assert needle in text


def test_node_names_are_pool_and_index():
    (pool,) = parse(stack_config(aws_pool("h100", "p5.48xlarge", 3))).pools
    assert pool.node_names() == ["h100-0", "h100-1", "h100-2"]


def test_a_valid_key_and_cidr_list_pass_through():
    config = parse(stack_config(aws_pool(), adminCidrs=["198.51.100.7/32", "2001:db8::/48"]))
    assert config.ssh_public_key == SSH_KEY
    assert [c.version for c in config.admin_cidrs] == [4, 6]
