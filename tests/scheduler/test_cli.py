"""The command line as an operator meets it: exit codes, one-line errors, --json, the demo."""

import json
import os
import signal
import subprocess
import time

import pytest

from tests.conftest import PY, ROOT, DaemonProc, current_user, free_port, wait_for


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    d = DaemonProc(tmp_path_factory.mktemp("cli")).start()
    yield d
    d.stop()


def run(*args, env=None, input=None):
    return subprocess.run([PY, "-m", "scheduler.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          env=env, input=input, timeout=60)


def test_unreachable_daemon_exits_3_with_the_url(tmp_path):
    port = free_port()
    env = {**os.environ, "TRAINYARD_URL": f"http://127.0.0.1:{port}", "TRAINYARD_TOKEN": "ty_x"}
    r = run("jobs", env=env)
    assert r.returncode == 3
    assert f"cannot reach the daemon at http://127.0.0.1:{port}" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_no_configuration_exits_3_and_says_what_to_set(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    env["XDG_CONFIG_HOME"] = str(tmp_path)
    r = run("nodes", env=env)
    assert r.returncode == 3 and "TRAINYARD_URL" in r.stderr


@pytest.mark.parametrize("args,needle", [
    (["submit", "--time", "abc", "--", "true"], "time limit 'abc'"),
    (["submit", "--mem", "lots", "--", "true"], "memory 'lots'"),
    (["submit", "--env", "1X=2", "--", "true"], "1X=2"),
    (["submit"], "nothing to run"),
    (["submit", "--gpus", "two", "--", "true"], "'two' is not a valid integer"),
    (["cancel", "abc"], "'abc' is not a valid integer"),
    (["node", "add", "n1"], "Missing option '--address'"),
])
def test_usage_errors_exit_2(daemon, args, needle):
    r = daemon.cli(*args)
    assert r.returncode == 2, r.stderr
    assert needle in r.stderr


def test_refusals_exit_1_with_the_daemons_message(daemon):
    r = daemon.cli("cancel", "424242")
    assert r.returncode == 1 and "job 424242 does not exist" in r.stderr
    r = daemon.cli("submit", "--queue", "gold", "--", "true")
    assert r.returncode == 1 and "unknown queue 'gold'" in r.stderr


def test_node_that_refuses_ssh_is_not_registered(daemon):
    port = free_port()
    r = daemon.cli("node", "add", "ghost", "--address", "127.0.0.1", "--port", str(port), "--accept-new-host-key")
    assert r.returncode == 1
    assert "connection refused" in r.stderr and "ghost" in r.stderr
    assert json.loads(daemon.cli("nodes", "--json", check=True).stdout) == []


def test_unknown_host_key_needs_explicit_acceptance(daemon, sshd_factory):
    node = sshd_factory("k1", daemon.public_key)
    known = (daemon.state / "known_hosts").read_text()
    r = daemon.cli("node", "add", "k1", "--address", "127.0.0.1", "--port", str(node.port), "--agent-dir",
                   node.agent_dir)
    assert r.returncode == 1
    assert "is not known (ssh-ed25519 SHA256:" in r.stderr and "--accept-new-host-key" in r.stderr
    assert (daemon.state / "known_hosts").read_text() == known
    assert json.loads(daemon.cli("nodes", "--json", check=True).stdout) == []
    r = daemon.cli("node", "add", "k1", "--address", "127.0.0.1", "--port", str(node.port), "--agent-dir",
                   node.agent_dir, "--user", current_user(), "--accept-new-host-key", "--gpus", "2", "--gpu-model", "T4", "--label", "rack=r1")
    assert r.returncode == 0, r.stderr
    n = wait_for(lambda: (n := json.loads(daemon.cli("nodes", "--json").stdout)[0])["state"] == "UP" and n, 20,
                 what="node UP")
    assert {"name", "address", "state", "gpu_model", "gpus_total", "gpus_used", "labels", "telemetry"} <= n.keys()
    assert n["gpus_total"] == 2 and n["labels"] == {"rack": "r1"}
    drained = json.loads(daemon.cli("node", "drain", "k1", "--reason", "fan", "--json", check=True).stdout)
    assert drained["state"] == "DRAINED" and drained["reason"] == "fan"
    assert "DRAINED" in daemon.cli("nodes", check=True).stdout
    assert json.loads(daemon.cli("node", "resume", "k1", "--json", check=True).stdout)["state"] == "UP"
    assert daemon.cli("node", "remove", "k1", check=True).stdout.strip() == "node k1 removed"


def test_first_start_writes_the_admin_token_readable_only_by_its_owner(daemon):
    path = daemon.base / "config" / "trainyard" / "client.toml"
    assert path.stat().st_mode & 0o777 == 0o600
    assert daemon.cli("whoami", check=True).stdout.strip().endswith("(admin)")


def test_token_create_prints_a_working_token(daemon):
    r = daemon.cli("token", "create", "bob", "--role", "user", check=True)
    token = r.stdout.strip()
    assert token.startswith("ty_")
    assert daemon.cli("whoami", token=token, check=True).stdout.strip() == "bob (user)"
    r = daemon.cli("token", "create", "eve", "--role", "admin", token=token)
    assert r.returncode == 1 and "needs the admin role; bob is user" in r.stderr


def test_revoked_token_is_refused_at_once(daemon):
    token = daemon.cli("token", "create", "mallory", "--role", "operator", check=True).stdout.strip()
    assert daemon.cli("whoami", token=token, check=True).stdout.strip() == "mallory (operator)"
    listed = json.loads(daemon.cli("token", "list", "--json", check=True).stdout)
    entry = next(t for t in listed if t["user"] == "mallory")
    assert "token" not in entry and "token_hash" not in entry
    assert daemon.cli("token", "revoke", str(entry["id"]), check=True).stdout.strip() == \
        f"token {entry['id']} of mallory revoked"
    r = daemon.cli("whoami", token=token)
    assert r.returncode == 1 and "invalid token" in r.stderr
    r = daemon.cli("token", "revoke", str(entry["id"]))
    assert r.returncode == 1 and "does not exist" in r.stderr


def test_demo_no_tui_prints_settings_runs_jobs_and_stops_on_sigint(tmp_path):
    env = {**os.environ, "HOME": str(tmp_path), "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    proc = subprocess.Popen([PY, "-m", "scheduler.cli", "demo", "--no-tui", "--nodes", "2", "--gpus-per-node", "2",
                             "--dir", str(tmp_path / "demo")], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        url = proc.stdout.readline().strip()
        token = proc.stdout.readline().strip()
        assert url.startswith("TRAINYARD_URL=http://127.0.0.1:") and token.startswith("TRAINYARD_TOKEN=ty_")
        cenv = {**env, "TRAINYARD_URL": url.split("=", 1)[1], "TRAINYARD_TOKEN": token.split("=", 1)[1]}
        nodes = json.loads(run("nodes", "--json", env=cenv).stdout)
        assert [(n["name"], n["state"], n["gpus_total"]) for n in nodes] == [("node-1", "UP", 2), ("node-2", "UP", 2)]
        job = json.loads(run("submit", "--json", "--gpus", "2", "--", "sh", "-c", "echo $CUDA_VISIBLE_DEVICES",
                             env=cenv).stdout)
        wait_for(lambda: json.loads(run("job", str(job["id"]), "--json", env=cenv).stdout)["state"] == "COMPLETED",
                 20, what="demo job")
        assert run("logs", str(job["id"]), env=cenv).stdout == "0,1\n"
        telemetry = wait_for(lambda: json.loads(run("nodes", "--json", env=cenv).stdout)[0]["telemetry"]["gpus"], 10,
                             what="telemetry")
        assert len(telemetry) == 2 and "util_gpu" in telemetry[0]
    finally:
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0
    time.sleep(0.2)
