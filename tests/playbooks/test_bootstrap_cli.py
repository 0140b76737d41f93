"""`trainyard bootstrap` as a user meets it: usage errors, refusals, --from-daemon, the summary."""

from __future__ import annotations

import json
import os

import click
import pytest
from click.testing import CliRunner

from scheduler import client as client_module
from scheduler.bootstrap import BootstrapResult, HostSummary, bootstrap, format_summary

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def env(tmp_path):
    """A user with no daemon configured and the daemon's public key in TRAINYARD_HOME."""
    home = tmp_path / "trainyard-home"
    (home / "ssh").mkdir(parents=True)
    (home / "ssh" / "id_ed25519.pub").write_text(
        "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAITEST trainyard@daemon\n"
    )
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TRAINYARD_")}
    return {
        **clean,
        "TRAINYARD_HOME": str(home),
        "HOME": str(tmp_path),
        "XDG_CONFIG_HOME": str(tmp_path / ".config"),
    }


def invoke(args, env):
    return CliRunner().invoke(bootstrap, args, env=env, catch_exceptions=False)


def test_needs_exactly_one_inventory_source(env, tmp_path):
    result = invoke([], env)
    assert result.exit_code == 2
    assert "give exactly one of --inventory FILE or --from-daemon" in result.output


def test_missing_daemon_key_is_refused_with_what_to_do(env, tmp_path):
    (tmp_path / "inv.json").write_text("[]")
    result = invoke(
        ["--inventory", str(tmp_path / "inv.json"), "--ssh-public-key", str(tmp_path / "none.pub")],
        env,
    )
    assert result.exit_code == 1
    assert f"the daemon's SSH public key {tmp_path / 'none.pub'} does not exist" in result.output
    assert "--ssh-public-key PATH" in result.output


def test_bad_inventory_document_is_refused_naming_node_and_field(env, tmp_path):
    doc = [
        {
            "name": "gpu-1",
            "address": "10.0.0.1",
            "ssh_user": "ubuntu",
            "ssh_port": 22,
            "pool": "p",
            "provider": "azure",
            "gpu_model": "H100",
            "gpu_count": 8,
            "labels": {},
        }
    ]
    (tmp_path / "inv.json").write_text(json.dumps(doc))
    result = invoke(["--inventory", str(tmp_path / "inv.json")], env)
    assert result.exit_code == 1
    assert "error: node 'gpu-1': provider 'azure' is not one of aws, onprem" in result.output


def test_empty_inventory_has_nothing_to_bootstrap(env, tmp_path):
    (tmp_path / "inv.json").write_text("[]")
    result = invoke(["--inventory", str(tmp_path / "inv.json")], env)
    assert result.exit_code == 1
    assert "the inventory has no nodes; nothing to bootstrap" in result.output


def test_from_daemon_without_a_configured_daemon_exits_3(env):
    result = invoke(["--from-daemon"], env)
    assert result.exit_code == 3
    assert "no daemon configured" in result.output


def test_from_daemon_with_daemon_down_exits_3(env):
    env = {**env, "TRAINYARD_URL": "http://127.0.0.1:9", "TRAINYARD_TOKEN": "t0ken"}
    result = invoke(["--from-daemon"], env)
    assert result.exit_code == 3
    assert "the daemon is unreachable" in result.output


def test_summary_lists_each_host_and_the_first_error_of_failed_ones():
    result = BootstrapResult(
        rc=2,
        status="failed",
        check=False,
        hosts={
            "gpu-a1": HostSummary("gpu-a1", ok=40, changed=12),
            "gpu-a2": HostSummary(
                "gpu-a2",
                ok=9,
                failed=1,
                first_error="nvidia_driver : Install the driver packages (apt): No package matching 'nvidia-driver-999-server-open' is available",
            ),
            "gpu-a3": HostSummary(
                "gpu-a3",
                unreachable=1,
                first_error="Gathering Facts: ssh: connect to host 10.0.0.3 port 22: No route to host",
            ),
        },
    )
    text = click.unstyle(format_summary(result))  # colours are dropped when output is no terminal
    lines = text.splitlines()
    assert lines[0].split() == ["HOST", "RESULT", "OK", "CHANGED", "FAILED", "UNREACHABLE"]
    assert lines[1].split() == ["gpu-a1", "changed", "40", "12", "0", "0"]
    assert lines[2].split() == ["gpu-a2", "failed", "9", "0", "1", "0"]
    assert lines[3].split() == ["gpu-a3", "unreachable", "0", "0", "0", "1"]
    assert "gpu-a2: nvidia_driver : Install the driver packages (apt): No package matching" in text
    assert (
        "gpu-a3: Gathering Facts: ssh: connect to host 10.0.0.3 port 22: No route to host" in text
    )
    assert lines[-1] == "2 of 3 host(s) failed"


class FakeClient:
    """Stands in for scheduler.client.Client: the daemon's node list and the bootstrap phases it hears."""

    def __init__(self, nodes):
        self._nodes = nodes
        self.phases = []

    def nodes(self):
        return self._nodes

    def node_bootstrap(self, name, phase, detail=""):
        self.phases.append((name, phase))
        return {}


def test_from_daemon_bootstraps_the_daemons_nodes_and_marks_them(
    target, env, tmp_path, monkeypatch
):
    fake = FakeClient(
        [
            {
                "name": "node-a",
                "address": target.address,
                "port": target.port,
                "user": "trainyard",
                "pool": "h100",
                "provider": "onprem",
                "gpu_model": "H100",
                "gpus_total": 8,
                "labels": {"rack": "r12"},
                "state": "DOWN",
            }
        ]
    )
    monkeypatch.setattr(client_module.Client, "from_env", classmethod(lambda cls, **kw: fake))
    pub = tmp_path / "daemon.pub"
    pub.write_text(target.public_key + "\n")
    result = invoke(
        [
            "--from-daemon",
            "--ssh-user",
            "root",
            "--tags",
            "common",
            "--ssh-public-key",
            str(pub),
            "--private-key",
            str(target.private_key),
            "--known-hosts",
            str(target.known_hosts),
            "--events",
            str(tmp_path / "ev.jsonl"),
        ],
        env,
    )
    assert result.exit_code == 0, result.output
    assert fake.phases == [("node-a", "start"), ("node-a", "done")]
    assert "common : Create the trainyard user" in result.output
    assert "node-a" in result.output.splitlines()[-3] and "1 host(s) bootstrapped" in result.output
    assert f"events: {tmp_path / 'ev.jsonl'}" in result.output
