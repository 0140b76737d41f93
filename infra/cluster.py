"""The `GpuCluster` component: network, key pair, node role and one `AwsGpuPool` per AWS pool."""

from __future__ import annotations

import json
from collections.abc import Mapping

import pulumi
import pulumi_aws as aws
from pulumi import ComponentResource, Output, ResourceOptions

from infra import inventory
from infra.config import AwsPool, ClusterConfig, zone_index

# The default image: AWS's Deep Learning Base OSS Nvidia Driver GPU AMI (Ubuntu 24.04), which
# carries the NVIDIA driver, CUDA, the EFA installer and NCCL's AWS plugin. AWS publishes its
# current id under this public SSM parameter (DLAMI developer guide, "Query AMI-ID with SSM").
# The id moves with every release: new nodes get the newest image, existing nodes keep theirs.
# Pin `ami` in a pool's config for reproducible fleets.
DEFAULT_AMI_PARAMETER = "/aws/service/deeplearning/ami/x86_64/base-oss-nvidia-driver-gpu-ubuntu-24.04/latest/ami-id"

TAG_CLUSTER = "trainyard:cluster"
TAG_POOL = "trainyard:pool"
TAG_MANAGED_BY = "managed-by"
MANAGED_BY = "trainyard"


def tags(cluster: str, name: str, pool: str | None = None) -> dict[str, str]:
    out = {"Name": name, TAG_CLUSTER: cluster, TAG_MANAGED_BY: MANAGED_BY}
    if pool is not None:
        out[TAG_POOL] = pool
    return out


class ClusterNetwork(ComponentResource):
    """VPC, one public subnet per zone in use, internet gateway, and the nodes' security group."""

    def __init__(self, name: str, config: ClusterConfig, zones: list[str], opts: ResourceOptions | None = None):
        super().__init__("trainyard:infra:ClusterNetwork", name, None, opts)
        child = ResourceOptions(parent=self)
        cluster = config.name

        self.vpc = aws.ec2.Vpc(
            f"{name}-vpc",
            cidr_block=str(config.vpc_cidr),
            enable_dns_support=True,
            enable_dns_hostnames=True,
            tags=tags(cluster, f"{name}-vpc"),
            opts=child,
        )
        self.internet_gateway = aws.ec2.InternetGateway(
            f"{name}-igw", vpc_id=self.vpc.id, tags=tags(cluster, f"{name}-igw"), opts=child
        )
        self.route_table = aws.ec2.RouteTable(
            f"{name}-public",
            vpc_id=self.vpc.id,
            routes=[{"cidr_block": "0.0.0.0/0", "gateway_id": self.internet_gateway.id}],
            tags=tags(cluster, f"{name}-public"),
            opts=child,
        )
        # One range per zone letter (a -> first /20 of a /16, b -> second ...), so that adding a
        # zone later never renumbers, and so never replaces, an existing subnet.
        ranges = list(config.vpc_cidr.subnets(prefixlen_diff=4))
        self.subnets: dict[str, aws.ec2.Subnet] = {}
        for zone in zones:
            subnet = aws.ec2.Subnet(
                f"{name}-{zone}",
                vpc_id=self.vpc.id,
                cidr_block=str(ranges[zone_index(zone)]),
                availability_zone=zone,
                map_public_ip_on_launch=False,  # addresses are given per launch template, never by default
                tags=tags(cluster, f"{name}-{zone}"),
                opts=child,
            )
            aws.ec2.RouteTableAssociation(
                f"{name}-{zone}", subnet_id=subnet.id, route_table_id=self.route_table.id, opts=child
            )
            self.subnets[zone] = subnet

        self.security_group = aws.ec2.SecurityGroup(
            f"{name}-nodes",
            vpc_id=self.vpc.id,
            description="trainyard nodes: SSH from adminCidrs, all traffic between members (NCCL, EFA)",
            tags=tags(cluster, f"{name}-nodes"),
            opts=child,
        )
        sg = self.security_group.id

        def rule(direction: str, suffix: str, description: str, **target: object) -> None:
            cls = aws.vpc.SecurityGroupIngressRule if direction == "in" else aws.vpc.SecurityGroupEgressRule
            cls(
                f"{name}-{suffix}",
                security_group_id=sg,
                description=description,
                tags=tags(cluster, f"{name}-{suffix}"),
                opts=child,
                **target,
            )

        for cidr in config.admin_cidrs:
            source = {"cidr_ipv4": str(cidr)} if cidr.version == 4 else {"cidr_ipv6": str(cidr)}
            label = str(cidr).replace("/", "_").replace(":", "-")
            rule("in", f"ssh-{label}", f"SSH from admin network {cidr}", ip_protocol="tcp", from_port=22, to_port=22, **source)
        # EFA needs all traffic to and from the group itself; NCCL over TCP needs the same.
        rule("in", "members-in", "all traffic from cluster members (NCCL, EFA)", ip_protocol="-1", referenced_security_group_id=sg)
        rule("out", "members-out", "all traffic to cluster members (NCCL, EFA)", ip_protocol="-1", referenced_security_group_id=sg)
        rule("out", "internet-out", "outbound to the internet: packages, container images, datasets", ip_protocol="-1", cidr_ipv4="0.0.0.0/0")
        self.register_outputs(
            {
                "vpc_id": self.vpc.id,
                "security_group_id": sg,
                "subnet_ids": {zone: s.id for zone, s in self.subnets.items()},
            }
        )


class AwsGpuPool(ComponentResource):
    """One AWS pool: its launch template, a cluster placement group where it belongs, its instances."""

    def __init__(
        self,
        name: str,
        pool: AwsPool,
        *,
        cluster: str,
        subnet_id: Output[str],
        security_group_id: Output[str],
        key_name: Output[str],
        instance_profile_arn: Output[str],
        image: Mapping[str, str],
        opts: ResourceOptions | None = None,
    ):
        super().__init__("trainyard:infra:AwsGpuPool", name, None, opts)
        child = ResourceOptions(parent=self)
        itype = pool.instance_type
        pool_tags = tags(cluster, name, pool.name)

        self.placement_group = None
        if pool.placement_group:
            self.placement_group = aws.ec2.PlacementGroup(
                f"{name}-pg", strategy="cluster", tags=tags(cluster, f"{name}-pg", pool.name), opts=child
            )

        interfaces = max(1, itype.efa_interfaces)
        # EC2 assigns a public address at launch only to instances with one network interface;
        # multi-card nodes (p4d, p5, g6e.48xlarge) get an Elastic IP on their primary interface.
        self.uses_elastic_ips = interfaces > 1
        spot_types = ["spot-instances-request"] if pool.spot else []
        self.launch_template = aws.ec2.LaunchTemplate(
            f"{name}-lt",
            name_prefix=f"{name}-",
            description=f"trainyard {cluster} pool {pool.name}: {itype.gpu_count}x {itype.gpu_model}",
            image_id=image["id"],
            instance_type=itype.name,
            key_name=key_name,
            iam_instance_profile={"arn": instance_profile_arn},
            ebs_optimized="true",
            metadata_options={
                "http_endpoint": "enabled",
                "http_tokens": "required",  # IMDSv2 only
                # 2 hops so that containers on the node reach IMDSv2; the role grants nothing anyway.
                "http_put_response_hop_limit": 2,
            },
            block_device_mappings=[
                {
                    "device_name": image["root_device_name"],
                    "ebs": {
                        "volume_size": pool.disk_gb,
                        "volume_type": "gp3",
                        "encrypted": "true",
                        "delete_on_termination": "true",
                    },
                }
            ],
            network_interfaces=[
                {
                    "network_card_index": card,
                    "device_index": 0 if card == 0 else 1,
                    "interface_type": "efa" if itype.efa else None,
                    "subnet_id": subnet_id,
                    "security_groups": [security_group_id],
                    "associate_public_ip_address": "false" if self.uses_elastic_ips else "true",
                    "delete_on_termination": "true",
                }
                for card in range(interfaces)
            ],
            instance_market_options=(
                {
                    "market_type": "spot",
                    "spot_options": {
                        "spot_instance_type": "one-time",
                        "instance_interruption_behavior": "terminate",
                        "max_price": pool.max_price,
                    },
                }
                if pool.spot
                else None
            ),
            placement={"group_name": self.placement_group.name} if self.placement_group else None,
            # What EC2 creates on launch (the instance, its volume and interfaces) is tagged too.
            tag_specifications=[
                {"resource_type": kind, "tags": pool_tags}
                for kind in ["instance", "volume", "network-interface", *spot_types]
            ],
            update_default_version=True,
            tags=tags(cluster, f"{name}-lt", pool.name),
            opts=child,
        )

        self.instances: list[aws.ec2.Instance] = []
        addresses: list[Output[str]] = []
        for index in range(pool.count):
            node = pool.node_name(index)
            instance = aws.ec2.Instance(
                f"{cluster}-{node}",
                launch_template={"id": self.launch_template.id, "version": self.launch_template.latest_version.apply(str)},
                tags=tags(cluster, node, pool.name),
                # A new template version (a new default image, a bigger disk) applies to nodes
                # launched afterwards; existing nodes are replaced only on purpose (drain, then
                # `pulumi up --replace URN`), never as a side effect of an update.
                opts=ResourceOptions(parent=self, ignore_changes=["launchTemplate"]),
            )
            self.instances.append(instance)
            if self.uses_elastic_ips:
                eip = aws.ec2.Eip(
                    f"{cluster}-{node}",
                    domain="vpc",
                    network_interface=instance.primary_network_interface_id,
                    tags=tags(cluster, node, pool.name),
                    opts=child,
                )
                addresses.append(eip.public_ip)
            else:
                addresses.append(instance.public_ip)

        self.nodes: Output[list[dict]] = Output.all(*addresses).apply(
            lambda addrs: [inventory.aws_node(pool, i, a) for i, a in enumerate(addrs)]
        )
        self.register_outputs({"nodes": self.nodes, "launch_template_id": self.launch_template.id})


class GpuCluster(ComponentResource):
    """A trainyard cluster: AWS GPU pools built here, on-prem pools declared, one inventory for both."""

    def __init__(self, config: ClusterConfig, opts: ResourceOptions | None = None):
        name = config.name
        super().__init__("trainyard:infra:GpuCluster", name, None, opts)
        child = ResourceOptions(parent=self)
        self.config = config
        self.pools: dict[str, AwsGpuPool] = {}
        self.network: ClusterNetwork | None = None

        if config.aws_pools:
            default_zone = _default_zone() if any(p.availability_zone is None for p in config.aws_pools) else None
            zone_of = {p.name: p.availability_zone or default_zone for p in config.aws_pools}
            zones = sorted(set(zone_of.values()))
            self.network = ClusterNetwork(name, config, zones, opts=child)
            self.key_pair = aws.ec2.KeyPair(
                f"{name}-key",
                key_name_prefix=f"{name}-",
                public_key=config.ssh_public_key,
                tags=tags(name, f"{name}-key"),
                opts=child,
            )
            # Least privilege: the nodes need nothing from AWS to run trainyard, so the role
            # only lets EC2 assume it. Attach policies for your data (e.g. read one bucket) to it.
            self.node_role = aws.iam.Role(
                f"{name}-node",
                assume_role_policy=json.dumps(
                    {
                        "Version": "2012-10-17",
                        "Statement": [
                            {"Effect": "Allow", "Principal": {"Service": "ec2.amazonaws.com"}, "Action": "sts:AssumeRole"}
                        ],
                    }
                ),
                description=f"trainyard {name} GPU nodes (no permissions granted by default)",
                tags=tags(name, f"{name}-node"),
                opts=child,
            )
            self.instance_profile = aws.iam.InstanceProfile(
                f"{name}-node", role=self.node_role.name, tags=tags(name, f"{name}-node"), opts=child
            )
            images: dict[str | None, dict[str, str]] = {}
            for pool in config.aws_pools:
                if pool.ami not in images:
                    images[pool.ami] = _image(pool.ami)
                self.pools[pool.name] = AwsGpuPool(
                    f"{name}-{pool.name}",
                    pool,
                    cluster=name,
                    subnet_id=self.network.subnets[zone_of[pool.name]].id,
                    security_group_id=self.network.security_group.id,
                    key_name=self.key_pair.key_name,
                    instance_profile_arn=self.instance_profile.arn,
                    image=images[pool.ami],
                    opts=child,
                )

        # Nothing is created for on-prem pools: their hosts exist; they only join the inventory.
        parts = [
            self.pools[p.name].nodes if p.kind == "aws" else Output.from_input(inventory.onprem_nodes(p))
            for p in config.pools
        ]
        self.inventory: Output[list[dict]] = Output.all(*parts).apply(
            lambda lists: [node for nodes in lists for node in nodes]
        )
        self.register_outputs({"inventory": self.inventory})


def _default_zone() -> str:
    zones = aws.get_availability_zones(
        state="available", filters=[{"name": "opt-in-status", "values": ["opt-in-not-required"]}]
    )
    if not zones.names:
        raise pulumi.RunError("the region reports no available zone; set availabilityZone on each AWS pool")
    return sorted(zones.names)[0]


def _image(ami: str | None) -> dict[str, str]:
    """The image id and its root device (where the encrypted root volume must be declared)."""
    image_id = ami or aws.ssm.get_parameter(name=DEFAULT_AMI_PARAMETER).value
    found = aws.ec2.get_ami(filters=[{"name": "image-id", "values": [image_id]}])
    return {"id": image_id, "root_device_name": found.root_device_name or "/dev/sda1"}
