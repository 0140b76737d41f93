"""Faults injected into the demo's simulated GPUs, through a real agent process, as the daemon
would send them; and the health verdicts they lead to."""

from __future__ import annotations

from scheduler.health import HealthRules, TelemetryHistory, evaluate
from tests.gpu.conftest import AgentProcess


def test_hello_says_where_the_gpus_come_from(sim_agent):
    assert sim_agent.hello["gpu_source"] == "simulated"
    assert sim_agent.hello["gpu_note"] == "4 simulated GPUs (TRAINYARD_SIM_GPUS)"


def test_simulated_telemetry_has_every_field(sim_agent):
    from scheduler.agent import GPU_FIELDS

    msg = sim_agent.wait_for("telemetry")
    assert msg["source"] == "simulated"
    assert [set(g) for g in msg["gpus"]] == [set(GPU_FIELDS)] * 4
    g = msg["gpus"][0]
    assert (g["off_bus"], g["xid"], g["xid_events"], g["ecc_dbe"], g["remap_failure"]) == (False, None, [], 0, False)


def test_an_injected_xid_shows_once_as_an_event_and_drains(sim_agent):
    assert sim_agent.request(op="fault", id=1, gpu=1, kind="xid", value=79) == {
        "ev": "fault", "id": 1, "ok": True, "gpu": 1, "kind": "xid"}
    history = TelemetryHistory(maxlen=50)
    msg = sim_agent.wait_for("telemetry", lambda m: m["gpus"][1]["xid_events"])
    history.add("sim-1", msg)
    assert msg["gpus"][1]["xid_events"] == [79] and msg["gpus"][1]["xid"] == 79
    later = sim_agent.wait_for("telemetry")
    history.add("sim-1", later)
    assert later["gpus"][1]["xid_events"] == [] and later["gpus"][1]["xid"] == 79
    (v,) = evaluate(HealthRules(), "sim-1", history.samples("sim-1"), now=later["time"])
    assert (v.gpu, v.action, v.reason) == (1, "drain_node", "GPU 1: XID 79 (GPU has fallen off the bus)")


def test_injected_ecc_and_off_bus_and_clear(sim_agent):
    sim_agent.request(op="fault", id=1, gpu=0, kind="ecc_dbe")
    sim_agent.request(op="fault", id=2, gpu=0, kind="ecc_dbe", value=2)
    g = sim_agent.gpu(0, lambda g: g["ecc_dbe"])
    assert (g["ecc_dbe"], g["ecc_dbe_volatile"]) == (3, 3)
    sim_agent.request(op="fault", id=3, gpu=3, kind="off_bus")
    msg = sim_agent.wait_for("telemetry", lambda m: m["gpus"][3]["off_bus"])
    g = msg["gpus"][3]
    assert g["uuid"] and g["name"] == "NVIDIA H100 80GB HBM3"
    assert all(g[k] is None for k in ("util_gpu", "temp_c", "mem_used_mb", "power_w", "ecc_dbe"))
    reasons = [v.reason for v in evaluate(HealthRules(), "sim-1", [msg], now=msg["time"])]
    assert reasons == ["GPU 0: 3 double-bit ECC errors (uncorrectable)",
                       "GPU 3: fell off the bus (NVML: GPU is lost)"]
    sim_agent.request(op="fault", id=4, gpu=3, kind="clear")
    sim_agent.request(op="fault", id=5, gpu=0, kind="clear")
    msg = sim_agent.wait_for("telemetry", lambda m: not m["gpus"][3]["off_bus"] and not m["gpus"][0]["ecc_dbe"])
    assert msg["gpus"][3]["temp_c"] is not None
    assert evaluate(HealthRules(), "sim-1", [msg], now=msg["time"]) == []


def test_an_injected_temperature_holds_until_cleared(sim_agent):
    sim_agent.request(op="fault", id=1, gpu=2, kind="temp", value=95)
    first = sim_agent.wait_for("telemetry", lambda m: m["gpus"][2]["temp_c"] == 95)
    second = sim_agent.wait_for("telemetry")
    assert second["gpus"][2]["temp_c"] == 95 and second["time"] > first["time"]
    rules = HealthRules(temp_period_s=0)
    (v,) = evaluate(rules, "sim-1", [first, second], now=second["time"])
    assert v.reason.startswith("GPU 2: temperature 95 °C over 90 °C for ")


def test_a_bad_fault_is_refused_with_a_reason(sim_agent):
    assert "has no GPU 9 (it has 4: 0-3)" in sim_agent.request(op="fault", id=1, gpu=9, kind="xid", value=79)["error"]
    assert sim_agent.request(op="fault", id=2, gpu=0, kind="melt")["error"] == (
        "unknown fault 'melt'; use one of xid, ecc_dbe, temp, off_bus, remap_pending, clear")
    assert sim_agent.request(op="fault", id=3, gpu=0, kind="xid")["error"] == "fault xid needs a whole number, not None"
    assert sim_agent.request(op="ping", id=4) == {"ev": "pong", "id": 4}  # the agent lives on


def test_fault_injection_is_refused_on_a_node_with_real_or_declared_gpus(tmp_path):
    a = AgentProcess(tmp_path / "agent", sim_gpus=None, declared=2)
    try:
        # this machine: pynvml present, no driver -> declared; a GPU machine -> nvml
        assert a.hello["gpu_source"] in ("declared", "nvml")
        if a.hello["gpu_source"] == "declared":
            assert "using the 2 GPUs declared for this node" in a.hello["gpu_note"]
        answer = a.request(op="fault", id=7, gpu=0, kind="xid", value=79)
        assert answer["ev"] == "error"
        assert answer["error"].startswith("fault injection works only on simulated GPUs; ")
        assert answer["error"].endswith(("has real ones", "has declared ones without telemetry"))
    finally:
        a.close()


def test_processes_of_a_running_job_are_mapped_to_it(sim_agent):
    sim_agent.send(op="launch", key="8.0", job_id=8, argv=["sleep", "30"], gpus=[1])
    started = sim_agent.wait_for("started")
    g = sim_agent.gpu(1, lambda g: g["processes"])
    assert g["job_id"] == 8
    assert g["processes"][0]["pid"] == started["pid"] and g["processes"][0]["job_id"] == 8
    sim_agent.send(op="signal", key="8.0", sig="KILL")
    sim_agent.wait_for("exited")


def test_each_simulated_node_has_gpus_of_its_own(tmp_path):
    a = AgentProcess(tmp_path / "a", sim_gpus=2, env={"TRAINYARD_SIM_NODE": "sim-a"})
    b = AgentProcess(tmp_path / "b", sim_gpus=2, env={"TRAINYARD_SIM_NODE": "sim-b"})
    try:
        assert [g["uuid"] for g in a.wait_for("telemetry")["gpus"]] == ["GPU-sim-sim-a-0", "GPU-sim-sim-a-1"]
        assert [g["uuid"] for g in b.wait_for("telemetry")["gpus"]] == ["GPU-sim-sim-b-0", "GPU-sim-sim-b-1"]
        assert a.request(op="fault", id=1, gpu=2, kind="off_bus")["error"] == "sim-a has no GPU 2 (it has 2: 0-1)"
    finally:
        a.close()
        b.close()
