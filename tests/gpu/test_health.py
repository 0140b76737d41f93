"""The health rules: which telemetry drains a node or excludes a GPU, and the reason shown."""

from __future__ import annotations

import pytest

from scheduler.health import HealthRules, TelemetryHistory, Verdict, evaluate
from scheduler.settings import Settings


def gpu(index=0, **fields):
    g = {"index": index, "temp_c": 50, "xid_events": [], "ecc_dbe_volatile": 0, "ecc_dbe": 0,
         "remap_failure": False, "off_bus": False}
    g.update(fields)
    return g


def sample(t, *gpus):
    return {"time": t, "gpus": list(gpus) or [gpu(0), gpu(1)]}


RULES = HealthRules()


def test_a_healthy_node_has_no_verdicts():
    assert evaluate(RULES, "n1", [sample(0), sample(5)], now=5) == []
    assert evaluate(RULES, "n1", [], now=5) == []


def test_a_fatal_xid_drains_the_node_naming_the_gpu_and_the_meaning():
    history = [sample(0), sample(5, gpu(0), gpu(3, xid_events=[79])), sample(10, gpu(0), gpu(3))]
    assert evaluate(RULES, "n1", history, now=10) == [
        Verdict(gpu=3, action="drain_node", reason="GPU 3: XID 79 (GPU has fallen off the bus)",
                key="gpu3:xid79@5", node="n1", rule="xid")]


def test_a_non_fatal_xid_is_only_telemetry():
    assert evaluate(RULES, "n1", [sample(0, gpu(0, xid_events=[13, 31]))], now=0) == []


def test_a_second_xid_later_is_a_new_cause():
    history = [sample(0, gpu(0, xid_events=[48])), sample(5, gpu(0)), sample(10, gpu(0, xid_events=[48]))]
    first = evaluate(RULES, "n1", history[:2], now=5)
    again = evaluate(RULES, "n1", history, now=10)
    assert first[0].reason == again[0].reason == "GPU 0: XID 48 (double-bit ECC error)"
    assert first[0].key != again[0].key


def test_double_bit_ecc_errors_drain():
    (v,) = evaluate(RULES, "n1", [sample(0, gpu(0), gpu(1, ecc_dbe_volatile=2))], now=0)
    assert (v.gpu, v.action, v.reason) == (1, "drain_node", "GPU 1: 2 double-bit ECC errors (uncorrectable)")


def test_a_row_remapping_failure_drains():
    (v,) = evaluate(RULES, "n1", [sample(0, gpu(2, remap_failure=True))], now=0)
    assert v.reason == "GPU 2: row remapping failed (the GPU needs a reset or repair)"


def test_a_gpu_off_the_bus_drains_and_comes_first():
    (v, x) = evaluate(RULES, "n1", [sample(0, gpu(5, off_bus=True, temp_c=None, xid_events=[79]))], now=0)
    assert v.reason == "GPU 5: fell off the bus (NVML: GPU is lost)" and v.rule == "off_bus"
    assert x.rule == "xid"


def test_off_bus_is_judged_by_the_latest_sample_only():
    history = [sample(0, gpu(0, off_bus=True)), sample(5, gpu(0))]
    assert evaluate(RULES, "n1", history, now=5) == []


def hot(temps, step=5):
    return [sample(i * step, gpu(0, temp_c=t)) for i, t in enumerate(temps)]


def test_temperature_must_stay_over_the_threshold_for_the_period():
    assert evaluate(RULES, "n1", hot([95] * 12), now=55) == []  # 55 s over 90 °C
    (v,) = evaluate(RULES, "n1", hot([95] * 13), now=60)       # 60 s
    assert v.reason == "GPU 0: temperature 95 °C over 90 °C for 60 s" and v.action == "drain_node"


def test_one_cool_sample_restarts_the_period():
    temps = [95] * 6 + [85] + [95] * 8
    assert evaluate(RULES, "n1", hot(temps), now=70) == []
    assert evaluate(RULES, "n1", hot(temps + [95] * 5), now=95)[0].reason.endswith("for 60 s")


def test_a_missing_temperature_does_not_count_as_hot():
    assert evaluate(RULES, "n1", hot([95] * 6 + [None] + [95] * 8), now=70) == []


def test_exactly_at_the_threshold_is_not_over_it():
    assert evaluate(RULES, "n1", hot([90] * 20), now=95) == []


def test_samples_after_now_are_ignored():
    assert evaluate(RULES, "n1", [sample(0), sample(100, gpu(0, xid_events=[79]))], now=50) == []


def test_actions_are_configurable_per_rule():
    rules = Settings.from_toml({"health": {"xid": "exclude_gpu", "ecc_dbe": "off", "temp_c": 80,
                                           "temp_period_s": 10, "fatal_xids": [13]}}).to_health()
    history = [sample(0, gpu(1, xid_events=[13, 79], ecc_dbe_volatile=1, temp_c=85)),
               sample(10, gpu(1, temp_c=85))]
    got = {(v.rule, v.action, v.reason) for v in evaluate(rules, "n1", history, now=10)}
    assert got == {("xid", "exclude_gpu", "GPU 1: XID 13 (graphics engine exception)"),
                   ("temp", "drain_node", "GPU 1: temperature 85 °C over 80 °C for 10 s")}


def test_defaults():
    assert RULES.fatal_xids == {48, 63, 64, 74, 79, 92, 94, 95}
    assert (RULES.temp_c, RULES.temp_period_s, RULES.history_samples) == (90, 60, 300)
    assert {RULES.xid, RULES.ecc_dbe, RULES.remap_failure, RULES.off_bus, RULES.temp} == {"drain_node"}
    assert Settings.from_toml({}).to_health() == RULES


# ---------------------------------------------------------------- history

def test_history_is_bounded_per_node():
    h = TelemetryHistory(maxlen=5)
    for t in range(8):
        h.add("n1", sample(t, gpu(0, temp_c=40 + t), gpu(1, temp_c=60)))
    h.add("n2", sample(0))
    assert [s["time"] for s in h.samples("n1")] == [3, 4, 5, 6, 7]
    assert len(h.samples("n2")) == 1 and h.samples("unknown") == []
    assert h.series("n1", 0, "temp_c") == [43, 44, 45, 46, 47]
    assert h.series("n1", 0, "temp_c", 2) == [46, 47]
    assert h.series("n1", 1, "temp_c", 10) == [60] * 5
    assert h.series("n1", 7, "temp_c") == [None] * 5  # no such GPU: gaps, not an error
    assert h.nodes() == ["n1", "n2"]
    h.forget("n2")
    assert h.nodes() == ["n1"]


def test_history_keeps_what_the_rules_and_sparklines_need():
    h = TelemetryHistory(maxlen=3)
    h.add("n1", {"time": 1, "gpus": [gpu(0, xid_events=[79], uuid="GPU-x", processes=[{"pid": 1}])]})
    (s,) = h.samples("n1")
    assert s["gpus"][0]["xid_events"] == [79] and "processes" not in s["gpus"][0]
    assert evaluate(RULES, "n1", h.samples("n1"), now=1)[0].reason.startswith("GPU 0: XID 79")


def test_a_history_needs_room():
    with pytest.raises(ValueError):
        TelemetryHistory(maxlen=0)


def _random_sample(rng, t):
    gpus = []
    for i in range(rng.choice((2, 3, 3, 3))):  # a GPU sometimes missing from a sample
        if rng.random() < 0.05:
            continue
        gpus.append(gpu(i, temp_c=rng.choice((50, 85, 91, 95, None)),
                        xid_events=rng.choice(([], [], [], [], [13], [79], [48, 31], [94])),
                        ecc_dbe_volatile=rng.choice((0, 0, 0, 0, 0, 1, 2, None)),
                        ecc_dbe=rng.choice((0, 0, 3)), remap_failure=rng.random() < 0.03,
                        off_bus=rng.random() < 0.03))
    return {"time": t, "gpus": gpus}


@pytest.mark.parametrize("seed", range(6))
def test_the_incremental_tracker_gives_what_the_rules_give_over_the_window(seed):
    """The daemon's O(GPUs)-per-sample tracker answers exactly what `evaluate` answers over the
    last `history_samples` samples, sample after sample (causes entering and leaving the window,
    temperature runs longer than the window, GPUs that come and go)."""
    import random

    from scheduler.health import HealthTracker

    rng = random.Random(seed)
    rules = HealthRules(history_samples=rng.choice((5, 20, 40)), temp_period_s=rng.choice((10, 30)),
                        ecc_dbe=rng.choice(("drain_node", "exclude_gpu", "off")))
    tracker = HealthTracker(rules)
    history, t, differed = [], 1000.0, 0
    for _ in range(400):
        t += rng.choice((1, 2, 5))
        s = _random_sample(rng, t)
        history = (history + [s])[-rules.history_samples:]
        got = tracker.observe("n1", s)
        assert got == evaluate(rules, "n1", history, now=t), (len(history), s)
        differed += bool(got)
    assert differed > 20  # the random telemetry did raise verdicts to compare


def test_the_tracker_keeps_a_temperature_run_across_the_window_and_forgets_a_node():
    from scheduler.health import HealthTracker

    rules = HealthRules(history_samples=4, temp_period_s=5)
    tracker = HealthTracker(rules)
    for t in range(10, 30, 2):
        verdicts = tracker.observe("n1", sample(t, gpu(0, temp_c=95)))
    assert [v.reason for v in verdicts] == ["GPU 0: temperature 95 °C over 90 °C for 6 s"]
    assert tracker.observe("n1", sample(30, gpu(0, temp_c=60))) == []
    tracker.forget("n1")
    assert tracker.verdicts("n1") == []
