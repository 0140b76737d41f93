"""One node's GPU telemetry in dcgm-exporter's exposition (names, types, labels), and CLI rows.

trainyard serves each node's GPUs at a path of its own (`/metrics/nodes/<node>`, listed for
Prometheus by an `http_sd` endpoint), so every series gets `instance` = the node, exactly as
with one dcgm-exporter per node, and NVIDIA's Grafana dashboard (id 12239) reads them
unchanged. Names, types and help texts follow dcgm-exporter's `etc/default-counters.csv`;
counters keep DCGM's names (no `_total` is appended). The label set is the exporter's: `gpu`,
`UUID`, `pci_bus_id`, `device`, `modelName`, `GPU_I_PROFILE`/`GPU_I_ID` on MIG instances,
`Hostname`, `DCGM_FI_DRIVER_VERSION`, `err_code`/`err_msg` on XID errors and `hpc_job` for the
job holding the GPU. A value the node did not report (None) is left out, never exported as 0.
Fields and what NVML cannot give: docs/metrics.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

GAUGE, COUNTER = "gauge", "counter"
NODE_METRICS_PREFIX = "/metrics/nodes/"


@dataclass(frozen=True)
class DcgmField:
    name: str
    type: str
    help: str
    key: str            # the telemetry key the value comes from (docs/gpu.md)
    per_instance: bool = False  # on a MIG GPU: one series per GPU instance


# dcgm-exporter's default counters in its file's order, then the fields it has outside the
# defaults that trainyard reports too. Absent: DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL and
# DCGM_FI_DEV_VGPU_LICENSE_STATUS (no per-GPU NVML reading the agent takes).
FIELDS: tuple[DcgmField, ...] = (
    DcgmField("DCGM_FI_DEV_SM_CLOCK", GAUGE, "SM clock frequency (in MHz).", "sm_clock_mhz"),
    DcgmField("DCGM_FI_DEV_MEM_CLOCK", GAUGE, "Memory clock frequency (in MHz).", "mem_clock_mhz"),
    DcgmField("DCGM_FI_DEV_MEMORY_TEMP", GAUGE, "Memory temperature (in C).", "mem_temp_c"),
    DcgmField("DCGM_FI_DEV_GPU_TEMP", GAUGE, "GPU temperature (in C).", "temp_c"),
    DcgmField("DCGM_FI_DEV_POWER_USAGE", GAUGE, "Power draw (in W).", "power_w"),
    DcgmField("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION", COUNTER,
              "Total energy consumption since boot (in mJ).", "energy_mj"),
    DcgmField("DCGM_FI_DEV_PCIE_REPLAY_COUNTER", COUNTER, "Total number of PCIe retries.",
              "pcie_replay"),
    DcgmField("DCGM_FI_DEV_GPU_UTIL", GAUGE, "GPU utilization (in %).", "util_gpu"),
    DcgmField("DCGM_FI_DEV_MEM_COPY_UTIL", GAUGE, "Memory utilization (in %).", "util_mem"),
    DcgmField("DCGM_FI_DEV_ENC_UTIL", GAUGE, "Encoder utilization (in %).", "util_enc"),
    DcgmField("DCGM_FI_DEV_DEC_UTIL", GAUGE, "Decoder utilization (in %).", "util_dec"),
    DcgmField("DCGM_FI_DEV_XID_ERRORS", GAUGE, "Value of the last XID error encountered.", "xid"),
    DcgmField("DCGM_FI_DEV_FB_FREE", GAUGE, "Framebuffer memory free (in MiB).", "mem_free_mb",
              per_instance=True),
    DcgmField("DCGM_FI_DEV_FB_USED", GAUGE, "Framebuffer memory used (in MiB).", "mem_used_mb",
              per_instance=True),
    DcgmField("DCGM_FI_DEV_FB_RESERVED", GAUGE, "Framebuffer memory reserved (in MiB).",
              "mem_reserved_mb"),
    DcgmField("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", COUNTER,
              "Number of remapped rows for uncorrectable errors", "remap_uncorrectable"),
    DcgmField("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", COUNTER,
              "Number of remapped rows for correctable errors", "remap_correctable"),
    DcgmField("DCGM_FI_DEV_ROW_REMAP_FAILURE", GAUGE, "Whether remapping of rows has failed",
              "remap_failure"),
    # profiling fields: DCGM's profiling module, or NVML's GPM on Hopper and later
    DcgmField("DCGM_FI_PROF_GR_ENGINE_ACTIVE", GAUGE, "Ratio of time the graphics engine is active.",
              "prof_gr_engine_active", per_instance=True),
    DcgmField("DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", GAUGE,
              "Ratio of cycles the tensor (HMMA) pipe is active.", "prof_pipe_tensor_active",
              per_instance=True),
    DcgmField("DCGM_FI_PROF_DRAM_ACTIVE", GAUGE,
              "Ratio of cycles the device memory interface is active sending or receiving data.",
              "prof_dram_active", per_instance=True),
    DcgmField("DCGM_FI_PROF_PCIE_TX_BYTES", GAUGE,
              "The rate of data transmitted over the PCIe bus - including both protocol headers "
              "and data payloads - in bytes per second.", "pcie_tx_bytes_s"),
    DcgmField("DCGM_FI_PROF_PCIE_RX_BYTES", GAUGE,
              "The rate of data received over the PCIe bus - including both protocol headers "
              "and data payloads - in bytes per second.", "pcie_rx_bytes_s"),
    # outside the default file, in dcgm-exporter's names and types
    DcgmField("DCGM_FI_DEV_FB_TOTAL", GAUGE, "Framebuffer memory total (in MiB).", "mem_total_mb",
              per_instance=True),
    DcgmField("DCGM_FI_DEV_POWER_MGMT_LIMIT", GAUGE, "Power management limit (in W).",
              "power_mgmt_limit_w"),
    DcgmField("DCGM_FI_DEV_ENFORCED_POWER_LIMIT", GAUGE, "Effective power limit (in W).",
              "power_limit_w"),
    DcgmField("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", COUNTER,
              "Total number of single-bit volatile ECC errors.", "ecc_sbe_volatile"),
    DcgmField("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", COUNTER,
              "Total number of double-bit volatile ECC errors.", "ecc_dbe_volatile"),
    DcgmField("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", COUNTER,
              "Total number of single-bit persistent ECC errors.", "ecc_sbe_aggregate"),
    DcgmField("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", COUNTER,
              "Total number of double-bit persistent ECC errors.", "ecc_dbe_aggregate"),
    DcgmField("DCGM_FI_DEV_ROW_REMAP_PENDING", GAUGE, "Whether remapping of rows is pending.",
              "remap_pending"),
    DcgmField("DCGM_FI_DEV_MIG_MODE", GAUGE, "Whether MIG mode is enabled (1).", "mig_mode"),
    DcgmField("trainyard_gpu_off_bus", GAUGE,
              "1 when the node's agent lost the GPU (NVML: GPU is lost).", "off_bus"),
)

# XID codes in words, as dcgm-exporter labels them (`err_msg`), after NVIDIA's XID catalogue.
XID_MESSAGES = (  # index = XID code
    "No Error", "Invalid or corrupted push buffer stream",
    "Invalid or corrupted push buffer stream", "Invalid or corrupted push buffer stream",
    "Invalid or corrupted push buffer stream", "Unused", "Invalid or corrupted push buffer stream",
    "Invalid or corrupted push buffer address", "GPU stopped processing",
    "Driver error programming GPU", "Unused", "Invalid or corrupted push buffer stream",
    "Driver error handling GPU exception", "Graphics Engine Exception", "Unused", "Unused",
    "Display engine hung", "Unused", "Bus mastering disabled in PCI Config Space",
    "Display Engine error", "Invalid or corrupted Mpeg push buffer",
    "Invalid or corrupted Motion Estimation push buffer",
    "Invalid or corrupted Video Processor push buffer", "Unused", "GPU semaphore timeout",
    "Invalid or illegal push buffer stream", "Framebuffer timeout", "Video processor exception",
    "Video processor exception", "Video processor exception", "GPU semaphore access error",
    "GPU memory page fault", "Invalid or corrupted push buffer stream",
    "Internal micro-controller error", "Video processor exception", "Video processor exception",
    "Video processor exception", "Driver firmware error", "Driver firmware error", "Unused",
    "Unused", "Unused", "Video processor exception", "GPU stopped processing",
    "Graphics Engine fault during context switch",
    "Preemptive cleanup, due to previous errors -- Most likely to see when running multiple cuda",
    "GPU stopped processing", "Video processor exception", "Double Bit ECC Error", "Unused",
    "Unused", "Unused", "Unused", "Unused", "Auxiliary power is not connected to the GPU board",
    "Unused", "Display Engine error", "Error programming video memory interface",
    "Unstable video memory interface detected", "Internal micro-controller error",
    "Video processor exception", "Internal micro-controller breakpoint/warning",
    "Internal micro-controller halt", "ECC page retirement or row remapping recording event",
    "ECC page retirement or row remapper recording failure", "Video processor exception",
    "Illegal access by driver", "Illegal access by driver", "NVDEC0 Exception",
    "Graphics Engine class error", "CE3: Unknown Error", "CE4: Unknown Error",
    "CE5: Unknown Error", "NVENC2 Error", "NVLINK Error", "CE6: Unknown Error",
    "CE7: Unknown Error", "CE8: Unknown Error", "vGPU Start Error", "GPU has fallen off the bus",
    "Corrupted data sent to GPU", "VGA Subsystem Error", "NVJPG0 Error", "NVDEC1 Error",
    "NVDEC2 Error", "CE9: Unknown Error", "OFA Exception", "Reserved", "NVDEC3 Error",
    "NVDEC4 Error", "Reserved", "Reserved", "High single-bit ECC error rate",
    "Non-fatal violation of provisioned InfoROM wear limit", "Contained ECC error",
    "Uncontained ECC error", "NVDEC5 Error", "NVDEC6 Error", "NVDEC7 Error", "NVJPG1 Error",
    "NVJPG2 Error", "NVJPG3 Error", "NVJPG4 Error", "NVJPG5 Error", "NVJPG6 Error", "NVJPG7 Error",
    "SMBPBI Test Message", "SMBPBI Test Message Silent", "Reserved",
    "Context Switch Timeout Error", "Security Fault Error", "Display Bundle Error Event",
    "Display Supervisor Error", "DP Link Training Error", "Display Pipeline Underflow Error",
    "Display Core Channel Error", "Display Window Channel Error", "Display Cursor Channel Error",
    "Display Pixel Pipeline Error", "GSP RPC Timeout", "GSP Error", "C2C Link Error",
    "SPI PMU RPC Read Failure", "SPI PMU RPC Write Failure", "SPI PMU RPC Erase Failure",
    "Inforom FS Failure", "Robust Channel CE10 Error", "Robust Channel CE11 Error",
    "Robust Channel CE12 Error", "Robust Channel CE13 Error", "Robust Channel CE14 Error",
    "Robust Channel CE15 Error", "Robust Channel CE16 Error", "Robust Channel CE17 Error",
    "Robust Channel CE18 Error", "Robust Channel CE19 Error", "ALI Training Fail",
    "NVLink Privilege Error", "Robust Channel DLA Error", "Robust Channel OFA1 Error",
    "Unrecovered ECC Error", "Robust Channel Fast Path Error", "Robust Channel NVENVC3 Error",
    "GPU Initialization Failure", "NVLINK: Saw Error", "NVLINK: RLW Error", "NVLINK: TLW Error",
    "NVLINK: TREX Error", "NVLINK: NVLPW_CTRL Error", "NVLINK: NETIR Error", "NVLINK: MSE Error",
    "Robust Channel Key rotation Error", "Robust Channel DLA SMMU Error",
    "Robust Channel DLA timeout Error", "GPU Recovery Action Changed", "NVLINK: SW Defined Error",
    "Resource Retirement Event", "Resource Retirement Failure", "GPU Fatal Timeout",
    "Robust Channel CHI Non-Data Error", "Channel Retirement Event", "Channel Retirement Failure",
    "Power Smoothing HW Circuitry Reengaged", "Power Smoothing HW Circuitry Disengaged",
    "Power Smoothing HW Circuitry Low Lifetime", "Power Smoothing HW Circuitry Lifetime Exhausted",
    "NVLINK Secure Crypto Error", "PCIE Fatal Timeout",
    "Reduced GPU Memory Capacity (Errors found in write protection region)",
    "Internal micro-controller halt", "NVLINK: Interrupt seen in CC mode",
    "Uncorrectable DRAM Error", "Uncorrectable SRAM Error",
)
UNKNOWN_XID = "Unknown Error"


@dataclass
class Family:
    """One metric family: name, type, help and its samples (labels, value)."""

    name: str
    type: str
    help: str
    samples: list[tuple[dict[str, str], float]] = field(default_factory=list)


def xid_message(code: int) -> str:
    return XID_MESSAGES[code] if 0 <= code < len(XID_MESSAGES) else UNKNOWN_XID


def mig_profile(instance: dict) -> str:
    """The GPU instance profile ("1g.10gb"), from the agent's `profile` or the MIG device name."""
    if instance.get("profile"):
        return str(instance["profile"])
    name = str(instance.get("name") or "")
    return name.rpartition(" MIG ")[2] if " MIG " in name else ""


def _number(value) -> int | float | None:
    """A reading as a number to export; None (left out) for a missing, non-finite or
    mistyped one. Readings are mostly ints and floats already: those take the first test."""
    kind = type(value)
    if kind is int and -2**63 < value < 2**63:  # past int64, as a float (left out past its range)
        return value
    if kind is float:
        return value if math.isfinite(value) else None
    if value is None:
        return None
    if kind is bool:
        return int(value)
    try:
        v = float(value)
    except (TypeError, ValueError, OverflowError):  # a field of the wrong type is left out too
        return None
    return v if math.isfinite(v) else None


def _value(g: dict, key: str) -> int | float | None:
    if key == "mem_free_mb":
        total, used = _number(g.get("mem_total_mb")), _number(g.get("mem_used_mb"))
        return None if total is None or used is None else total - used
    return _number(g.get(key))


def gpu_families(hostname: str, driver_version: str, gpus: list[dict],
                 jobs: dict[int, object] | None = None) -> list[Family]:
    """Every DCGM family of one node, a sample per GPU (and per MIG instance) that reported it.

    gpus: the node's latest telemetry (`sample["gpus"]`); jobs: GPU index -> the job allocated
    it (the control plane's allocation wins over the job the agent saw on the GPU)."""
    jobs = jobs or {}
    families = [Family(f.name, f.type, f.help) for f in FIELDS]
    plan = [(fam, spec.key, spec.per_instance) for fam, spec in zip(families, FIELDS, strict=True)]
    for g in gpus:
        if not isinstance(g, dict) or g.get("index") is None:
            continue
        index = g["index"]
        base = {"gpu": str(index), "UUID": str(g.get("uuid") or ""),
                "pci_bus_id": str(g.get("pci_bus_id") or ""), "device": f"nvidia{index}",
                "modelName": str(g.get("name") or ""), "Hostname": hostname}
        if driver_version:
            base["DCGM_FI_DRIVER_VERSION"] = driver_version
        job = jobs.get(index, g.get("job_id"))
        if job is not None and job != "":
            base["hpc_job"] = str(job)
        # a MIG GPU's instances, each with series of its own (one label set per instance) for
        # the fields measured per instance
        instances = [({**base, "GPU_I_PROFILE": mig_profile(i), "GPU_I_ID": str(i.get("gi_id", i.get("index")))}, i)
                     for i in (g.get("mig_instances") or () if g.get("mig_mode") else ()) if isinstance(i, dict)]
        for fam, key, per_instance in plan:
            if per_instance and instances:
                for labels, inst in instances:
                    v = _value(inst, key)
                    if v is not None:
                        fam.samples.append((labels, v))
                continue
            if key == "xid":
                _add_xid(fam, base, g)
                continue
            v = _value(g, key)
            if v is not None:
                fam.samples.append((base, v))
    return families


def _add_xid(fam: Family, base: dict, g: dict) -> None:
    """The last XID with its code and words; 0 ("No Error") while watched and none came yet."""
    code = g.get("xid")
    if code is None:
        if g.get("xid_events") is None:  # the GPU has no event support: unknown, not 0
            return
        code = 0
    try:
        code = int(code)
    except (TypeError, ValueError):
        return
    fam.samples.append(({**base, "err_code": str(code), "err_msg": xid_message(code)}, float(code)))


# ---------------------------------------------------------------- text exposition

def _escape(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r"\"")


def _fmt(v: int | float) -> str:
    if type(v) is int:
        return str(v)
    if v.is_integer() and abs(v) < 2**63:
        return str(int(v))
    return repr(v)


@lru_cache(maxsize=512)
def _header(name: str, kind: str, doc: str) -> str:
    doc = doc.replace("\\", r"\\").replace("\n", r"\n")
    return f"# HELP {name} {doc}\n# TYPE {name} {kind}\n"


def render(families: list[Family]) -> bytes:
    """Prometheus text format 0.0.4; a counter keeps its name (DCGM's names have no `_total`)."""
    out: list[str] = []
    # a GPU's samples share one label set (the same dict): written once per render, not per
    # sample (a node of 8 GPUs has ~400 samples). Keyed by identity: every set outlives the call
    written: dict[int, str] = {}
    for fam in families:
        out.append(_header(fam.name, fam.type, fam.help))
        bare, opened = f"{fam.name} ", f"{fam.name}{{"
        for labels, value in fam.samples:
            body = written.get(id(labels))
            if body is None:
                body = written[id(labels)] = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
            out.append(f"{opened}{body}}} {_fmt(value)}\n" if body else f"{bare}{_fmt(value)}\n")
    return "".join(out).encode()


def http_sd_targets(nodes: list[str], address: str, scheme: str = "http",
                    prefix: str = NODE_METRICS_PREFIX, labels: dict[str, str] | None = None) -> list[dict]:
    """Prometheus HTTP service discovery: one target group per node, scraped at its own path,
    with `instance` = the node. address: host:port Prometheus reaches the daemon at."""
    return [{"targets": [address],
             "labels": {"instance": name, "__metrics_path__": prefix + name, "__scheme__": scheme,
                        **(labels or {})}}
            for name in nodes]


# ---------------------------------------------------------------- `trainyard nodes --gpus`

GPU_HEADERS = ["NODE", "GPU", "NAME", "UTIL", "MEMORY", "TEMP", "POWER", "ECC DBE", "XID", "JOB", "HEALTH"]


def _cell(v, unit: str = "") -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        v = f"{v:.0f}"
    return f"{v}{unit}"


def gpu_health(g: dict) -> str:
    """A word or two on a GPU's state: off-bus, row-remap failure, ECC, XID, else ok."""
    problems = []
    if g.get("off_bus"):
        problems.append("OFF BUS")
    if g.get("remap_failure"):
        problems.append("remap failed")
    elif g.get("remap_pending"):
        problems.append("remap pending")
    dbe = g.get("ecc_dbe_volatile", g.get("ecc_dbe"))
    if dbe:
        problems.append("ECC DBE")
    if g.get("xid_events"):
        problems.append("XID " + ",".join(str(x) for x in g["xid_events"]))
    return "; ".join(problems) or "ok"


def format_gpu_rows(nodes: list[dict]) -> tuple[list[str], list[list[str]]]:
    """One row per GPU of each node's `telemetry.gpus` (node JSON as the API serves it);
    a node without telemetry gets one row saying so."""
    rows = []
    for node in nodes:
        name = str(node.get("name", ""))
        gpus = ((node.get("telemetry") or {}).get("gpus")) or []
        if not gpus:
            rows.append([name, "-", node.get("gpu_model") or "-", "-", "-", "-", "-", "-", "-", "-",
                         "no GPU telemetry"])
            continue
        for g in gpus:
            used, total = g.get("mem_used_mb"), g.get("mem_total_mb")
            mem = "-" if used is None or total is None else f"{used / 1024:.1f}/{total / 1024:.0f} GiB"
            power = _cell(g.get("power_w"))
            if g.get("power_limit_w") is not None and power != "-":
                power += f"/{_cell(g.get('power_limit_w'))} W"
            elif power != "-":
                power += " W"
            rows.append([name, str(g.get("index", "")), g.get("name") or "-", _cell(g.get("util_gpu"), "%"),
                         mem, _cell(g.get("temp_c"), "°C"), power,
                         _cell(g.get("ecc_dbe_volatile", g.get("ecc_dbe"))), _cell(g.get("xid")),
                         _cell(g.get("job_id")), gpu_health(g)])
    return GPU_HEADERS, rows
