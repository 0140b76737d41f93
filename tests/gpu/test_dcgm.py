"""One node's GPUs in dcgm-exporter's exposition: names, types, labels as the exporter has them."""

from __future__ import annotations

import csv
import sys
from pathlib import Path

from scheduler import agent
from scheduler.dcgm import FIELDS, format_gpu_rows, gpu_families, http_sd_targets, render
from tests.gpu import fake_pynvml
from tests.metrics.cluster import gpu
from tests.metrics.exposition import parse, series

DEFAULT_COUNTERS = Path(__file__).parents[1] / "metrics" / "dcgm_default_counters.csv"
# default counters no per-GPU NVML reading gives (docs/metrics.md says so)
ABSENT = {"DCGM_FI_DEV_NVLINK_BANDWIDTH_TOTAL", "DCGM_FI_DEV_VGPU_LICENSE_STATUS"}


def nvml_gpus(monkeypatch, scenario, gpus=2) -> list[dict]:
    """What the agent's own Gpus class reports from a fake NVML in that scenario."""
    monkeypatch.delenv("TRAINYARD_SIM_GPUS", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml.scenario(scenario, gpus=gpus))
    return agent.Gpus(0, "").telemetry({})


def scrape(gpus, jobs=None, hostname="gpu-a", driver="550.54.15") -> dict:
    return parse(render(gpu_families(hostname, driver, gpus, jobs)).decode())


def test_names_types_and_help_are_dcgm_exporters_default_counters():
    lines = [ln for ln in DEFAULT_COUNTERS.read_text().splitlines() if ln and not ln.startswith("#")]
    ours = {f.name: f for f in FIELDS}
    for row in csv.reader(lines):
        name, typ, doc = row[0].strip(), row[1].strip(), ",".join(row[2:]).strip()
        if typ == "label" or name in ABSENT:
            continue
        assert name in ours, f"default counter {name} missing"
        assert (ours[name].type, ours[name].help) == (typ, doc), name


def test_counters_keep_dcgm_names_without_total():
    fams = scrape([gpu(1, 0)])
    assert fams["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]["type"] == "counter"
    assert [s[0] for s in fams["DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]["samples"]] == [
        "DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION"]
    assert not [n for n in fams if n.endswith("_total") and not n.endswith("_VOL_TOTAL")
                and not n.endswith("_AGG_TOTAL")]


def test_label_set_is_the_exporters_with_hpc_job_on_allocated_gpus(monkeypatch):
    gpus = nvml_gpus(monkeypatch, "healthy", gpus=3)
    util = series(scrape(gpus, jobs={1: 42}), "DCGM_FI_DEV_GPU_UTIL")
    assert util["1"] == ({"gpu": "1", "UUID": "GPU-fake-0001", "pci_bus_id": "00000000:19:00.0",
                          "device": "nvidia1", "modelName": "NVIDIA H100 80GB HBM3", "Hostname": "gpu-a",
                          "DCGM_FI_DRIVER_VERSION": "550.54.15", "hpc_job": "42"}, 37)
    assert "hpc_job" not in util["0"][0]  # idle: no label at all, as dcgm-exporter
    assert not {"job", "node", "instance"} & set(util["0"][0])  # Prometheus owns job and instance


def test_values_from_nvml_land_on_their_fields(monkeypatch):
    fams = scrape(nvml_gpus(monkeypatch, "healthy"))
    got = {name: series(fams, name)["0"][1] for name in (
        "DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_MEM_COPY_UTIL", "DCGM_FI_DEV_FB_USED",
        "DCGM_FI_DEV_FB_FREE", "DCGM_FI_DEV_FB_TOTAL", "DCGM_FI_DEV_GPU_TEMP",
        "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_ENFORCED_POWER_LIMIT", "DCGM_FI_DEV_SM_CLOCK",
        "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL", "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL",
        "DCGM_FI_DEV_ROW_REMAP_FAILURE", "trainyard_gpu_off_bus")}
    assert got == {"DCGM_FI_DEV_GPU_UTIL": 37, "DCGM_FI_DEV_MEM_COPY_UTIL": 12, "DCGM_FI_DEV_FB_USED": 2048,
                   "DCGM_FI_DEV_FB_FREE": 79511, "DCGM_FI_DEV_FB_TOTAL": 81559, "DCGM_FI_DEV_GPU_TEMP": 41,
                   "DCGM_FI_DEV_POWER_USAGE": 123.5, "DCGM_FI_DEV_ENFORCED_POWER_LIMIT": 700,
                   "DCGM_FI_DEV_SM_CLOCK": 1980, "DCGM_FI_DEV_ECC_SBE_VOL_TOTAL": 5,
                   "DCGM_FI_DEV_ECC_SBE_AGG_TOTAL": 17, "DCGM_FI_DEV_ROW_REMAP_FAILURE": 0,
                   "trainyard_gpu_off_bus": 0}


def test_management_limit_and_enforced_limit_are_two_fields():
    fams = scrape([gpu(1, 0, power_mgmt_limit_w=700.0, power_limit_w=550.0)])
    assert series(fams, "DCGM_FI_DEV_POWER_MGMT_LIMIT")["0"][1] == 700
    assert series(fams, "DCGM_FI_DEV_ENFORCED_POWER_LIMIT")["0"][1] == 550


def test_xid_is_zero_until_one_arrives_then_the_last_with_code_and_words(monkeypatch):
    fams = scrape(nvml_gpus(monkeypatch, "xid79", gpus=3))
    xid = series(fams, "DCGM_FI_DEV_XID_ERRORS")
    assert xid["0"][1] == 0 and (xid["0"][0]["err_code"], xid["0"][0]["err_msg"]) == ("0", "No Error")
    assert xid["2"][1] == 79
    assert (xid["2"][0]["err_code"], xid["2"][0]["err_msg"]) == ("79", "GPU has fallen off the bus")


def test_xid_unknown_without_event_support_and_words_for_unknown_codes():
    fams = scrape([gpu(1, 0, xid_events=None), gpu(1, 1, xid=999)])
    xid = series(fams, "DCGM_FI_DEV_XID_ERRORS")
    assert "0" not in xid  # no event support: no series rather than a false 0
    assert xid["1"][0]["err_msg"] == "Unknown Error"


def test_fields_the_driver_did_not_report_are_left_out_not_zero(monkeypatch):
    fams = scrape(nvml_gpus(monkeypatch, "not_supported"))
    assert series(fams, "DCGM_FI_DEV_FB_USED")["0"][1] == 2048
    for name in ("DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE",
                 "DCGM_FI_DEV_ECC_DBE_VOL_TOTAL", "DCGM_FI_DEV_ROW_REMAP_FAILURE",
                 "DCGM_FI_PROF_PIPE_TENSOR_ACTIVE", "DCGM_FI_DEV_MEM_CLOCK"):
        assert "0" not in series(fams, name), name
    assert all(f["type"] in ("gauge", "counter") and f["help"] for f in fams.values())


def test_a_non_finite_or_mistyped_reading_is_left_out_and_the_rest_keep_their_exact_values():
    # a driver (or a hand-edited fake) can report inf, NaN, a bool, a numeric string or a
    # counter past a float's integer range: the scrape must still parse, the odd field left out
    energy = 2**62 + 1  # an int counter keeps every digit, as dcgm-exporter's do
    fams = scrape([gpu(1, 0, temp_c=float("inf"), power_w=float("nan"), util_gpu="37", mem_temp_c=-float("inf"),
                       mig_mode=True, energy_mj=energy, util_mem=True, sm_clock_mhz=10**400,
                       mem_clock_mhz="fast", power_limit_w=312.5)])
    for name in ("DCGM_FI_DEV_GPU_TEMP", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_MEMORY_TEMP",
                 "DCGM_FI_DEV_SM_CLOCK", "DCGM_FI_DEV_MEM_CLOCK"):
        assert "0" not in series(fams, name), name
    assert series(fams, "DCGM_FI_DEV_GPU_UTIL")["0"][1] == 37
    assert series(fams, "DCGM_FI_DEV_MEM_COPY_UTIL")["0"][1] == 1
    assert series(fams, "DCGM_FI_DEV_MIG_MODE")["0"][1] == 1
    assert series(fams, "DCGM_FI_DEV_ENFORCED_POWER_LIMIT")["0"][1] == 312.5
    line = next(ln for ln in render(gpu_families("gpu-a", "", [gpu(1, 0, energy_mj=energy)])).decode().splitlines()
                if ln.startswith("DCGM_FI_DEV_TOTAL_ENERGY_CONSUMPTION{"))
    assert line.endswith(f"}} {energy}"), line


def test_a_lost_gpu_says_so_and_nothing_else(monkeypatch):
    fams = scrape(nvml_gpus(monkeypatch, "gpu_lost"))
    assert series(fams, "trainyard_gpu_off_bus")["1"][1] == 1
    assert "1" not in series(fams, "DCGM_FI_DEV_GPU_TEMP")


def test_mig_instances_carry_profile_and_instance_labels():
    instances = [{"index": 0, "gi_id": 1, "profile": "3g.40gb", "uuid": "MIG-a", "mem_total_mb": 40192,
                  "mem_used_mb": 13},
                 {"index": 1, "gi_id": 2, "name": "NVIDIA H100 80GB HBM3 MIG 1g.10gb", "uuid": "MIG-b",
                  "mem_total_mb": 9856, "mem_used_mb": 20}]
    fams = scrape([gpu(1, 0, mig_mode=True, mig_instances=instances, util_gpu=None)])
    used = [(s[1]["GPU_I_PROFILE"], s[1]["GPU_I_ID"], s[2]) for s in fams["DCGM_FI_DEV_FB_USED"]["samples"]]
    assert used == [("3g.40gb", "1", 13), ("1g.10gb", "2", 20)]
    temp = fams["DCGM_FI_DEV_GPU_TEMP"]["samples"]
    assert len(temp) == 1 and "GPU_I_ID" not in temp[0][1]  # device-level fields stay per GPU
    assert series(fams, "DCGM_FI_DEV_MIG_MODE")["0"][1] == 1


def test_label_values_are_escaped():
    text = render(gpu_families('host "x"\\y', "", [gpu(1, 0, name="odd\nname")])).decode()
    assert 'Hostname="host \\"x\\"\\\\y"' in text and 'modelName="odd\\nname"' in text
    assert series(parse(text), "DCGM_FI_DEV_GPU_TEMP")["0"][0]["Hostname"] == 'host "x"\\y'


def test_http_sd_lists_one_target_per_node_with_instance_and_path():
    assert http_sd_targets(["n1", "n2"], "10.0.0.5:8765") == [
        {"targets": ["10.0.0.5:8765"],
         "labels": {"instance": "n1", "__metrics_path__": "/metrics/nodes/n1", "__scheme__": "http"}},
        {"targets": ["10.0.0.5:8765"],
         "labels": {"instance": "n2", "__metrics_path__": "/metrics/nodes/n2", "__scheme__": "http"}}]


def test_gpu_rows_for_the_cli(monkeypatch):
    tel = {"time": 100.0, "gpus": nvml_gpus(monkeypatch, "healthy")}
    tel["gpus"][1]["job_id"] = 42
    nodes = [{"name": "gpu-a", "telemetry": tel}, {"name": "cpu-1", "gpu_model": "", "telemetry": None}]
    nodes[0]["telemetry"]["gpus"][0].update(off_bus=True, temp_c=None, util_gpu=None, power_w=None)
    headers, rows = format_gpu_rows(nodes)
    assert headers[:3] == ["NODE", "GPU", "NAME"] and headers[-1] == "HEALTH"
    assert rows[0] == ["gpu-a", "0", "NVIDIA H100 80GB HBM3", "-", "2.0/80 GiB", "-", "-", "0", "-", "-", "OFF BUS"]
    assert rows[1] == ["gpu-a", "1", "NVIDIA H100 80GB HBM3", "37%", "2.0/80 GiB", "41°C", "124/700 W", "0",
                       "-", "42", "ok"]
    assert rows[2][0] == "cpu-1" and rows[2][-1] == "no GPU telemetry"
