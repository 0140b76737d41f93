"""The GpuCluster under Pulumi's mocks: the resource graph per config, and security invariants over all of it."""

from __future__ import annotations

import importlib
import inspect
import ipaddress
import json
from collections import Counter
from functools import cache

import pulumi_aws
import pytest
from infra_helpers import DEFAULT_AMI, Built, aws_pool, build_cluster, onprem_pool, stack_config

from infra.cluster import DEFAULT_AMI_PARAMETER, MANAGED_BY, TAG_CLUSTER, TAG_MANAGED_BY, TAG_POOL

INSTANCE = "aws:ec2/instance:Instance"
TEMPLATE = "aws:ec2/launchTemplate:LaunchTemplate"
PLACEMENT = "aws:ec2/placementGroup:PlacementGroup"
EIP = "aws:ec2/eip:Eip"
SUBNET = "aws:ec2/subnet:Subnet"
INGRESS = "aws:vpc/securityGroupIngressRule:SecurityGroupIngressRule"

CONFIGS = {
    "hybrid": stack_config(
        aws_pool("h100", "p5.48xlarge", 2, availabilityZone="us-east-1b"),
        aws_pool("l4", "g6.xlarge", 3, spot=True, maxPrice=0.5),
        onprem_pool("lab", 2),
    ),
    "a100-on-demand": stack_config(aws_pool("a100", "p4d.24xlarge", 4)),
    "mixed-g": stack_config(
        aws_pool("a10g", "g5.48xlarge", 2, spot=True),
        aws_pool("l40s", "g6e.48xlarge", 1, ami="ami-0123456789abcdef0", diskGb=1000),
        aws_pool("t4", "g4dn.xlarge", 0),
        adminCidrs=["198.51.100.7/32", "2001:db8::/48"],
    ),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def built(request) -> tuple[dict, Built]:
    raw = CONFIGS[request.param]
    return raw, build_cluster(raw, stack="prod")


def by_pool(built: Built, typ: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for r in built.of_type(typ):
        out.setdefault(r.state["tags"][TAG_POOL], []).append(r)
    return out


def template(built: Built, pool: str) -> dict:
    return by_pool(built, TEMPLATE)[pool][0].state


# -- the resource graph ------------------------------------------------------------------------


def test_each_aws_pool_gets_a_template_and_count_instances_of_its_type(built):
    raw, b = built
    aws = [p for p in raw["pools"] if p["kind"] == "aws"]
    instances = by_pool(b, INSTANCE)
    for p in aws:
        assert template(b, p["name"])["instanceType"] == p["instanceType"]
        assert len(instances.get(p["name"], [])) == p["count"]
    assert len(b.of_type(TEMPLATE)) == len(aws)
    assert all(i.state["launchTemplate"]["id"] for i in b.of_type(INSTANCE))


def test_instances_are_named_cluster_pool_index():
    b = build_cluster(CONFIGS["hybrid"], stack="prod")
    names = sorted(r.name for r in b.of_type(INSTANCE))
    assert names == ["prod-h100-0", "prod-h100-1", "prod-l4-0", "prod-l4-1", "prod-l4-2"]
    assert b.named("prod-l4-2").state["tags"]["Name"] == "l4-2"


def test_spot_pools_ask_for_spot_with_their_max_price_and_others_do_not():
    b = build_cluster(CONFIGS["hybrid"])
    spot = template(b, "l4")["instanceMarketOptions"]
    assert spot == {
        "marketType": "spot",
        "spotOptions": {"spotInstanceType": "one-time", "instanceInterruptionBehavior": "terminate", "maxPrice": "0.5"},
    }
    assert "instanceMarketOptions" not in template(b, "h100")
    spot_no_cap = template(build_cluster(CONFIGS["mixed-g"]), "a10g")["instanceMarketOptions"]
    assert spot_no_cap["marketType"] == "spot" and "maxPrice" not in spot_no_cap["spotOptions"]


def test_a_cluster_placement_group_only_for_multi_node_pools(built):
    raw, b = built
    groups = by_pool(b, PLACEMENT)
    expected = {"p5.48xlarge", "p4d.24xlarge", "g5.48xlarge", "g6e.48xlarge"}
    for p in (p for p in raw["pools"] if p["kind"] == "aws"):
        lt = template(b, p["name"])
        if p["instanceType"] in expected:
            (group,) = groups[p["name"]]
            assert group.state["strategy"] == "cluster"
            assert lt["placement"]["groupName"] == group.state["name"]
        else:
            assert p["name"] not in groups and "placement" not in lt


def test_placement_group_can_be_switched_off_or_on_per_pool():
    b = build_cluster(stack_config(aws_pool("a", "p5.48xlarge", 1, placementGroup=False), aws_pool("b", "g6.12xlarge", 1, placementGroup=True)))
    assert list(by_pool(b, PLACEMENT)) == ["b"]


@pytest.mark.parametrize(
    ("instance_type", "cards"),
    [("p5.48xlarge", 32), ("p5e.48xlarge", 32), ("p4d.24xlarge", 4), ("p4de.24xlarge", 4), ("g6e.48xlarge", 4),
     ("g6e.24xlarge", 2), ("g5.48xlarge", 1), ("g6.8xlarge", 1), ("g4dn.metal", 1)],
)
def test_efa_interfaces_one_per_network_card_where_supported(instance_type, cards):
    b = build_cluster(stack_config(aws_pool("gpu", instance_type, 1)))
    interfaces = template(b, "gpu")["networkInterfaces"]
    assert [i["interfaceType"] for i in interfaces] == ["efa"] * cards
    assert [i["networkCardIndex"] for i in interfaces] == list(range(cards))
    assert [i["deviceIndex"] for i in interfaces] == [0] + [1] * (cards - 1)
    # every interface sits in the cluster's subnet and security group (the mocks' id is NAME-id)
    assert all(i["securityGroups"] == ["test-nodes-id"] and i["subnetId"] == "test-us-east-1a-id" for i in interfaces)


@pytest.mark.parametrize("instance_type", ["g6.xlarge", "g5.4xlarge", "g4dn.2xlarge", "g6e.2xlarge"])
def test_no_efa_where_the_type_does_not_support_it(instance_type):
    b = build_cluster(stack_config(aws_pool("gpu", instance_type, 1)))
    (interface,) = template(b, "gpu")["networkInterfaces"]
    assert "interfaceType" not in interface


def test_multi_card_nodes_get_elastic_ips_and_single_card_nodes_a_public_address():
    b = build_cluster(CONFIGS["hybrid"])
    assert {i["associatePublicIpAddress"] for i in template(b, "h100")["networkInterfaces"]} == {"false"}
    assert template(b, "l4")["networkInterfaces"][0]["associatePublicIpAddress"] == "true"
    eips = b.of_type(EIP)
    assert sorted(e.name for e in eips) == ["test-h100-0", "test-h100-1"]
    assert all(e.state["domain"] == "vpc" and e.state["networkInterface"].startswith("eni-") for e in eips)


def test_a_pool_of_zero_keeps_its_template_and_has_no_instances():
    b = build_cluster(CONFIGS["mixed-g"])
    assert "t4" in by_pool(b, TEMPLATE) and "t4" not in by_pool(b, INSTANCE)


def test_onprem_pools_create_nothing():
    b = build_cluster({"pools": [onprem_pool("lab", 3)]})
    assert [r.type for r in b.resources] == ["trainyard:infra:GpuCluster"]
    assert [n["name"] for n in b.inventory] == ["lab-gpu-01", "lab-gpu-02", "lab-gpu-03"]


def test_network_has_a_subnet_per_zone_carved_by_zone_letter():
    b = build_cluster(CONFIGS["hybrid"])
    subnets = {s.state["availabilityZone"]: s.state["cidrBlock"] for s in b.of_type(SUBNET)}
    # h100 asked for us-east-1b; l4 takes the region's first zone from the lookup.
    assert subnets == {"us-east-1a": "10.42.0.0/20", "us-east-1b": "10.42.16.0/20"}
    assert all(s.state["mapPublicIpOnLaunch"] is False for s in b.of_type(SUBNET))
    assert Counter(r.type for r in b.resources)["aws:ec2/routeTableAssociation:RouteTableAssociation"] == 2
    (route_table,) = b.of_type("aws:ec2/routeTable:RouteTable")
    assert route_table.state["routes"][0]["cidrBlock"] == "0.0.0.0/0"


def test_default_image_comes_from_the_dlami_parameter_and_pinned_images_are_used_as_given():
    b = build_cluster(CONFIGS["mixed-g"])
    assert template(b, "a10g")["imageId"] == DEFAULT_AMI
    assert template(b, "l40s")["imageId"] == "ami-0123456789abcdef0"
    tokens = [t for t, _ in b.mocks.calls]
    assert tokens.count("aws:ssm/getParameter:getParameter") == 1
    assert ("aws:ssm/getParameter:getParameter", {"name": DEFAULT_AMI_PARAMETER}) in b.mocks.calls
    assert template(b, "l40s")["blockDeviceMappings"][0]["ebs"]["volumeSize"] == 1000


# -- security invariants, over every created resource -------------------------------------------


@cache
def accepts_tags(typ: str) -> bool:
    """Whether pulumi-aws lets this resource type carry tags (from the class's own signature)."""
    if not typ.startswith("aws:"):
        return False
    module, name = typ.split(":")[1].split("/")[0], typ.split(":")[2]
    cls = getattr(importlib.import_module(f"pulumi_aws.{module}" if module != "index" else "pulumi_aws"), name)
    return "tags" in inspect.signature(cls._internal_init).parameters


def covers_ssh(rule: dict) -> bool:
    proto = str(rule.get("ipProtocol", rule.get("protocol", "")))
    if proto in ("-1", "all"):
        return True
    return proto in ("tcp", "6") and rule.get("fromPort", 0) <= 22 <= rule.get("toPort", 65535)


def ingress_rules(b: Built) -> list[dict]:
    rules = [r.state for r in b.of_type(INGRESS)]
    rules += [r.state for r in b.of_type("aws:ec2/securityGroupRule:SecurityGroupRule") if r.state.get("type") == "ingress"]
    for sg in b.of_type("aws:ec2/securityGroup:SecurityGroup"):
        for inline in sg.state.get("ingress") or []:
            for cidr in inline.get("cidrBlocks", []) + inline.get("ipv6CidrBlocks", []):
                rules.append({**inline, "cidrIpv4": cidr})
    return rules


def test_ssh_is_never_open_to_the_world_and_only_to_admin_cidrs(built):
    raw, b = built
    admins = {str(ipaddress.ip_network(c)) for c in raw["adminCidrs"]}
    ssh_sources = []
    for rule in ingress_rules(b):
        source = rule.get("cidrIpv4") or rule.get("cidrIpv6")
        assert source not in ("0.0.0.0/0", "::/0") or not covers_ssh(rule), rule
        if source and covers_ssh(rule):
            ssh_sources.append(source)
        if not source:
            # The only other ingress: all traffic from the cluster's own security group (NCCL, EFA).
            assert rule["referencedSecurityGroupId"] == rule["securityGroupId"]
    assert set(ssh_sources) == admins


def test_root_volumes_are_encrypted(built):
    _, b = built
    for lt in b.of_type(TEMPLATE):
        (root,) = lt.state["blockDeviceMappings"]
        assert root["deviceName"] == "/dev/sda1"  # the image's root device, from the AMI lookup
        assert root["ebs"]["encrypted"] == "true" and root["ebs"]["volumeType"] == "gp3"
    for instance in b.of_type(INSTANCE):
        assert "launchTemplate" in instance.state  # no instance bypasses the template's volume settings
        assert instance.state.get("rootBlockDevice", {}).get("encrypted", True) is True
    assert not b.of_type("aws:ebs/volume:Volume")


def test_imdsv2_is_required(built):
    _, b = built
    for lt in b.of_type(TEMPLATE):
        assert lt.state["metadataOptions"]["httpTokens"] == "required"
        assert lt.state["metadataOptions"]["httpEndpoint"] == "enabled"
    for instance in b.of_type(INSTANCE):
        assert instance.state.get("metadataOptions", {}).get("httpTokens", "required") == "required"


def test_every_taggable_resource_is_tagged_with_cluster_pool_and_managed_by(built):
    _, b = built
    taggable = [r for r in b.resources if accepts_tags(r.type)]
    assert len(taggable) > 10
    for r in taggable:
        tags = r.state.get("tags") or {}
        assert tags.get(TAG_CLUSTER) == "prod" and tags.get(TAG_MANAGED_BY) == MANAGED_BY, (r.type, r.name)
        if r.parent_type == "trainyard:infra:AwsGpuPool":
            assert tags.get(TAG_POOL), (r.type, r.name)
    # What EC2 creates at launch (instance, root volume, interfaces) is tagged by the template.
    for lt in b.of_type(TEMPLATE):
        specs = {s["resourceType"]: s["tags"] for s in lt.state["tagSpecifications"]}
        assert {"instance", "volume", "network-interface"} <= set(specs)
        assert all(t[TAG_POOL] == lt.state["tags"][TAG_POOL] and t[TAG_CLUSTER] == "prod" for t in specs.values())


def test_every_resource_is_a_child_of_the_cluster(built):
    _, b = built
    (root,) = [r for r in b.resources if r.parent_type == "pulumi:pulumi:Stack"]
    assert root.type == "trainyard:infra:GpuCluster"
    parents = {"trainyard:infra:GpuCluster", "trainyard:infra:ClusterNetwork", "trainyard:infra:AwsGpuPool"}
    assert all(r.parent_type in parents for r in b.resources if r is not root)


def test_node_role_can_only_be_assumed_by_ec2_and_grants_nothing(built):
    _, b = built
    (role,) = b.of_type("aws:iam/role:Role")
    policy = json.loads(role.state["assumeRolePolicy"])
    assert policy["Statement"] == [
        {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}
    ]
    assert not role.state.get("managedPolicyArns") and not role.state.get("inlinePolicies")
    granting = [r for r in b.resources if r.type.startswith("aws:iam/") and "olicy" in r.type]
    assert granting == []
    (profile,) = b.of_type("aws:iam/instanceProfile:InstanceProfile")
    assert profile.state["role"] == role.state["name"]


def test_nodes_log_in_with_the_stack_key_pair(built):
    raw, b = built
    (key,) = b.of_type("aws:ec2/keyPair:KeyPair")
    assert key.state["publicKey"] == raw["sshPublicKey"]
    assert {lt.state["keyName"] for lt in b.of_type(TEMPLATE)} == {key.state["keyName"]}


def test_the_tag_probe_knows_taggable_from_untaggable_types():
    assert accepts_tags("aws:ec2/vpc:Vpc") and accepts_tags(INSTANCE)
    assert not accepts_tags("aws:ec2/routeTableAssociation:RouteTableAssociation")
    assert pulumi_aws  # the probe imports pulumi_aws modules by the type token
