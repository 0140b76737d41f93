"""The same telemetry code against real NVML (`make test-gpu` on a machine with NVIDIA GPUs).

Skips, naming what is missing, where there is no GPU; with TRAINYARD_REQUIRE_GPU=1 (as
`make test-gpu` sets it) a missing GPU fails the run instead.
"""

from __future__ import annotations

import json
import os
import time

import pytest

from scheduler import agent
from scheduler.dcgm import format_gpu_rows, gpu_families
from scheduler.health import HealthRules, evaluate
from tests.gpu.conftest import AgentProcess

pytestmark = pytest.mark.gpu


def _why_no_gpu() -> str | None:
    try:
        import pynvml
    except ImportError:
        return "pynvml (nvidia-ml-py) is not installed"
    try:
        pynvml.nvmlInit()
    except Exception as e:
        return f"no NVIDIA driver here (NVML: {e})"
    try:
        if pynvml.nvmlDeviceGetCount() == 0:
            return "NVML sees no GPUs"
    finally:
        pynvml.nvmlShutdown()
    return None


@pytest.fixture(scope="module")
def real_gpus():
    why = _why_no_gpu()
    if why:
        if os.environ.get("TRAINYARD_REQUIRE_GPU") == "1":
            pytest.fail(f"TRAINYARD_REQUIRE_GPU=1 but {why}")
        pytest.skip(f"no NVIDIA GPU: {why}")
    saved = os.environ.pop("TRAINYARD_SIM_GPUS", None)
    try:
        yield agent.Gpus(0, "")
    finally:
        if saved is not None:
            os.environ["TRAINYARD_SIM_GPUS"] = saved


def test_real_gpus_are_read_through_nvml(real_gpus):
    assert real_gpus.source == "nvml", real_gpus.note
    assert real_gpus.count >= 1 and real_gpus.describe()
    tel = real_gpus.telemetry({})
    print("\nnote:", real_gpus.note)
    for g in tel:
        print(json.dumps(g, sort_keys=True))
        assert set(g) == set(agent.GPU_FIELDS)
        assert g["name"] and g["uuid"].startswith(("GPU-", "MIG-"))
        assert g["mem_total_mb"] > 0 and 0 <= g["mem_used_mb"] <= g["mem_total_mb"]
        assert g["off_bus"] is False
        assert g["temp_c"] is None or 0 < g["temp_c"] < 130
        assert g["util_gpu"] is None or 0 <= g["util_gpu"] <= 100
        assert g["power_w"] is None or g["power_w"] >= 0
        assert g["xid_events"] is None or isinstance(g["xid_events"], list)
        assert g["processes"] is None or isinstance(g["processes"], list)
    missing = sorted({k for g in tel for k, v in g.items() if v is None and k != "job_id"})
    print("fields this driver left missing:", ", ".join(missing) or "none")


def test_profiling_ratios_come_from_gpm_on_a_second_read_where_the_gpu_has_it(real_gpus):
    import pynvml

    real_gpus.telemetry({})
    time.sleep(1.0)
    tel = real_gpus.telemetry({})
    for g in tel:
        try:
            gpm = bool(pynvml.nvmlGpmQueryDeviceSupport(
                pynvml.nvmlDeviceGetHandleByIndex(g["index"])).isSupportedDevice)
        except pynvml.NVMLError:
            gpm = False
        ratios = [g["prof_gr_engine_active"], g["prof_pipe_tensor_active"], g["prof_dram_active"]]
        print(f"\nGPU {g['index']}: GPM {'supported' if gpm else 'not supported'}; "
              f"PROF_GR_ENGINE_ACTIVE, PROF_PIPE_TENSOR_ACTIVE, PROF_DRAM_ACTIVE = {ratios}")
        if gpm:  # Hopper and later: measured between the two reads, as ratios of 1
            assert all(r is not None and 0.0 <= r <= 1.0 for r in ratios), ratios
        else:
            assert ratios == [None, None, None]
        assert g["mem_clock_mhz"]  # every NVIDIA GPU reports its memory clock


def test_real_telemetry_feeds_the_rules_and_the_metrics(real_gpus):
    tel = real_gpus.telemetry({})
    sample = {"time": 1000.0, "gpus": tel}
    for v in evaluate(HealthRules(), "this-node", [sample], now=1000.0):
        print("health verdict:", v.reason)  # a real fault here would be news worth reading
    fams = {f.name: f for f in gpu_families("this-node", "", tel)}
    assert len(fams["DCGM_FI_DEV_FB_USED"].samples) == len(tel)
    headers, rows = format_gpu_rows([{"name": "this-node", "telemetry": sample}])
    print("  ".join(headers))
    for row in rows:
        print("  ".join(row))
    assert len(rows) == len(tel)


def test_the_agent_process_reports_real_gpus_and_refuses_faults(real_gpus, tmp_path):
    a = AgentProcess(tmp_path / "agent", sim_gpus=None, telemetry_s=0.5)
    try:
        assert a.hello["gpu_source"] == "nvml", a.hello["gpu_note"]
        print("\nhello:", json.dumps({k: a.hello[k] for k in ("gpu_source", "gpu_model", "gpus", "gpu_note")}))
        msg = a.wait_for("telemetry")
        assert [g["index"] for g in msg["gpus"]] == list(range(real_gpus.count))
        answer = a.request(op="fault", id=1, gpu=0, kind="xid", value=79)
        assert answer["ev"] == "error" and answer["error"].endswith("has real ones")
    finally:
        a.close()
