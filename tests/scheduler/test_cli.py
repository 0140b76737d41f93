"""The command line as an operator meets it: exit codes, one-line errors, --json, the demo."""

import json
import os
import signal
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

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
    (["submit", "--time", "abc", "--", "true"], "--time: cannot read 'abc' as a duration"),
    (["submit", "--time", "0", "--", "true"], "--time: must be positive, got '0'"),
    (["submit", "--mem", "lots", "--", "true"], "--mem: cannot read 'lots' as a size"),
    (["submit", "--mem", "99999999999999999999", "--", "true"], "--mem: '99999999999999999999' is more than 64 PiB"),
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


def test_several_jobs_are_acted_on_in_one_call_each_answered_in_the_order_given(daemon):
    ids = [json.loads(daemon.cli("submit", "--hold", "--json", "--", "true", check=True).stdout)["id"]
           for _ in range(3)]
    a, b, c = map(str, ids)
    r = daemon.cli("cancel", b, "424242", a, b)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stdout.splitlines() == [f"job {b}: CANCELLED", f"job {a}: CANCELLED"]
    assert r.stderr.strip() == "trainyard: error: job 424242 does not exist"
    r = daemon.cli("release", c, a, "--json")
    assert r.returncode == 1 and f"job {ids[0]} is CANCELLED" in r.stderr  # an ended job: refused
    assert [(j["id"], j["state"], bool(j["held"])) for j in json.loads(r.stdout)] == [(ids[2], "PENDING", False)]
    daemon.cli("cancel", c, check=True)


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
    proc = subprocess.Popen([PY, "-m", "scheduler.cli", "demo", "--no-tui", "--idle", "--nodes", "2", "--gpus-per-node", "2",
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


# ------------------------------------------------------------------------------ settings errors
@pytest.mark.parametrize("url, words", [
    ("http://[::1", "TRAINYARD_URL = 'http://[::1' is not a valid URL"),
    ("localhost:8471", "TRAINYARD_URL = 'localhost:8471': expected an http:// or https:// URL"),
    ("http://", "TRAINYARD_URL = 'http://' names no host"),
    ("http://127.0.0.1:99999", "port 99999 is out of range"),
    ("http://a..b:8471", "TRAINYARD_URL = 'http://a..b:8471' is not a valid URL"),
])
def test_a_malformed_url_is_one_line_and_exit_2(url, words):
    r = run("jobs", env={**os.environ, "TRAINYARD_URL": url, "TRAINYARD_TOKEN": "ty_x"})
    assert r.returncode == 2, r.stderr
    assert r.stderr.strip().splitlines() == [r.stderr.strip()] and words in r.stderr
    assert r.stderr.startswith("trainyard: error: ") and "e.g. http://127.0.0.1:8471" in r.stderr


def test_a_malformed_token_is_refused_without_being_echoed():
    r = run("whoami", env={**os.environ, "TRAINYARD_URL": "http://127.0.0.1:1", "TRAINYARD_TOKEN": "ty_se cret"})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1
    assert "TRAINYARD_TOKEN is not a token" in r.stderr and "se cret" not in r.stderr


@pytest.mark.parametrize("text, words", [
    ("url = [", "cannot read"),
    ('url = "http://[::1"\ntoken = "ty_x"\n', "client.toml: url = 'http://[::1' is not a valid URL"),
    ('url = 8471\ntoken = "ty_x"\n', "client.toml: url = 8471: expected a URL as text"),
])
def test_a_malformed_client_toml_is_named_and_exit_2(tmp_path, text, words):
    (tmp_path / "trainyard").mkdir()
    (tmp_path / "trainyard" / "client.toml").write_text(text)
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    r = run("jobs", env={**env, "XDG_CONFIG_HOME": str(tmp_path)})
    assert r.returncode == 2 and words in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


# ------------------------------------------------------------------------------ replies that are not the API's
class _Reply(BaseHTTPRequestHandler):
    """Answers every request with the status, content type and body the test chose."""

    status, ctype, body = 500, "text/plain", b"Internal Server Error"

    def do_GET(self):  # noqa: N802 (http.server's name)
        self.send_response(self.status)
        self.send_header("Content-Type", self.ctype)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    do_POST = do_GET  # noqa: N815

    def log_message(self, *args):
        pass


@pytest.fixture
def http_reply():
    """A real HTTP server in this process; set its answer with `http_reply(status, ctype, body)`."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Reply)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    def answer(status: int, ctype: str, body: bytes) -> dict:
        _Reply.status, _Reply.ctype, _Reply.body = status, ctype, body
        return {**os.environ, "TRAINYARD_URL": f"http://127.0.0.1:{server.server_port}", "TRAINYARD_TOKEN": "ty_x"}

    yield answer
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("status, ctype, body, words", [
    (500, "text/plain", b"Internal Server Error", "the daemon answered 500 Internal Server Error"),
    (502, "text/html", b"<html>\n<h1>Bad Gateway</h1>\n</html>", "the daemon answered 502 Bad Gateway: <html> <h1>"),
    (404, "application/json", b'{"detail": "job 7 does not exist"}', "job 7 does not exist"),
    (422, "application/json",
     b'{"detail": [{"loc": ["query", "rank"], "msg": "rank 99 is out of range: job 7 has 1 node", "type": "x"}]}',
     "rank: rank 99 is out of range: job 7 has 1 node"),
    (200, "text/html", b"<html>welcome to nginx</html>", "is not JSON (<html>welcome to nginx</html>); is that "),
])
def test_a_reply_that_is_not_the_apis_json_is_one_line_and_exit_1(http_reply, status, ctype, body, words):
    r = run("jobs", env=http_reply(status, ctype, body))
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert words in r.stderr


# ------------------------------------------------------------------------------ submit: SCRIPT or -- COMMAND
def test_a_missing_script_is_named_exit_2_and_nothing_is_submitted(daemon):
    before = json.loads(daemon.cli("jobs", "--all", "--json", check=True).stdout)
    r = daemon.cli("submit", "typo.sh")
    assert r.returncode == 2
    assert "script 'typo.sh' does not exist; to run a command instead, put it after `--`" in r.stderr
    assert json.loads(daemon.cli("jobs", "--all", "--json", check=True).stdout) == before


def test_words_without_dashdash_are_not_taken_for_a_command(daemon):
    before = json.loads(daemon.cli("jobs", "--all", "--json", check=True).stdout)
    r = daemon.cli("submit", "python", "train.py")
    assert r.returncode == 2 and "put it after `--` (trainyard submit [OPTIONS] -- python train.py)" in r.stderr
    r = daemon.cli("submit", str(ROOT))
    assert r.returncode == 2 and f"script {str(ROOT)!r} is a directory" in r.stderr
    assert json.loads(daemon.cli("jobs", "--all", "--json", check=True).stdout) == before


def test_a_command_after_dashdash_is_a_command_even_when_a_file_has_its_name(daemon, tmp_path):
    (tmp_path / "run.sh").write_text("#!/bin/sh\n#SBATCH --job-name=from-script\necho hi\n")
    env_cwd = daemon.cli("submit", "--hold", "--json", "--", str(tmp_path / "run.sh"), check=True)
    job = json.loads(env_cwd.stdout)
    assert job["command"] == [str(tmp_path / "run.sh")] and job["name"] != "from-script"
    job = json.loads(daemon.cli("submit", "--hold", "--json", str(tmp_path / "run.sh"), check=True).stdout)
    assert job["name"] == "from-script" and job["command"] in (None, [])
    daemon.cli("cancel", str(job["id"]), check=True)


# ------------------------------------------------------------------------------ logs
def test_logs_of_a_rank_the_job_does_not_have_exit_1_with_the_daemons_reason(daemon):
    job = json.loads(daemon.cli("submit", "--hold", "--json", "--", "true", check=True).stdout)
    r = daemon.cli("logs", str(job["id"]), "--rank", "99")
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert r.stderr.startswith("trainyard: error: rank: ") and f"job {job['id']}" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert r.stdout == ""
    daemon.cli("cancel", str(job["id"]), check=True)


# ------------------------------------------------------------------------------ tables
def test_tables_keep_squeues_columns_and_print_names_as_written(daemon):
    name = "[bold]not-markup[/bold]-" + "x" * 40
    job = json.loads(daemon.cli("submit", "--hold", "--json", "--name", name, "--", "true", check=True).stdout)
    out = daemon.cli("jobs", check=True).stdout
    header, *rows = out.splitlines()
    assert header.split() == ["JOBID", "NAME", "USER", "QUEUE", "STATE", "GPUS", "NODES", "TIME",
                              "NODELIST(REASON)"]
    row = next(r for r in rows if r.startswith(f"{job['id']} "))
    assert row.split()[1] == name[:24] and all(line == line.rstrip() for line in out.splitlines())
    assert daemon.cli("queues", check=True).stdout.splitlines()[0].split() == [
        "QUEUE", "STATE", "PRIORITY", "PENDING", "RUNNING", "GPUS", "DEFAULT_TIME", "MAX_TIME"]
    assert daemon.cli("teams", check=True).stdout.splitlines()[0].split() == [
        "TEAM", "COHORT", "GPUS", "NOMINAL", "BORROW", "LEND", "SHARES", "USAGE_GPU_H", "RUNNING", "PENDING"]
    assert daemon.cli("nodes", check=True).stdout.splitlines()[0].split() == [
        "NAME", "STATE", "GPUS", "MODEL", "POOL", "ADDRESS", "FENCE", "RUNTIME", "REASON"]
    tokens = daemon.cli("token", "list", check=True).stdout.splitlines()
    assert tokens[0].split() == ["ID", "USER", "ROLE", "CREATED", "BY"] and len(tokens) >= 2
    daemon.cli("cancel", str(job["id"]), check=True)


def test_a_long_cell_is_never_cut_or_wrapped_in_a_pipe(capsys):
    from scheduler.cli import table

    reason = "host key verification failed: " + "y" * 300
    table(["NAME", "STATE", "REASON"], [["n1", "DOWN", reason], ["n22", None, "[red]x[/red]"]])
    assert capsys.readouterr().out.splitlines() == [
        "NAME  STATE  REASON",
        f"n1    DOWN   {reason}",
        "n22" + " " * 10 + "[red]x[/red]",
    ]


def test_events_lists_the_audit_trail_from_any_id(daemon):
    job = daemon.client().submit({"command": ["true"], "hold": True})
    out = daemon.cli("events", "--since", "0", "-n", "1000", check=True).stdout.splitlines()
    assert out[0].split()[0] == "1"  # from the start of the trail
    assert any("job.submit" in line and f" {job['id']} " in line + " " for line in out)
    last = daemon.cli("events", "-n", "1", "--json", check=True).stdout.splitlines()
    assert len(last) == 1 and json.loads(last[0])["id"] >= int(out[-1].split()[0])
