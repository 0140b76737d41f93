"""A plain in-memory ClusterReadModel, and GPU telemetry with a distinct value per (node, GPU)."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler.metrics import NodeInfo


@dataclass
class InMemoryCluster:
    """ClusterReadModel over dicts a test fills in; every read returns the current contents."""

    queue_names: list[str] = field(default_factory=lambda: ["default"])
    counts: list[tuple[str, str, int]] = field(default_factory=list)
    node_list: list[NodeInfo] = field(default_factory=list)
    usage: dict[str, int] = field(default_factory=dict)
    samples: dict[str, dict] = field(default_factory=dict)
    allocation: dict[tuple[str, int], object] = field(default_factory=dict)
    team_usage: dict[str, float] = field(default_factory=dict)

    def job_counts(self):
        return list(self.counts)

    def queues(self):
        return list(self.queue_names)

    def nodes(self):
        return list(self.node_list)

    def gpu_usage(self):
        return dict(self.usage)

    def telemetry(self):
        return dict(self.samples)

    def node(self, name):
        return next((n for n in self.node_list if n.name == name), None)

    def gpu_jobs(self):
        return dict(self.allocation)

    def gpu_jobs_on(self, name):
        return {gpu: job for (node, gpu), job in self.allocation.items() if node == name}

    def team_gpu_seconds(self):
        return dict(self.team_usage)


def gpu(node_no: int, index: int, **over) -> dict:
    """One GPU's telemetry as the agent sends it (docs/gpu.md), every value tied to where it is:
    temperature 40 + 10*node + index, so a series that lands on the wrong node or GPU shows."""
    base = 10 * node_no + index
    g = {
        "index": index, "name": "NVIDIA H100 80GB HBM3", "uuid": f"GPU-{node_no:02d}{index:02d}-fake",
        "pci_bus_id": f"00000000:{0x18 + index:02X}:00.0",
        "util_gpu": base, "util_mem": base // 2, "util_enc": 0, "util_dec": 1,
        "mem_total_mb": 81559, "mem_used_mb": 1000 + base, "mem_reserved_mb": 500,
        "temp_c": 40 + base, "mem_temp_c": 50 + base, "power_w": 100.5 + base,
        "power_limit_w": 650.0, "power_mgmt_limit_w": 700.0, "sm_clock_mhz": 1000 + base,
        "mem_clock_mhz": 2619, "energy_mj": 1_000_000 + base, "pcie_replay": 0,
        "pcie_tx_bytes_s": 1e6, "pcie_rx_bytes_s": 2e6,
        "prof_gr_engine_active": base / 100, "prof_pipe_tensor_active": base / 200,
        "prof_dram_active": 0.25,
        "ecc_sbe_volatile": 0, "ecc_dbe_volatile": 0, "ecc_sbe_aggregate": 3, "ecc_dbe_aggregate": 0,
        "ecc_dbe": 0, "remap_correctable": 0, "remap_uncorrectable": 0, "remap_pending": False,
        "remap_failure": False, "xid": None, "xid_events": [], "off_bus": False, "mig_mode": False,
        "mig_instances": [], "processes": [], "job_id": None,
    }
    g.update(over)
    return g


def two_node_cluster(gpus: int = 4) -> InMemoryCluster:
    """node-1 and node-2 with `gpus` GPUs each; job 7 holds GPUs 1 and 2 of node-2."""
    c = InMemoryCluster(queue_names=["default", "batch"])
    for k in (1, 2):
        name = f"node-{k}"
        c.node_list.append(NodeInfo(name, "UP", gpus, hostname=f"host-{k}", driver_version="550.54.15"))
        c.samples[name] = {"time": 100.0, "source": "nvml", "gpus": [gpu(k, i) for i in range(gpus)]}
    c.allocation = {("node-2", 1): 7, ("node-2", 2): 7}
    c.usage = {"node-2": 2}
    c.counts = [("RUNNING", "default", 1), ("PENDING", "batch", 3)]
    return c
