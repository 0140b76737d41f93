"""The demo's simulated GPUs and the faults an operator injects into them.

Only simulated nodes load this module (scheduler/simnode.py points the agent at it with
TRAINYARD_SIM_GPUS and TRAINYARD_SIM_PLUGIN_DIR); the agent uploaded to real nodes does not
contain it. SimulatedGpus has the face of gpus.Gpus: describe(), telemetry(), fault().
"""

from __future__ import annotations

import os
import random
import socket
import time

if __package__:
    from .gpus import blank
else:  # loaded by an agent on a simulated node
    from gpus import blank

# remap_pending: a row remap waits for a GPU reset; no health rule drains for it, but the
# health gate (scheduler/daemon/healthgate.py) keeps the node out until it is cleared
FAULT_KINDS = ("xid", "ecc_dbe", "temp", "off_bus", "remap_pending", "clear")


class SimulatedGpus:
    """GPUs that exist only as numbers: busy ones look busy, faults stay until cleared."""

    def __init__(self, count: int, model: str = ""):
        self.source = "simulated"
        self.count = count
        self.model = model or os.environ.get("TRAINYARD_SIM_GPU_MODEL", "NVIDIA H100 80GB HBM3")
        self.note = f"{count} simulated GPUs (TRAINYARD_SIM_GPUS)"
        self.faults: dict[int, dict] = {}

    def describe(self) -> list[dict]:
        """The GPUs this node can allocate (hello): one that fell off the bus is left out."""
        return [{"index": i, "name": self.model} for i in range(self.count)
                if not self.faults.get(i, {}).get("off_bus")]

    def telemetry(self, busy: dict, job_pids: dict | None = None) -> list[dict]:
        return [self._simulated_gpu(i, busy.get(i), job_pids or {}) for i in range(self.count)]

    def _simulated_gpu(self, i: int, job, job_pids: dict) -> dict:
        f = self.faults.get(i, {})
        g = blank(i, self.model)
        host = os.environ.get("TRAINYARD_SIM_NODE") or socket.gethostname()
        g.update(uuid=f"GPU-sim-{host}-{i}", pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
                 job_id=job, off_bus=bool(f.get("off_bus")), xid=f.get("xid"),
                 xid_events=f.pop("new_xids", []))
        if g["off_bus"]:
            return g
        util, used = _load(job)
        dbe = int(f.get("ecc_dbe", 0))
        g.update(
            util_gpu=util, util_mem=util // 2, mem_total_mb=81559, mem_used_mb=used,
            temp_c=f["temp"] if "temp" in f else 60 + util // 5 + random.randint(0, 3),
            power_w=90 + util * 6, power_limit_w=700, sm_clock_mhz=1980 if job else 345,
            ecc_sbe_volatile=0, ecc_dbe_volatile=dbe, ecc_sbe_aggregate=0, ecc_dbe_aggregate=dbe,
            ecc_dbe=dbe, remap_correctable=0, remap_uncorrectable=dbe,
            remap_pending=bool(dbe) or bool(f.get("remap_pending")),
            remap_failure=False, mig_mode=False, mig_instances=[],
            mem_clock_mhz=2619, mem_temp_c=50 + util // 4, pcie_replay=0, util_enc=0, util_dec=0,
            mem_reserved_mb=512, power_mgmt_limit_w=700, energy_mj=self._energy(i, 90 + util * 6),
            # a simulated Hopper: GPM's profiling ratios (0..1)
            prof_gr_engine_active=util / 100, prof_pipe_tensor_active=round(util * 0.6) / 100,
            prof_dram_active=util / 200,
            processes=[{"pid": pid, "used_mb": used, "job_id": j}
                       for pid, j in job_pids.items() if job is not None and j == job],
        )
        return g

    def _energy(self, i: int, power_w: float) -> int:
        """Energy since boot in mJ: the power integrated over the time between samples."""
        now = time.monotonic()
        last, total = getattr(self, "_energy_at", {}).get(i, (now, 0.0))
        total += power_w * (now - last) * 1000
        self.__dict__.setdefault("_energy_at", {})[i] = (now, total)
        return int(total)

    def fault(self, gpu: int, kind: str, value=None, host: str = "") -> None:
        """Inject (or clear) a fault on a simulated GPU; ValueError says why not."""
        host = host or os.environ.get("TRAINYARD_SIM_NODE") or socket.gethostname()
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; use one of {', '.join(FAULT_KINDS)}")
        if not isinstance(gpu, int) or isinstance(gpu, bool) or not 0 <= gpu < self.count:
            raise ValueError(f"{host} has no GPU {gpu!r} (it has {self.count}: 0-{self.count - 1})")
        f = self.faults.setdefault(gpu, {})
        if kind == "clear":
            self.faults.pop(gpu, None)
        elif kind == "xid":
            code = _int_value(value, "xid", 1, 1 << 16)
            f["xid"] = code
            f.setdefault("new_xids", []).append(code)
        elif kind == "ecc_dbe":
            f["ecc_dbe"] = int(f.get("ecc_dbe", 0)) + (1 if value is None else _int_value(value, "ecc_dbe", 1, 1 << 20))
        elif kind == "temp":
            f["temp"] = _int_value(value, "temp", 0, 200)
        elif kind == "off_bus":
            f["off_bus"] = True
        elif kind == "remap_pending":
            f["remap_pending"] = True


def _load(job) -> tuple[int, int]:
    """Utilisation (%) and memory used (MiB) of a GPU running `job` (None: idle). Each job has a
    profile of its own, steady for its life (a small model leaves the GPU half idle, a large
    one fills its memory), with a little noise from sample to sample."""
    if job is None:
        return random.randint(0, 3), 0
    profile = random.Random(str(job))
    util = profile.randint(45, 97) + random.randint(-4, 3)
    used = profile.randint(8, 76) * 1024 + random.randint(0, 512)
    return max(1, min(100, util)), used


def _int_value(value, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ValueError(f"fault {what} needs a whole number, not {value!r}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"fault {what} value {value} is out of range {lo}-{hi}")
    return int(value)


# ---------------------------------------------------------------- the agent
