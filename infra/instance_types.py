"""The GPU instance types trainyard provisions: GPUs per node, network cards, EFA support."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class InstanceType:
    name: str
    gpu_model: str  # as NVML reports it, so inventory and agent agree (`--gpu-type a100` matches)
    gpu_count: int
    efa: bool = False
    network_cards: int = 1  # one EFA interface per card where EFA is supported

    @property
    def family(self) -> str:
        return self.name.split(".", 1)[0]

    @property
    def efa_interfaces(self) -> int:
        return self.network_cards if self.efa else 0

    @property
    def built_for_multi_node(self) -> bool:
        """8-GPU nodes with EFA: the types AWS builds for multi-node training (cluster placement)."""
        return self.efa and self.gpu_count >= 8


# Source: the EC2 User Guide's accelerated-computing specifications and its EFA pages
# ("Supported instance types", "Maximize network bandwidth ... with multiple network cards").
# Check a type with:
#   aws ec2 describe-instance-types --instance-types p5.48xlarge \
#     --query 'InstanceTypes[].NetworkInfo.{cards:MaximumNetworkCards,efa:EfaSupported}'
def _family(
    family: str,
    gpu_model: str,
    sizes: dict[str, int],
    efa_sizes: frozenset[str] = frozenset(),
    cards: dict[str, int] | None = None,
) -> dict[str, InstanceType]:
    cards = cards or {}
    return {
        f"{family}.{size}": InstanceType(
            name=f"{family}.{size}",
            gpu_model=gpu_model,
            gpu_count=gpus,
            efa=size in efa_sizes,
            network_cards=cards.get(size, 1),
        )
        for size, gpus in sizes.items()
    }


_G_SIZES = {
    "xlarge": 1, "2xlarge": 1, "4xlarge": 1, "8xlarge": 1, "16xlarge": 1,
    "12xlarge": 4, "24xlarge": 4, "48xlarge": 8,
}
_G_EFA = frozenset({"8xlarge", "12xlarge", "16xlarge", "24xlarge", "48xlarge"})

CATALOGUE: dict[str, InstanceType] = {
    **_family(
        "g4dn",
        "Tesla T4",
        {"xlarge": 1, "2xlarge": 1, "4xlarge": 1, "8xlarge": 1, "16xlarge": 1, "12xlarge": 4, "metal": 8},
        frozenset({"8xlarge", "12xlarge", "16xlarge", "metal"}),
    ),
    **_family("g5", "NVIDIA A10G", _G_SIZES, _G_EFA),
    **_family("g6", "NVIDIA L4", _G_SIZES, _G_EFA),
    **_family("g6e", "NVIDIA L40S", _G_SIZES, _G_EFA, cards={"24xlarge": 2, "48xlarge": 4}),
    **_family("p4d", "NVIDIA A100-SXM4-40GB", {"24xlarge": 8}, frozenset({"24xlarge"}), {"24xlarge": 4}),
    **_family("p4de", "NVIDIA A100-SXM4-80GB", {"24xlarge": 8}, frozenset({"24xlarge"}), {"24xlarge": 4}),
    **_family("p5", "NVIDIA H100 80GB HBM3", {"48xlarge": 8}, frozenset({"48xlarge"}), {"48xlarge": 32}),
    **_family("p5e", "NVIDIA H200", {"48xlarge": 8}, frozenset({"48xlarge"}), {"48xlarge": 32}),
}


def lookup(name: str) -> InstanceType | None:
    return CATALOGUE.get(name)
