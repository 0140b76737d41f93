"""trainyard.toml as an operator writes it: every table typed, every bad key named with its value."""

import os
import re
import subprocess
import tomllib
from pathlib import Path

import pytest

from scheduler.config import DaemonConfig, home
from scheduler.health import FATAL_XIDS, HealthRules
from scheduler.planner import PolicyConfig
from scheduler.settings import Settings, SettingsError
from tests.conftest import PY, ROOT

FULL = """
[daemon]
listen = "0.0.0.0:9000"
db = "postgresql://trainyard@db/trainyard"
cluster_name = "research"
node_grace_s = "2m"
connect_timeout_s = 5
keepalive_interval_s = 2.5
keepalive_count_max = 4
reconnect_max_backoff_s = 30
kill_grace_s = "0:30"
schedule_interval_s = 0.5
telemetry_interval_s = 1

[scheduler]
policy = "fairshare"
order = "multifactor"
backfill = false
queueing = "best_effort"
preemption = false
max_preemptors_per_pass = 4
grace_period = "2:00"
default_time = "4:00:00"
fairshare_half_life = "7-0"
las_thresholds_gpu_hours = [1, 10, 100]
topology_keys = ["switch"]

[scheduler.priority_weights]
age = 1000
fairshare = 20000
job_size = 100
queue = 50000
max_age = "14-0"
favor_small = true

[queues.high]
priority = 10
preempts = ["low"]
max_time = "1-0"
aliases = ["gpu", "batch"]

[queues.low]
priority = -1
grace_period = 300
default_time = "1:00:00"
nodes = { pool = "spot" }

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
users = "carol"

[health]
xid = "exclude_gpu"
fatal_xids = [13, 79]
ecc_dbe = "off"
remap_failure = "drain_node"
off_bus = "drain_node"
temp = "exclude_gpu"
temp_c = 85.5
temp_period_s = "1:00"
history_samples = 100

[users]
alice = "alice"
"bob.smith" = "bsmith"

[nodes]
agent_dir = "/var/lib/trainyard"
min_uid = 2000
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "trainyard.toml"
    path.write_text(text)
    return path


def problems(doc: dict) -> list[str]:
    with pytest.raises(SettingsError) as e:
        Settings.from_toml(doc)
    return e.value.problems


# ------------------------------------------------------------------------------ every key
def test_every_daemon_key_is_read_with_durations_in_any_form(tmp_path):
    c = DaemonConfig.load(write(tmp_path, FULL))
    assert (c.listen, c.db, c.cluster_name) == ("0.0.0.0:9000", "postgresql://trainyard@db/trainyard",
                                                "research")
    assert (c.node_grace_s, c.connect_timeout_s, c.keepalive_interval_s, c.keepalive_count_max) == (
        120.0, 5.0, 2.5, 4)
    assert (c.reconnect_max_backoff_s, c.kill_grace_s, c.schedule_interval_s,
            c.telemetry_interval_s) == (30.0, 30.0, 0.5, 1.0)


def test_every_scheduler_queue_and_team_key_reaches_the_planner(tmp_path):
    p = DaemonConfig.load(write(tmp_path, FULL)).policy_config
    assert (p.name, p.order, p.backfill, p.queueing, p.preemption) == (
        "fairshare", "multifactor", False, "best_effort", False)
    assert (p.max_preemptors_per_pass, p.grace_period_s, p.default_time_limit_s) == (4, 120.0, 14400.0)
    assert p.fairshare_half_life_s == 7 * 86400
    assert p.las_thresholds_gpu_s == (3600.0, 36000.0, 360000.0) and p.topology_keys == ("switch",)
    w = p.weights
    assert (w.age, w.fairshare, w.job_size, w.queue, w.max_age_s, w.favor_small) == (
        1000, 20000, 100, 50000, 14 * 86400, True)
    high, low, frozen = p.queues["high"], p.queues["low"], p.queues["frozen"]
    assert (high.priority, high.preempts, high.max_time_limit_s, high.open) == (10, ("low",), 86400, True)
    assert (low.priority, low.grace_period_s, low.default_time_limit_s) == (-1, 300, 3600)
    assert dict(low.node_selector) == {"pool": "spot"} and frozen.open is False
    v = p.teams["vision"]
    assert (v.nominal_gpus, v.borrowing_limit_gpus, v.lending_limit_gpus, v.cohort, v.fairshare,
            v.users) == (64, 32, 16, "research", 2.0, ("alice", "bob"))
    assert p.teams["speech"].users == ("carol",) and p.user_team["carol"] == "speech"


def test_every_health_key_reaches_the_rules(tmp_path):
    assert DaemonConfig.load(write(tmp_path, FULL)).health_rules == HealthRules(
        xid="exclude_gpu", fatal_xids=frozenset({13, 79}), ecc_dbe="off", remap_failure="drain_node",
        off_bus="drain_node", temp="exclude_gpu", temp_c=85.5, temp_period_s=60.0, history_samples=100)


def test_users_nodes_and_partition_aliases(tmp_path):
    c = DaemonConfig.load(write(tmp_path, FULL))
    assert c.users == {"alice": "alice", "bob.smith": "bsmith"}
    assert (c.nodes.agent_dir, c.nodes.min_uid) == ("/var/lib/trainyard", 2000)
    assert c.queue_aliases == {"high": "high", "low": "low", "frozen": "frozen", "gpu": "high",
                               "batch": "high"}


def test_no_file_and_an_empty_file_are_the_defaults(tmp_path):
    for c in (DaemonConfig.load(None), DaemonConfig.load(write(tmp_path, ""))):
        assert (c.listen, c.db, c.node_grace_s, c.keepalive_count_max) == ("127.0.0.1:8471", "", 60.0, 3)
        assert c.policy_config == PolicyConfig.preset("backfill")
        assert c.health_rules == HealthRules() and c.health_rules.fatal_xids == FATAL_XIDS
        assert c.users == {} and (c.nodes.agent_dir, c.nodes.min_uid) == ("", 1000)


def test_the_raw_tables_stay_available_as_before(tmp_path):
    c = DaemonConfig.load(write(tmp_path, FULL))
    assert set(c.policy) == {"scheduler", "queues", "teams"} and "aliases" not in c.policy["queues"]["high"]
    assert c.health["temp_c"] == 85.5
    assert Settings.from_toml(c.policy).to_policy() == c.policy_config


@pytest.mark.parametrize("name", ["fifo", "backfill", "fairshare", "las", "qssf"])
def test_every_policy_name_is_accepted(name):
    assert Settings.from_toml({"scheduler": {"policy": name}}).to_policy().name == name


def test_command_line_overrides_are_validated_like_the_file():
    c = DaemonConfig.load(None)
    c.listen = "[::1]:9000"
    assert c.listen == "[::1]:9000"
    with pytest.raises(ValueError, match="expected HOST:PORT"):
        c.listen = "nowhere"


# ------------------------------------------------------------------------------ same as before
def _docs_example() -> str:
    doc = (ROOT / "docs" / "scheduling.md").read_text()
    return re.search(r"```toml\n(.*?)```", doc, re.S).group(1)


RICH = [
    FULL.split("[health]")[0].replace('aliases = ["gpu", "batch"]', ""),
    _docs_example(),
    "",
    '[scheduler]\npolicy = "las"\nlas_thresholds_gpu_hours = [0.5, 2]\npreemption = false\n',
    '[scheduler]\npolicy = "fifo"\nqueueing = "best_effort"\n[scheduler.priority_weights]\nage = 5\n'
    '[queues.a]\npreempts = "b"\n[queues.b]\nstate = "open"\n'
    '[teams.t]\nnominal_gpus = 0\nlending_limit_gpus = 0\nusers = []\n',
]


@pytest.mark.parametrize("text", RICH, ids=["full", "docs", "empty", "las", "fifo"])
def test_real_configs_become_the_policy_they_name(text):
    doc = tomllib.loads(text)
    policy = Settings.from_toml(doc).to_policy()
    named = doc.get("scheduler", {}).get("policy", "backfill")
    assert policy.name == named and set(policy.queues) == set(doc.get("queues", {}))
    assert set(policy.teams) == set(doc.get("teams", {}))
    preset = PolicyConfig.preset(named)
    unchanged = [k for k in ("backfill", "order", "queueing") if k not in doc.get("scheduler", {})]
    assert all(getattr(policy, k) == getattr(preset, k) for k in unchanged)


@pytest.mark.parametrize("table", [
    {}, {"xid": "exclude_gpu", "ecc_dbe": "off", "temp_c": 80, "temp_period_s": 10, "fatal_xids": [13]},
    {"remap_failure": "off", "off_bus": "exclude_gpu", "temp": "off", "history_samples": 2},
])
def test_the_health_rules_equal_the_ones_built_from_the_same_table(table):
    assert Settings.from_toml({"health": table}).to_health() == HealthRules(**table)


# ------------------------------------------------------------------------------ bad values
@pytest.mark.parametrize("doc, message", [
    # [daemon]
    ({"daemon": {"listen": "nowhere"}}, "daemon.listen: expected HOST:PORT, e.g. 127.0.0.1:8471, got 'nowhere'"),
    ({"daemon": {"db": 5}}, "daemon.db: expected a string, got 5"),
    ({"daemon": {"cluster_name": ""}}, "daemon.cluster_name: expected a non-empty name"),
    ({"daemon": {"node_grace_s": "soon"}}, "daemon.node_grace_s: cannot read 'soon' as a duration"),
    ({"daemon": {"node_grace_s": -1}}, "daemon.node_grace_s: must be >= 0 seconds, got -1"),
    ({"daemon": {"connect_timeout_s": 0}}, "daemon.connect_timeout_s: must be > 0, got 0"),
    ({"daemon": {"keepalive_count_max": True}}, "daemon.keepalive_count_max: expected a whole number, got True"),
    ({"daemon": {"keepalive_count_max": 0}}, "daemon.keepalive_count_max: must be >= 1, got 0"),
    ({"daemon": {"kill_grace_s": float("nan")}}, "daemon.kill_grace_s: expected a finite number of seconds"),
    ({"daemon": {"schedule_interval_s": "3651-0"}}, "daemon.schedule_interval_s: '3651-0' is longer than ten years"),
    ({"daemon": {"port": 80}}, "daemon.port: unknown setting (value 80); known settings: cluster_name, "),
    # [scheduler]
    ({"scheduler": {"policy": "sjf"}}, "scheduler.policy: unknown policy 'sjf'; choose one of fifo, backfill, "
                                       "fairshare, las, las-budget, qssf"),
    ({"scheduler": {"order": "random"}}, "scheduler.order: unknown order 'random'; choose one of fifo, "),
    ({"scheduler": {"queueing": "lax"}}, "scheduler.queueing: unknown strategy 'lax'; choose one of strict, "),
    ({"scheduler": {"backfill": "yes"}}, "scheduler.backfill: expected true or false, got 'yes'"),
    ({"scheduler": {"preemption": 1}}, "scheduler.preemption: expected true or false, got 1"),
    ({"scheduler": {"backfil": True}}, "scheduler.backfil: unknown setting (value True); known settings: "),
    ({"scheduler": {"max_preemptors_per_pass": -1}}, "scheduler.max_preemptors_per_pass: must be >= 0, got -1"),
    ({"scheduler": {"grace_period": "soon"}}, "scheduler.grace_period: cannot read 'soon' as a duration; use "),
    ({"scheduler": {"default_time": True}}, "scheduler.default_time: expected seconds or a time like 1:00:00"),
    ({"scheduler": {"fairshare_half_life": 0}}, "scheduler.fairshare_half_life: must be > 0, got 0"),
    ({"scheduler": {"las_thresholds_gpu_hours": [10, 1]}}, "scheduler.las_thresholds_gpu_hours: thresholds "
                                                           "must be strictly increasing, got [10.0, 1.0]"),
    ({"scheduler": {"las_thresholds_gpu_hours": [1, -2]}}, "scheduler.las_thresholds_gpu_hours[1]: must be >= 0"),
    ({"scheduler": {"las_thresholds_gpu_hours": 5}}, "scheduler.las_thresholds_gpu_hours: expected a list, got 5"),
    ({"scheduler": {"topology_keys": ["rack", ""]}}, "scheduler.topology_keys[1]: expected a non-empty name"),
    ({"scheduler": {"priority_weights": 3}}, "scheduler.priority_weights: expected a table, got 3"),
    ({"scheduler": {"priority_weights": {"age": -1}}}, "scheduler.priority_weights.age: must be >= 0, got -1"),
    ({"scheduler": {"priority_weights": {"max_age": 0}}}, "scheduler.priority_weights.max_age: must be > 0"),
    ({"scheduler": {"priority_weights": {"favor_small": "no"}}}, "scheduler.priority_weights.favor_small: expected true or false, got 'no'"),
    ({"scheduler": {"priority_weights": {"aged": 1}}}, "scheduler.priority_weights.aged: unknown setting"),
    # [queues.NAME]
    ({"queues": {"a": 1}}, "queues.a: expected a table, got 1"),
    ({"queues": {"a": {"priority": "high"}}}, "queues.a.priority: expected a whole number, got 'high'"),
    ({"queues": {"a": {"state": "closed"}}}, "queues.a.state: expected one of 'open' or 'stopped', got 'closed'"),
    ({"queues": {"a": {"default_time": "2:00:00", "max_time": "1:00:00"}}},
     "queues.a.max_time: 1:00:00 is less than default_time 2:00:00"),
    ({"queues": {"a": {"grace_period": -5}}}, "queues.a.grace_period: must be >= 0 seconds, got -5"),
    ({"queues": {"a": {"preempts": ["b"]}}}, "queues.a.preempts[0]: unknown queue 'b'; configured queues: a"),
    ({"queues": {"a": {"preempts": ["a"]}}}, "queues.a.preempts[0]: a queue cannot preempt itself ('a')"),
    ({"queues": {"a": {"nodes": {"pool": 1}}}}, "queues.a.nodes.pool: expected a string, got 1"),
    ({"queues": {"a": {"aliases": ["b"]}, "b": {}}}, "queues.a.aliases[0]: 'b' already names queues.b"),
    ({"queues": {"a": {"aliases": ["x"]}, "b": {"aliases": "x"}}}, "queues.b.aliases[0]: 'x' already names "
                                                                  "queues.a"),
    ({"queues": {"a": {"max_runtime": 5}}}, "queues.a.max_runtime: unknown setting (value 5); known settings: "
                                            "aliases, allow_opt_out, default_time, grace_period, idle_action, "),
    # [teams.NAME]
    ({"teams": {"t": {"nominal_gpus": -4}}}, "teams.t.nominal_gpus: must be >= 0, got -4"),
    ({"teams": {"t": {"nominal_gpus": 2**40}}}, "teams.t.nominal_gpus: must be <= 1000000, got 1099511627776"),
    ({"teams": {"t": {"nominal_gpus": 4, "lending_limit_gpus": 8}}},
     "teams.t.lending_limit_gpus: 8 exceeds nominal_gpus 4"),
    ({"teams": {"t": {"borrowing_limit_gpus": 8}}}, "teams.t.borrowing_limit_gpus: 8 needs nominal_gpus"),
    ({"teams": {"t": {"cohort": ""}}}, "teams.t.cohort: expected a non-empty name"),
    ({"teams": {"t": {"fairshare": 0}}}, "teams.t.fairshare: must be > 0, got 0"),
    ({"teams": {"t": {"users": [1]}}}, "teams.t.users[0]: expected a string, got 1"),
    ({"teams": {"t": {"users": ["a"]}, "u": {"users": ["b", "a"]}}},
     "teams.u.users[1]: user 'a' is already in team 't'"),
    # [health]
    ({"health": {"xid": "reboot"}}, "health.xid: expected one of 'drain_node', 'exclude_gpu' or 'off', got "
                                    "'reboot'"),
    ({"health": {"temp_c": "hot"}}, "health.temp_c: expected a number, got 'hot'"),
    ({"health": {"temp_period_s": -1}}, "health.temp_period_s: must be >= 0 seconds, got -1"),
    ({"health": {"fatal_xids": [79, "x"]}}, "health.fatal_xids[1]: expected a whole number, got 'x'"),
    ({"health": {"fatal_xids": 79}}, "health.fatal_xids: expected a list, got 79"),
    ({"health": {"fatal_xids": [0]}}, "health.fatal_xids[0]: must be > 0, got 0"),
    ({"health": {"history_samples": 2.5}}, "health.history_samples: expected a whole number, got 2.5"),
    ({"health": {"history_samples": 1}}, "health.history_samples: must be >= 2, got 1"),
    ({"health": {"temperature": 90}}, "health.temperature: unknown setting (value 90); known settings: "
                                      "ecc_dbe, fatal_xids, "),
    # [users], [nodes], unknown tables
    ({"users": {"alice": "root"}}, "users.alice: jobs never run as 'root'; map the user to their own Unix"),
    ({"users": {"bob": "Bob Smith"}}, "users.bob: 'Bob Smith' is not a Unix account name"),
    ({"users": {"bob": "b" * 33}}, "users.bob: 'bbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb' is not a Unix account name"),
    ({"users": {"a b": "ab"}}, "users.a b: 'a b' is not a trainyard user name"),
    ({"users": {"bob": 1000}}, "users.bob: expected a string, got 1000"),
    ({"nodes": {"agent_dir": ".trainyard"}}, "nodes.agent_dir: '.trainyard' must be an absolute path on the "
                                             "node's own disk"),
    ({"nodes": {"min_uid": 0}}, "nodes.min_uid: must be >= 1, got 0"),
    ({"nodes": {"min_uid": "1000"}}, "nodes.min_uid: expected a whole number, got '1000'"),
    ({"node": {}}, "node: unknown table (value {}); known tables: accounting, autoscale, daemon, gate, health, "
                   "infra, logs, nodes, notify, queues, scheduler, teams, users"),
])
def test_a_bad_value_is_refused_naming_its_key_and_value(doc, message):
    got = problems(doc)
    assert len(got) == 1 and got[0].startswith(message), got


def test_every_problem_is_reported_at_once_each_on_its_own_line(tmp_path):
    path = write(tmp_path, '[scheduler]\npolicy = "sjf"\n[health]\nxid = "reboot"\n[users]\nbob = "root"\n')
    with pytest.raises(SettingsError) as e:
        DaemonConfig.load(path)
    lines = str(e.value).splitlines()
    assert [line.split(": ")[1] for line in lines] == ["scheduler.policy", "health.xid", "users.bob"]
    assert all(line.startswith(f"{path}: ") for line in lines)


@pytest.mark.parametrize("text, message", [
    (None, "does not exist"),
    ("[daemon\n", "is not valid TOML: "),
    (b"\xff\xfe", "cannot read config file"),
])
def test_a_file_that_cannot_be_read_is_named(tmp_path, text, message):
    path = tmp_path / "trainyard.toml"
    if isinstance(text, bytes):
        path.write_bytes(text)
    elif text is not None:
        path.write_text(text)
    with pytest.raises(SettingsError, match=f"config file '{path}'.*{message}|{message}.*'{path}'"):
        DaemonConfig.load(path)


def test_trainyard_daemon_refuses_a_bad_config_with_exit_2_and_no_traceback(tmp_path):
    path = write(tmp_path, '[queues.high]\nstate = "closed"\n[nodes]\nmin_uid = 0\n')
    env = {**os.environ, "TRAINYARD_HOME": str(tmp_path / "home")}
    r = subprocess.run([PY, "-m", "scheduler.cli", "daemon", "--config", str(path)], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stderr
    assert r.stderr.splitlines() == [
        f"trainyard: error: {path}: queues.high.state: expected one of 'open' or 'stopped', got 'closed'",
        f"trainyard: error: {path}: nodes.min_uid: must be >= 1, got 0",
    ], r.stderr
    assert not (tmp_path / "home").exists()


def test_trainyard_home_is_resolved_in_one_place(monkeypatch, tmp_path):
    from scheduler.bootstrap import default_events_path, default_ssh_public_key

    monkeypatch.setenv("TRAINYARD_HOME", str(tmp_path / "state"))
    assert home() == tmp_path / "state"
    assert default_ssh_public_key() == tmp_path / "state" / "ssh" / "id_ed25519.pub"
    assert default_events_path().parent == tmp_path / "state" / "bootstrap"
    monkeypatch.delenv("TRAINYARD_HOME")
    monkeypatch.setenv("HOME", str(tmp_path))
    assert home() == tmp_path / ".local" / "share" / "trainyard"


def test_a_bad_listen_option_is_refused_before_anything_starts(tmp_path):
    env = {**os.environ, "TRAINYARD_HOME": str(tmp_path / "home")}
    r = subprocess.run([PY, "-m", "scheduler.cli", "daemon", "--listen", "nowhere"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr == "trainyard: error: --listen 'nowhere': expected HOST:PORT, e.g. 127.0.0.1:8471\n"
    assert not (tmp_path / "home").exists()


def test_the_demos_settings_are_typed_too(tmp_path):
    from scheduler.demo import demo_config

    c = demo_config(tmp_path, "127.0.0.1:0")
    assert (c.cluster_name, c.telemetry_interval_s, c.policy_config.name) == ("demo", 1.0, "backfill")
