"""The agent's Gpus against a fake NVML: every field, every scenario, never a crash."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from scheduler import agent
from tests.gpu import fake_pynvml
from tests.gpu.fake_pynvml import MIB, ProcessInfo


def gpus_with(monkeypatch, scenario: str, declared: int = 0, gpus: int = 4):
    monkeypatch.delenv("TRAINYARD_SIM_GPUS", raising=False)
    nvml = fake_pynvml.scenario(scenario, gpus=gpus)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    return agent.Gpus(declared, "NVIDIA A100-SXM4-80GB"), nvml


def test_healthy_gpus_report_every_field(monkeypatch):
    gpus, _ = gpus_with(monkeypatch, "healthy")
    assert gpus.source == "nvml"
    assert gpus.note == "4 GPUs from NVML (driver 550.54.15)"
    assert gpus.describe() == [{"index": i, "name": "NVIDIA H100 80GB HBM3"} for i in range(4)]
    tel = gpus.telemetry({1: 42})
    assert [g["index"] for g in tel] == [0, 1, 2, 3]
    assert all(set(g) == set(agent.GPU_FIELDS) for g in tel)
    g = tel[1]
    assert g["uuid"] == "GPU-fake-0001" and g["pci_bus_id"] == "00000000:19:00.0"
    assert (g["util_gpu"], g["util_mem"]) == (37, 12)
    assert (g["mem_total_mb"], g["mem_used_mb"]) == (81559, 2048)
    assert (g["temp_c"], g["power_w"], g["power_limit_w"], g["sm_clock_mhz"]) == (41, 123.5, 700.0, 1980)
    assert (g["ecc_sbe_volatile"], g["ecc_dbe_volatile"], g["ecc_sbe_aggregate"], g["ecc_dbe_aggregate"]) == (5, 0, 17, 0)
    assert g["ecc_dbe"] == 0
    assert (g["remap_pending"], g["remap_failure"]) == (False, False)
    assert (g["xid"], g["xid_events"], g["off_bus"]) == (None, [], False)
    assert (g["mig_mode"], g["mig_instances"], g["processes"]) == (False, [], [])
    assert g["job_id"] == 42 and tel[0]["job_id"] is None


def test_the_rest_of_dcgm_exporters_default_counters_come_from_nvml(monkeypatch):
    gpus, _ = gpus_with(monkeypatch, "healthy")
    g = gpus.telemetry({})[2]
    assert (g["mem_clock_mhz"], g["mem_temp_c"], g["energy_mj"], g["pcie_replay"]) == (
        2619, 48, 10**9 + 2, 2)
    assert (g["util_enc"], g["util_dec"]) == (0, 3)
    assert (g["mem_reserved_mb"], g["power_mgmt_limit_w"]) == (512, 650.0)


def test_profiling_ratios_are_measured_between_two_reads_of_gpm(monkeypatch):
    gpus, nvml = gpus_with(monkeypatch, "healthy")
    first = gpus.telemetry({})[0]
    # GPM measures over the time between two samples: the first read has nothing to compare
    assert (first["prof_gr_engine_active"], first["prof_pipe_tensor_active"],
            first["prof_dram_active"]) == (None, None, None)
    nvml.gpus[0]["gpm_pct"][nvml.NVML_GPM_METRIC_ANY_TENSOR_UTIL] = 87.5
    second = gpus.telemetry({})[0]
    # DCGM's PROF_* fields are ratios of 1; GPM answers in percent
    assert (second["prof_gr_engine_active"], second["prof_pipe_tensor_active"],
            second["prof_dram_active"]) == (0.615, 0.875, 0.3025)
    gpus.telemetry({})
    assert nvml.calls.count("nvmlGpmSampleAlloc") == 4 * 2  # two samples per GPU, reused


def test_a_gpu_without_gpm_reports_no_profiling_ratios_and_is_not_asked_again(monkeypatch):
    gpus, nvml = gpus_with(monkeypatch, "healthy")
    for g in nvml.gpus:
        g["gpm"] = False
    for _ in range(3):
        tel = gpus.telemetry({})
    assert all(g["prof_gr_engine_active"] is None and g["mem_clock_mhz"] == 2619 for g in tel)
    assert nvml.calls.count("nvmlGpmQueryDeviceSupport") == 4
    assert "nvmlGpmSampleGet" not in nvml.calls


def test_a_gpu_whose_gpm_sampling_fails_is_not_sampled_again(monkeypatch):
    gpus, nvml = gpus_with(monkeypatch, "healthy")
    nvml.unsupported.add("nvmlGpmSampleGet")  # as on a GPU in MIG mode
    for _ in range(3):
        g = gpus.telemetry({})[0]
    assert g["prof_gr_engine_active"] is None and g["mem_clock_mhz"] == 2619
    assert nvml.calls.count("nvmlGpmSampleGet") == 4  # once per GPU
    assert nvml.calls.count("nvmlGpmSampleFree") == nvml.calls.count("nvmlGpmSampleAlloc") == 4


def test_a_hot_gpu_reports_its_temperature(monkeypatch):
    gpus, _ = gpus_with(monkeypatch, "hot")
    assert [g["temp_c"] for g in gpus.telemetry({})] == [41, 96, 41, 41]


def test_an_xid_arrives_once_as_an_event_and_stays_as_the_last_xid(monkeypatch):
    gpus, nvml = gpus_with(monkeypatch, "xid79")
    first = gpus.telemetry({})
    assert first[2]["xid_events"] == [79] and first[2]["xid"] == 79
    assert first[0]["xid_events"] == [] and first[0]["xid"] is None
    second = gpus.telemetry({})
    assert second[2]["xid_events"] == [] and second[2]["xid"] == 79
    nvml.queue_xid(2, 48)
    nvml.queue_xid(2, 63)
    assert gpus.telemetry({})[2]["xid_events"] == [48, 63]
    assert "nvmlEventSetWait_v2" in nvml.calls  # polled; the fake refuses any timeout but 0


def test_double_bit_ecc_errors_are_counted(monkeypatch):
    gpus, _ = gpus_with(monkeypatch, "ecc_dbe")
    g = gpus.telemetry({})[0]
    assert (g["ecc_dbe_volatile"], g["ecc_dbe_aggregate"], g["ecc_dbe"]) == (2, 2, 2)


def test_a_row_remapping_failure_is_reported(monkeypatch):
    gpus, _ = gpus_with(monkeypatch, "remap_failure")
    g = gpus.telemetry({})[3]
    assert (g["remap_correctable"], g["remap_uncorrectable"], g["remap_pending"], g["remap_failure"]) == (1, 3, False, True)


def test_fields_the_driver_does_not_support_are_missing_not_fatal(monkeypatch):
    gpus, _ = gpus_with(monkeypatch, "not_supported")
    tel = gpus.telemetry({})
    g = tel[0]
    assert set(g) == set(agent.GPU_FIELDS)
    assert g["name"] == "NVIDIA H100 80GB HBM3" and g["mem_total_mb"] == 81559
    for key in ("util_gpu", "util_mem", "temp_c", "power_w", "power_limit_w", "sm_clock_mhz",
                "ecc_sbe_volatile", "ecc_dbe_volatile", "ecc_dbe", "remap_pending", "remap_failure",
                "mig_mode", "mig_instances", "processes", "xid_events", "pci_bus_id",
                "mem_temp_c", "energy_mj", "pcie_replay", "util_enc", "util_dec",
                "mem_reserved_mb", "power_mgmt_limit_w", "prof_gr_engine_active"):
        assert g[key] is None, key
    assert g["off_bus"] is False


def test_an_unexpected_error_from_one_query_only_blanks_that_field(monkeypatch):
    gpus, nvml = gpus_with(monkeypatch, "healthy")

    def broken(h, clock):
        raise RuntimeError("driver hiccup")

    nvml.nvmlDeviceGetClockInfo = broken
    g = gpus.telemetry({})[0]
    assert g["sm_clock_mhz"] is None and g["temp_c"] == 41


def test_a_gpu_lost_at_start_is_not_offered_and_reports_off_bus(monkeypatch):
    gpus, _ = gpus_with(monkeypatch, "gpu_lost")
    assert [d["index"] for d in gpus.describe()] == [0, 2, 3]
    g = gpus.telemetry({})[1]
    assert g["off_bus"] is True
    assert all(g[k] is None for k in ("util_gpu", "temp_c", "mem_used_mb", "power_w", "ecc_dbe_volatile"))


def test_a_gpu_that_falls_off_the_bus_while_running(monkeypatch):
    gpus, nvml = gpus_with(monkeypatch, "healthy")
    assert gpus.telemetry({})[2]["off_bus"] is False
    nvml.lose(2)
    tel = gpus.telemetry({2: 7})
    assert tel[2]["off_bus"] is True and tel[2]["temp_c"] is None and tel[2]["job_id"] == 7
    assert tel[2]["name"] == "NVIDIA H100 80GB HBM3"  # still named, so the operator knows which
    assert tel[1]["off_bus"] is False and tel[1]["temp_c"] == 41
    assert [d["index"] for d in gpus.describe()] == [0, 1, 3]


def test_mig_mode_and_its_instances(monkeypatch):
    gpus, _ = gpus_with(monkeypatch, "mig")
    tel = gpus.telemetry({})
    assert tel[0]["mig_mode"] is True
    assert tel[0]["mig_instances"] == [
        {"index": 0, "uuid": "MIG-fake-0-0", "mem_total_mb": 9856, "mem_used_mb": 13},
        {"index": 1, "uuid": "MIG-fake-0-1", "mem_total_mb": 9856, "mem_used_mb": 13}]
    assert tel[1]["mig_mode"] is False and tel[1]["mig_instances"] == []


def test_nvml_library_missing_falls_back_to_the_declared_gpus_and_says_why(monkeypatch):
    gpus, _ = gpus_with(monkeypatch, "library_missing", declared=8)
    assert gpus.source == "declared"
    assert gpus.note == ("NVML unavailable: NVML Shared Library Not Found; "
                         "using the 8 GPUs declared for this node (no telemetry)")
    assert gpus.describe() == [{"index": i, "name": "NVIDIA A100-SXM4-80GB"} for i in range(8)]
    g = gpus.telemetry({3: 9})[3]
    assert g["job_id"] == 9 and g["temp_c"] is None and set(g) == set(agent.GPU_FIELDS)


def test_no_nvml_and_nothing_declared_means_no_gpus(monkeypatch):
    gpus, _ = gpus_with(monkeypatch, "library_missing")
    assert (gpus.source, gpus.count, gpus.describe(), gpus.telemetry({})) == ("none", 0, [], [])
    assert gpus.note == "NVML unavailable: NVML Shared Library Not Found; no GPUs declared for this node"


def test_pynvml_not_installed(monkeypatch):
    monkeypatch.delenv("TRAINYARD_SIM_GPUS", raising=False)
    monkeypatch.setitem(sys.modules, "pynvml", None)  # `import pynvml` raises ImportError
    gpus = agent.Gpus(2, "L4")
    assert gpus.source == "declared"
    assert gpus.note.startswith("pynvml (nvidia-ml-py) is not installed; using the 2 GPUs declared")


@pytest.fixture
def job_group():
    """A job as the agent's wrapper starts it: its own session, a child process inside it."""
    p = subprocess.Popen(["sh", "-c", "sleep 30 & echo $!; wait"], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    child = int(p.stdout.readline())
    yield p.pid, child
    os.killpg(p.pid, signal.SIGKILL)  # the group this test started, child included
    p.wait()


def test_gpu_processes_are_mapped_to_the_job_whose_process_group_holds_them(monkeypatch, job_group):
    leader, child = job_group
    gpus, nvml = gpus_with(monkeypatch, "healthy")
    nvml.processes[0] = [ProcessInfo(child, 30000 * MIB)]
    nvml.processes[1] = [ProcessInfo(1, None)]  # not ours (and no memory figure, as on WDDM)
    tel = gpus.telemetry({}, job_pids={leader: 42})
    assert tel[0]["processes"] == [{"pid": child, "used_mb": 30000, "job_id": 42}]
    assert tel[0]["job_id"] == 42  # the GPU is busy with job 42 even if nobody told the agent
    assert tel[1]["processes"] == [{"pid": 1, "used_mb": None, "job_id": None}]
    assert tel[1]["job_id"] is None


def test_a_gpu_that_comes_back_after_a_reset_reports_again(monkeypatch):
    gpus, nvml = gpus_with(monkeypatch, "healthy")
    nvml.lose(0)
    assert gpus.telemetry({})[0]["off_bus"] is True
    nvml.lost.clear()
    nvml.queue_xid(0, 94)
    g = gpus.telemetry({})[0]
    assert (g["off_bus"], g["temp_c"], g["xid_events"]) == (False, 41, [94])
