"""Policy configuration as the daemon reads it from trainyard.toml (scheduler.settings builds the
planner's frozen PolicyConfig: one parser, one duration reader)."""

import tomllib

import pytest

from scheduler.planner import PolicyConfig
from scheduler.settings import Settings, SettingsError
from scheduler.units import parse_duration


def policy_of(doc: dict) -> PolicyConfig:
    return Settings.from_toml(doc).to_policy()

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
    p = policy_of(tomllib.loads(EXAMPLE))
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
    p = policy_of({})
    assert p == PolicyConfig.preset("backfill") and p.backfill


@pytest.mark.parametrize("name", ["fifo", "backfill", "fairshare", "las", "las-budget", "qssf"])
def test_every_preset_is_available_by_name(name):
    assert policy_of({"scheduler": {"policy": name}}) == PolicyConfig.preset(name)


@pytest.mark.parametrize("doc, key", [
    ({"scheduler": {"policy": "sjf"}}, "scheduler.policy"),
    ({"scheduler": {"grace_period": "soon"}}, "scheduler.grace_period"),
    ({"scheduler": {"backfil": True}}, "scheduler.backfil"),
    ({"scheduler": {"backfill": "yes"}}, "scheduler.backfill"),
    ({"scheduler": {"priority_weights": {"age": -1}}}, "scheduler.priority_weights.age"),
    ({"queues": {"a": {"preempts": ["b"]}}}, "queues.a.preempts"),
    ({"queues": {"a": {"state": "closed"}}}, "queues.a.state"),
    ({"queues": {"a": {"priority": "high"}}}, "queues.a.priority"),
    ({"queues": {"a": {"default_time": "2:00:00", "max_time": "1:00:00"}}}, "queues.a"),
    ({"teams": {"t": {"nominal_gpus": -4}}}, "teams.t.nominal_gpus"),
    ({"teams": {"t": {"nominal_gpus": 4, "lending_limit_gpus": 8}}}, "teams.t"),
    ({"teams": {"t": {"borrowing_limit_gpus": 8}}}, "teams.t"),
    ({"teams": {"t": {"users": ["a"]}, "u": {"users": ["a"]}}}, "teams.u.users[0]"),
    ({"scheduler": {"las_thresholds_gpu_hours": [10, 1]}}, "scheduler.las_thresholds_gpu_hours"),
])
def test_bad_config_names_the_key(doc, key):
    with pytest.raises(SettingsError) as e:
        policy_of(doc)
    assert key in str(e.value)


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
    p = policy_of(tomllib.loads(block))
    assert p.teams["vision"].cohort == "research" and p.queues["high"].preempts == ("low",)
