"""/metrics names as NVIDIA's DCGM exporter has them, and `trainyard nodes --gpus` rows."""

from __future__ import annotations

import sys

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from scheduler import agent
from scheduler.dcgm import DcgmCollector, format_gpu_rows, metric_families
from tests.gpu import fake_pynvml


def telemetry(monkeypatch, scenario, gpus=2):
    monkeypatch.delenv("TRAINYARD_SIM_GPUS", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml.scenario(scenario, gpus=gpus))
    return {"time": 100.0, "gpus": agent.Gpus(0, "").telemetry({1: 42})}


def scrape(by_node) -> dict:
    """What Prometheus would read from /metrics: {(name, gpu, node): (labels, value)}."""
    reg = CollectorRegistry()
    reg.register(DcgmCollector(lambda: by_node))
    text = generate_latest(reg).decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        assert fam.type == "gauge", fam.name
        for s in fam.samples:
            out[(s.name, s.labels["gpu"], s.labels["node"])] = (s.labels, s.value)
    return out


def test_dcgm_names_and_labels(monkeypatch):
    got = scrape({"gpu-a": telemetry(monkeypatch, "xid79", gpus=3)})
    labels, _ = got[("DCGM_FI_DEV_GPU_UTIL", "1", "gpu-a")]
    assert labels == {"gpu": "1", "UUID": "GPU-fake-0001", "device": "nvidia1",
                      "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "gpu-a",
                      "pci_bus_id": "00000000:19:00.0", "node": "gpu-a", "job": "42"}
    values = {name: got[(name, "1", "gpu-a")][1] for name in (
        "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_FB_FREE",
        "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_SM_CLOCK",
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ROW_REMAP_FAILURE",
        "trainyard_gpu_off_bus")}
    assert values == {"DCGM_FI_DEV_GPU_UTIL": 37, "DCGM_FI_DEV_MEM_COPY_UTIL": 12, "DCGM_FI_DEV_FB_USED": 2048,
                      "DCGM_FI_DEV_FB_FREE": 79511, "DCGM_FI_DEV_GPU_TEMP": 41, "DCGM_FI_DEV_POWER_USAGE": 123.5,
                      "DCGM_FI_DEV_SM_CLOCK": 1980, "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": 5,
                      "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL": 0, "DCGM_FI_DEV_ROW_REMAP_FAILURE": 0,
                      "trainyard_gpu_off_bus": 0}
    assert got[("DCGM_FI_DEV_XID_ERRORS", "2", "gpu-a")][1] == 79  # the last XID, as the exporter has it
    assert ("DCGM_FI_DEV_XID_ERRORS", "0", "gpu-a") not in got     # no XID yet: nothing, not 0
    assert got[("DCGM_FI_DEV_GPU_UTIL", "0", "gpu-a")][0]["job"] == ""


def test_missing_fields_are_left_out_not_zero(monkeypatch):
    got = scrape({"old": telemetry(monkeypatch, "not_supported")})
    assert got[("DCGM_FI_DEV_FB_USED", "0", "old")][1] == 2048
    for name in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE",
                 "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ROW_REMAP_FAILURE"):
        assert (name, "0", "old") not in got, name


def test_one_family_per_field_whatever_the_nodes():
    names = [f.name for f in metric_families({})]
    assert len(names) == len(set(names))
    assert {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_FB_USED", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE",
            "DCGM_FI_DEV_XID_ERRORS", "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL"} <= set(names)
    assert all(not f.samples for f in metric_families({"n": {"time": 1, "gpus": []}, "m": {}}))


def test_gpu_rows_for_the_cli(monkeypatch):
    nodes = [{"name": "gpu-a", "telemetry": telemetry(monkeypatch, "healthy")},
             {"name": "cpu-1", "gpu_model": "", "telemetry": None}]
    nodes[0]["telemetry"]["gpus"][0].update(off_bus=True, temp_c=None, util_gpu=None, power_w=None)
    headers, rows = format_gpu_rows(nodes)
    assert headers[:3] == ["NODE", "GPU", "NAME"] and headers[-1] == "HEALTH"
    assert rows[0] == ["gpu-a", "0", "NVIDIA H100 80GB HBM3", "-", "2.0/80 GiB", "-", "-", "0", "-", "-", "OFF BUS"]
    assert rows[1] == ["gpu-a", "1", "NVIDIA H100 80GB HBM3", "37%", "2.0/80 GiB", "41°C", "124/700 W", "0",
                       "-", "42", "ok"]
    assert rows[2][0] == "cpu-1" and rows[2][-1] == "no GPU telemetry"
