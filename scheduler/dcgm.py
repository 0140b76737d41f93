"""GPU telemetry as Prometheus metrics named like NVIDIA's DCGM exporter, and as CLI rows.

`metric_families(daemon.telemetry)` gives what a custom collector yields, so Grafana
dashboards built for dcgm-exporter (which plot DCGM_FI_DEV_GPU_UTIL by `gpu`, `UUID`,
`modelName`, `Hostname`) work unchanged; trainyard adds `node` and `job` labels. Every family
is a gauge, as the exporter's defaults mostly are: prometheus_client would add `_total` to a
counter's name, and the names must stay DCGM's. A value the agent reported missing (None) is
left out, never exported as 0.
"""

from __future__ import annotations

from prometheus_client.core import GaugeMetricFamily

LABELS = ["gpu", "UUID", "device", "modelName", "Hostname", "pci_bus_id", "node", "job"]

# (metric name, help, telemetry field, transform)
FIELDS = [
    ("DCGM_FI_DEV_GPU_UTIL", "GPU utilization (in %).", "util_gpu", None),
    ("DCGM_FI_DEV_MEM_COPY_UTIL", "Memory utilization (in %).", "util_mem", None),
    ("DCGM_FI_DEV_FB_USED", "Framebuffer memory used (in MiB).", "mem_used_mb", None),
    ("DCGM_FI_DEV_FB_FREE", "Framebuffer memory free (in MiB).", "mem_free_mb", None),
    ("DCGM_FI_DEV_FB_TOTAL", "Framebuffer memory total (in MiB).", "mem_total_mb", None),
    ("DCGM_FI_DEV_GPU_TEMP", "GPU temperature (in C).", "temp_c", None),
    ("DCGM_FI_DEV_POWER_USAGE", "Power draw (in W).", "power_w", None),
    ("DCGM_FI_DEV_POWER_MGMT_LIMIT", "Power management limit (in W).", "power_limit_w", None),
    ("DCGM_FI_DEV_SM_CLOCK", "SM clock frequency (in MHz).", "sm_clock_mhz", None),
    ("DCGM_FI_DEV_XID_ERRORS", "Value of the last XID error encountered.", "xid", None),
    ("DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "Total number of single-bit volatile ECC errors.", "ecc_sbe_volatile", None),
    ("DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "Total number of double-bit volatile ECC errors.", "ecc_dbe_volatile", None),
    ("DCGM_FI_DEV_ECC_SBE_AGG_TOTAL", "Total number of single-bit persistent ECC errors.", "ecc_sbe_aggregate", None),
    ("DCGM_FI_DEV_ECC_DBE_AGG_TOTAL", "Total number of double-bit persistent ECC errors.", "ecc_dbe_aggregate", None),
    ("DCGM_FI_DEV_CORRECTABLE_REMAPPED_ROWS", "Number of remapped rows for correctable errors.", "remap_correctable", None),
    ("DCGM_FI_DEV_UNCORRECTABLE_REMAPPED_ROWS", "Number of remapped rows for uncorrectable errors.", "remap_uncorrectable", None),
    ("DCGM_FI_DEV_ROW_REMAP_PENDING", "Whether a row remapping is pending (1) until the GPU is reset.", "remap_pending", int),
    ("DCGM_FI_DEV_ROW_REMAP_FAILURE", "Whether a row remapping has failed (1).", "remap_failure", int),
    ("DCGM_FI_DEV_MIG_MODE", "Whether MIG mode is enabled (1).", "mig_mode", int),
    ("trainyard_gpu_off_bus", "1 when the agent lost the GPU (NVML: GPU is lost).", "off_bus", int),
]


def _labels(node: str, g: dict) -> list[str]:
    job = g.get("job_id")
    return [str(g.get("index", "")), str(g.get("uuid") or ""), f"nvidia{g.get('index', '')}",
            str(g.get("name") or ""), node, str(g.get("pci_bus_id") or ""), node,
            "" if job is None else str(job)]


def _value(g: dict, key: str):
    if key == "mem_free_mb":
        total, used = g.get("mem_total_mb"), g.get("mem_used_mb")
        return None if total is None or used is None else total - used
    return g.get(key)


def metric_families(telemetry_by_node: dict[str, dict]) -> list[GaugeMetricFamily]:
    """One family per DCGM field, a sample per GPU that reported it. telemetry_by_node is the
    daemon's `{node: {"time": ..., "gpus": [gpu dict, ...]}}`."""
    families = []
    for name, doc, key, transform in FIELDS:
        fam = GaugeMetricFamily(name, doc, labels=LABELS)
        for node in sorted(telemetry_by_node):
            for g in (telemetry_by_node[node] or {}).get("gpus") or []:
                if not isinstance(g, dict):
                    continue
                value = _value(g, key)
                if value is None or (isinstance(value, bool) and transform is None):
                    continue
                try:
                    value = float(transform(value) if transform else value)
                except (TypeError, ValueError):  # a field of the wrong type is left out too
                    continue
                fam.add_metric(_labels(node, g), value)
        families.append(fam)
    return families


class DcgmCollector:
    """A prometheus_client collector: `REGISTRY.register(DcgmCollector(lambda: daemon.telemetry))`."""

    def __init__(self, telemetry):
        self.telemetry = telemetry

    def collect(self):
        yield from metric_families(self.telemetry())

    def describe(self):
        return []


# ---------------------------------------------------------------- `trainyard nodes --gpus`

GPU_HEADERS = ["NODE", "GPU", "NAME", "UTIL", "MEMORY", "TEMP", "POWER", "ECC DBE", "XID", "JOB", "HEALTH"]


def _fmt(v, unit: str = "") -> str:
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
            power = _fmt(g.get("power_w"))
            if g.get("power_limit_w") is not None and power != "-":
                power += f"/{_fmt(g.get('power_limit_w'))} W"
            elif power != "-":
                power += " W"
            rows.append([name, str(g.get("index", "")), g.get("name") or "-", _fmt(g.get("util_gpu"), "%"),
                         mem, _fmt(g.get("temp_c"), "°C"), power,
                         _fmt(g.get("ecc_dbe_volatile", g.get("ecc_dbe"))), _fmt(g.get("xid")),
                         _fmt(g.get("job_id")), gpu_health(g)])
    return GPU_HEADERS, rows
