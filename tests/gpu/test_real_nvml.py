"""The same telemetry code against real NVML (`make test-gpu` on a machine with NVIDIA GPUs).

Skips, naming what is missing, where there is no GPU; with TRAINYARD_REQUIRE_GPU=1 (as
`make test-gpu` sets it) a missing GPU fails the run instead.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from scheduler import agent
from scheduler.dcgm import format_gpu_rows, gpu_families
from scheduler.health import HealthRules, evaluate
from tests.conftest import agent_dir_for, ensure_job_account
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


# A few seconds of matrix products on GPU 0, in its own session as a job's processes are: the
# first library of these that this Python has does the work.
_LOAD = """
import sys, time
end = time.time() + float(sys.argv[1])
try:
    import torch
    a = torch.randn(8192, 8192, device="cuda:0", dtype=torch.bfloat16)
    print("ready", flush=True)
    while time.time() < end:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
except ImportError:
    import cupy
    a = cupy.random.rand(8192, 8192, dtype=cupy.float32)
    print("ready", flush=True)
    while time.time() < end:
        for _ in range(20):
            a = cupy.clip(a @ a, -1, 1)
        cupy.cuda.Device(0).synchronize()
"""


def _gpu_library() -> str | None:
    import importlib.util
    return next((m for m in ("torch", "cupy") if importlib.util.find_spec(m)), None)


def test_a_busy_gpu_reads_busy_and_its_process_is_the_jobs(real_gpus):
    """What an ops engineer reads off a node running a job: utilisation, tensor activity, power
    and memory up, and the process NVML sees attributed to the job that started it."""
    import subprocess
    import sys

    if _gpu_library() is None:
        pytest.skip("neither torch nor cupy is installed here to put a load on the GPU")
    idle = real_gpus.telemetry({})[0]
    load = subprocess.Popen([sys.executable, "-c", _LOAD, "20"], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        assert load.stdout.readline().strip() == "ready"
        time.sleep(2.0)
        real_gpus.telemetry({}, {load.pid: 7})  # GPM measures between two reads
        time.sleep(2.0)
        busy = real_gpus.telemetry({}, {load.pid: 7})[0]  # no allocation: the process names the job
    finally:
        load.kill()
        load.wait()
    keys = ("util_gpu", "power_w", "mem_used_mb", "prof_gr_engine_active", "prof_pipe_tensor_active",
            "sm_clock_mhz", "processes", "job_id")
    print("\nidle:", json.dumps({k: idle[k] for k in keys}))
    print("busy:", json.dumps({k: busy[k] for k in keys}))
    assert busy["mem_used_mb"] >= idle["mem_used_mb"] + 100  # the 8192² matrices at least
    if busy["util_gpu"] is not None:
        assert busy["util_gpu"] >= 50
    if busy["power_w"] is not None and idle["power_w"] is not None:
        assert busy["power_w"] > idle["power_w"]
    if busy["prof_gr_engine_active"] is not None:  # GPM (Hopper and later)
        assert busy["prof_gr_engine_active"] > 0.3
    if busy["processes"] is not None:
        # NVML names the process by the host's pid; inside a container that may not be ours
        mine = [p for p in busy["processes"] if p["pid"] == load.pid]
        if mine:
            assert busy["job_id"] == 7
            assert mine[0]["job_id"] == 7 and (mine[0]["used_mb"] is None or mine[0]["used_mb"] > 100)
        else:
            print("NVML's pids", [p["pid"] for p in busy["processes"]], "are not this namespace's",
                  load.pid)


def test_a_job_the_agent_runs_on_a_real_gpu_is_seen_on_it_and_ends_with_its_exit_code(real_gpus, tmp_path):
    """The agent as the daemon drives it: it starts the job on GPU 0, its telemetry shows the GPU
    busy with the job's process, and the job's end is reported with its exit code."""
    import sys

    if _gpu_library() is None:
        pytest.skip("neither torch nor cupy is installed here to put a load on the GPU")
    a = AgentProcess(Path(agent_dir_for(tmp_path, "gpu")), sim_gpus=None, telemetry_s=0.5)
    try:
        print("\nfencing:", json.dumps(a.hello.get("fencing")))
        # as root the agent starts jobs only as their owners (fenced where the node has cgroups)
        a.send(op="launch", key="9.0", job_id=9, argv=[sys.executable, "-c", _LOAD, "8"],
               env={"CUDA_VISIBLE_DEVICES": "0"}, gpus=[0], user=ensure_job_account() or None)
        started = a.wait_for("started", timeout=30)
        g = a.gpu(0, lambda g: g["processes"] and (g["util_gpu"] or 0) >= 50)
        shown = ("util_gpu", "power_w", "processes", "job_id")
        print("\nbusy under the agent:", json.dumps({k: g[k] for k in shown}))
        assert g["job_id"] == 9
        pids = [p["pid"] for p in g["processes"]]
        if started["pid"] in pids:  # NVML's pids are the host's: inside a container they may differ
            assert g["processes"][pids.index(started["pid"])]["job_id"] == 9
        assert a.wait_for("exited", lambda m: m.get("key") == "9.0", timeout=60)["rc"] == 0
        a.gpu(0, lambda g: not g["processes"] and g["job_id"] is None)  # the GPU is free again
    except AssertionError:
        print("the job's output:", a.request(op="log", id=99, key="9.0").get("data"))
        raise
    finally:
        a.close()


_OPEN_GPU0 = """
import errno, os
try:
    os.close(os.open("/dev/nvidia0", os.O_RDWR))
    print("opened")
except OSError as e:
    print(errno.errorcode[e.errno])
"""


def test_a_job_not_given_the_gpu_cannot_open_it_where_the_node_fences_devices(real_gpus, tmp_path):
    """On the real driver's device file: the agent's fence (v1's devices cgroup, or on a pure
    cgroup v2 host its eBPF device program) refuses GPU 0 to a job allocated none, and lets the
    job allocated it open it (the probe is the system's python3: the job's account may not
    read this suite's virtual environment)."""
    a = AgentProcess(Path(agent_dir_for(tmp_path, "gpu")), sim_gpus=None, telemetry_s=5)
    try:
        fencing = a.hello.get("fencing") or {}
        print("\nfencing:", json.dumps(fencing))
        if not fencing.get("devices"):
            pytest.skip("this GPU host's agent fences no devices: "
                        + (fencing.get("reason") or "it does not run as root"))
        user = ensure_job_account() or None
        seen = {}
        for key, job_id, gpus in (("10.0", 10, []), ("11.0", 11, [0])):
            a.send(op="launch", key=key, job_id=job_id, argv=["python3", "-c", _OPEN_GPU0],
                   gpus=gpus, user=user)
            assert a.wait_for("exited", lambda m, k=key: m.get("key") == k, timeout=30)["rc"] == 0
            seen[key] = a.request(op="log", id=job_id, key=key)["data"].strip()
        print("without GPU 0:", seen["10.0"], "with it:", seen["11.0"])
        assert seen == {"10.0": "EPERM", "11.0": "opened"}
    finally:
        a.close()
