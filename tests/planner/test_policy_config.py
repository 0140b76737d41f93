"""Policy configuration as the daemon reads it from trainyard.toml."""

import tomllib

import pytest

from scheduler.planner import PolicyConfig, parse_duration

EXAMPLE = """
[scheduler]
policy = "fairshare"
grace_period = "2:00"
fairshare_half_life = "7-0"
default_time = "4:00:00"
topology_keys = ["switch", "rack"]

[scheduler.priority_weights]
age = 1000
fairshare = 20000
job_size = 100
queue = 50000
max_age = "14-0"

[queues.high]
priority = 10
preempts = ["low"]
max_time = "1-0"

[queues.low]
grace_period = 300
default_time = "1:00:00"

[queues.frozen]
state = "stopped"

[teams.vision]
nominal_gpus = 64
borrowing_limit_gpus = 32
lending_limit_gpus = 16
cohort = "research"
users = ["alice", "bob"]
fairshare = 2

[teams.speech]
nominal_gpus = 32
cohort = "research"
"""


def test_example_config_parses_into_typed_settings():
    p = PolicyConfig.from_dict(tomllib.loads(EXAMPLE))
    assert (p.name, p.order, p.backfill) == ("fairshare", "multifactor", True)
    assert p.grace_period_s == 120.0
    assert p.default_time_limit_s == 4 * 3600
    assert p.fairshare_half_life_s == 7 * 86400
    assert p.weights.fairshare == 20000 and p.weights.max_age_s == 14 * 86400
    assert p.queues["high"].preempts == ("low",)
    assert p.queues["high"].max_time_limit_s == 86400
    assert p.queues["low"].grace_period_s == 300
    assert p.queues["frozen"].open is False
    v = p.teams["vision"]
    assert (v.nominal_gpus, v.borrowing_limit_gpus, v.lending_limit_gpus, v.cohort) == (
        64, 32, 16, "research")
    assert p.user_team["alice"] == "vision"
    assert p.queue_views()["frozen"].open is False


def test_empty_config_is_the_default_backfill_policy():
    p = PolicyConfig.from_dict({})
    assert p == PolicyConfig.preset("backfill") and p.backfill


@pytest.mark.parametrize("name", ["fifo", "backfill", "fairshare", "las"])
def test_every_preset_is_available_by_name(name):
    assert PolicyConfig.from_dict({"scheduler": {"policy": name}}).name == name


@pytest.mark.parametrize("doc, words", [
    ({"scheduler": {"policy": "sjf"}}, "scheduler.policy: unknown policy 'sjf'"),
    ({"scheduler": {"grace_period": "soon"}}, "scheduler.grace_period: cannot read 'soon'"),
    ({"scheduler": {"backfil": True}}, "scheduler.backfil: unknown setting"),
    ({"scheduler": {"backfill": "yes"}}, "scheduler.backfill: expected true or false, got 'yes'"),
    ({"scheduler": {"priority_weights": {"age": -1}}}, "priority_weights.age: expected a number"),
    ({"queues": {"a": {"preempts": ["b"]}}}, "queues.a.preempts: no queue named 'b'"),
    ({"queues": {"a": {"state": "closed"}}}, "queues.a.state: expected \"open\" or \"stopped\""),
    ({"queues": {"a": {"priority": "high"}}}, "queues.a.priority: expected a whole number"),
    ({"queues": {"a": {"default_time": "2:00:00", "max_time": "1:00:00"}}}, "exceeds max_time"),
    ({"teams": {"t": {"nominal_gpus": -4}}}, "teams.t.nominal_gpus: .* got -4"),
    ({"teams": {"t": {"nominal_gpus": 4, "lending_limit_gpus": 8}}}, "exceeds nominal_gpus 4"),
    ({"teams": {"t": {"borrowing_limit_gpus": 8}}}, "need nominal_gpus"),
    ({"teams": {"t": {"users": ["a"]}, "u": {"users": ["a"]}}}, "already in team 't'"),
    ({"scheduler": {"las_thresholds_gpu_hours": [10, 1]}}, "strictly increasing"),
])
def test_bad_config_names_the_key_and_the_value(doc, words):
    with pytest.raises(ValueError, match=words):
        PolicyConfig.from_dict(doc)


@pytest.mark.parametrize("text, seconds", [
    ("90", 5400), ("1:30", 90), ("1:00:00", 3600), ("2-0", 172800), ("1-2:03:04", 93784),
    (45, 45), (2.5, 2.5),
])
def test_time_limits_read_like_slurms(text, seconds):
    assert parse_duration(text) == seconds


def test_the_example_in_docs_scheduling_md_parses():
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[2] / "docs" / "scheduling.md").read_text()
    block = re.search(r"```toml\n(.*?)```", doc, re.S).group(1)
    p = PolicyConfig.from_dict(tomllib.loads(block))
    assert p.teams["vision"].cohort == "research" and p.queues["high"].preempts == ("low",)
