"""`trainyard infra` end to end against the stand-in pulumi CLI and a fake daemon."""

from __future__ import annotations

import io
import json
import subprocess
import sys

import pytest
from click.testing import CliRunner
from infra_helpers import aws_pool, daemon, onprem_pool, stack_config
from rich.console import Console

import infra.cli
import infra.scale
from infra.automation import InfraEvent
from infra.cli import infra as infra_group
from infra.progress import ProgressView

CONFIG = stack_config(aws_pool("a100", "p4d.24xlarge", 3), onprem_pool("lab", 1))


@pytest.fixture
def dev(fake_pulumi):
    fake_pulumi.init_stack("dev", CONFIG)
    return fake_pulumi


def invoke(fake, *args: str, input: str | None = None):
    return CliRunner().invoke(infra_group, [*args, "--project-dir", str(fake.project_dir)], input=input)


def pool_count(fake, pool: str) -> int:
    pools = fake.state()["stacks"]["dev"]["config"]["trainyard:pools"]
    return next(p["count"] for p in pools if p["name"] == pool)


@pytest.mark.parametrize("args", [["preview"], ["up", "--yes"], ["scale", "a100", "2"], ["outputs"]])
def test_without_the_pulumi_cli_every_command_says_what_to_install_in_one_line(tmp_path, monkeypatch, args):
    monkeypatch.setenv("PATH", str(tmp_path))
    result = CliRunner().invoke(infra_group, args)
    assert result.exit_code == 1
    assert result.stdout == ""
    assert result.stderr.count("\n") == 1
    assert "pulumi CLI" in result.stderr and "https://www.pulumi.com/docs/install/" in result.stderr


def test_preview_lists_each_resource_and_the_totals(dev):
    result = invoke(dev, "preview", "--stack", "dev")
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0] == "Previewing stack dev"
    assert "   + aws:ec2/instance:Instance  dev-a100-2  create  planned" in lines
    assert lines[-1] == "Resources: 10 to create"
    assert "up" not in dev.commands()


def test_up_asks_after_the_preview_and_stops_on_no(dev):
    result = invoke(dev, "up", input="n\n")
    assert result.exit_code == 1
    assert "Apply these changes to stack dev?" in result.stderr and "Aborted" in result.stderr
    assert "up" not in dev.commands()


def test_up_applies_and_points_to_bootstrap_and_import(dev):
    result = invoke(dev, "up", input="y\n")
    assert result.exit_code == 0, result.output
    assert dev.commands().count("preview") == 1 and dev.commands().count("up") == 1
    assert "   + aws:ec2/instance:Instance  dev-a100-0  create  done" in result.stdout
    assert "Resources: 10 created" in result.stdout
    assert "4 nodes in the inventory" in result.stdout
    assert "trainyard bootstrap --inventory inventory.json" in result.stdout
    assert "trainyard node import inventory.json" in result.stdout


def test_up_with_nothing_to_change_says_so(dev):
    assert invoke(dev, "up", "--yes").exit_code == 0
    result = invoke(dev, "up")
    assert result.exit_code == 0 and "stack dev already matches its config" in result.stdout
    assert dev.commands().count("up") == 1


def test_outputs_writes_the_inventory_for_bootstrap_and_node_import(dev, tmp_path):
    invoke(dev, "up", "--yes")
    path = tmp_path / "inventory.json"
    result = invoke(dev, "outputs", "--inventory", str(path))
    assert result.exit_code == 0 and result.stderr == f"wrote 4 nodes to {path}\n"
    nodes = json.loads(path.read_text())
    assert [(n["name"], n["provider"]) for n in nodes] == [
        ("a100-0", "aws"), ("a100-1", "aws"), ("a100-2", "aws"), ("lab-gpu-01", "onprem"),
    ]

    to_stdout = invoke(dev, "outputs", "--inventory", "-")
    assert json.loads(to_stdout.stdout) == nodes
    table = invoke(dev, "outputs")
    assert "a100-1" in table.stdout and "8x NVIDIA A100-SXM4-40GB" in table.stdout
    assert json.loads(invoke(dev, "outputs", "--json").stdout)["inventory"] == nodes


def test_outputs_before_the_first_up_says_what_to_run(dev):
    result = invoke(dev, "outputs")
    assert result.exit_code == 0 and "has no outputs yet: run `trainyard infra up`" in result.stdout


def test_scale_down_drains_the_leaving_nodes_before_it_changes_the_count(dev, monkeypatch):
    invoke(dev, "up", "--yes")
    d = daemon(("a100-0", "UP", 8), ("a100-1", "UP", 8), ("a100-2", "UP", 2), busy_polls={"a100-2": 2})
    seen_at_drain = []
    drain = d.drain_node

    def drain_node(name, reason):
        seen_at_drain.append((name, pool_count(dev, "a100"), dev.commands().count("config set")))
        return drain(name, reason)

    monkeypatch.setattr(infra.cli, "daemon_callables", lambda: (d.list_nodes, drain_node, d.remove_node))
    result = invoke(dev, "scale", "a100", "1", "--yes", "--poll", "0.1")

    assert result.exit_code == 0, result.output
    assert seen_at_drain == [("a100-2", 3, 0), ("a100-1", 3, 0)]  # drained while the count was still 3
    assert pool_count(dev, "a100") == 1
    out = result.stdout
    assert out.index("removing a100-2, a100-1 (highest index first)") < out.index("a100-2: draining")
    assert out.index("drained: a100-2, a100-1") < out.index("stack config: a100.count = 1")
    assert "  - aws:ec2/instance:Instance  dev-a100-2  delete  done" in out
    assert out.index("delete  done") < out.index("a100-2: removed from the scheduler")
    assert sorted(d.nodes) == ["a100-0"]
    assert [n["name"] for n in dev.state()["stacks"]["dev"]["outputs"]["inventory"]] == ["a100-0", "lab-gpu-01"]


def test_scale_down_asks_naming_the_nodes_and_stops_on_no(dev, monkeypatch):
    monkeypatch.setattr(infra.cli, "daemon_callables", lambda: pytest.fail("no daemon call before the answer"))
    result = invoke(dev, "scale", "a100", "2", input="n\n")
    assert result.exit_code == 1 and "Drain and remove a100-2 from pool a100?" in result.stderr
    assert pool_count(dev, "a100") == 3


def test_scale_down_with_the_daemon_unreachable_exits_3_and_changes_nothing(dev, monkeypatch):
    d = daemon()
    d.reachable = False
    monkeypatch.setattr(infra.cli, "daemon_callables", d.callables)
    result = invoke(dev, "scale", "a100", "1", "--yes")
    assert result.exit_code == 3
    assert "cannot drain a100-2, a100-1. Nothing was changed." in result.stderr and "--force" in result.stderr
    assert pool_count(dev, "a100") == 3 and "up" not in dev.commands()


def test_scale_down_times_out_when_jobs_keep_running(dev, monkeypatch):
    d = daemon(("a100-2", "UP", 8), busy_polls={"a100-2": 10_000})
    monkeypatch.setattr(infra.cli, "daemon_callables", d.callables)
    result = invoke(dev, "scale", "a100", "2", "--yes", "--drain-timeout", "0.3", "--poll", "0.1")
    assert result.exit_code == 1
    assert "still not drained after 0.3s: a100-2 (DRAINING, 8 GPUs in use). Nothing was removed;" in result.stderr
    assert result.stderr.endswith("or give up with: trainyard node resume a100-2\n")
    assert pool_count(dev, "a100") == 3


def test_the_daemon_calls_go_through_the_schedulers_client(monkeypatch):
    import scheduler.client as client_module

    calls = []

    class Client:
        @classmethod
        def from_env(cls):
            calls.append("from_env")
            return cls()

        def nodes(self):
            return [{"name": "a100-0", "state": "UP", "gpus_used": 0}]

        def drain_node(self, name, reason):
            raise client_module.ApiError(403, "operator role required")

        def remove_node(self, name, force=False):
            raise client_module.Unreachable("cannot reach the daemon at http://127.0.0.1:8642: refused")

    monkeypatch.setattr(client_module, "Client", Client)
    list_nodes, drain_node, remove_node = infra.cli.daemon_callables()
    assert calls == []  # made on first use only
    assert list_nodes() == [{"name": "a100-0", "state": "UP", "gpus_used": 0}] and calls == ["from_env"]
    with pytest.raises(infra.scale.DrainRefused, match="the daemon refused: operator role required"):
        drain_node("a100-0", "scale-down")
    with pytest.raises(infra.scale.DaemonUnreachable, match="cannot reach the daemon at http://127.0.0.1:8642"):
        remove_node("a100-0", False)


def test_no_configured_daemon_counts_as_unreachable(monkeypatch, tmp_path):
    monkeypatch.delenv("TRAINYARD_URL", raising=False)
    monkeypatch.delenv("TRAINYARD_TOKEN", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    list_nodes, _, _ = infra.cli.daemon_callables()
    with pytest.raises(infra.scale.DaemonUnreachable, match="no daemon configured"):
        list_nodes()


def test_scale_up_needs_no_daemon_and_points_to_bootstrap(dev, monkeypatch):
    monkeypatch.setattr(infra.cli, "daemon_callables", lambda: (pytest.fail, pytest.fail, pytest.fail))
    result = invoke(dev, "scale", "a100", "5")
    assert result.exit_code == 0, result.output
    assert pool_count(dev, "a100") == 5
    assert "adding a100-3, a100-4" in result.stdout and "trainyard bootstrap --inventory" in result.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["scale", "h100", "2"], "no pool named 'h100' in trainyard:pools (pools: a100, lab)\n"),
        (["scale", "lab", "2"], "pool lab is on-prem: its hosts are declared in lab's hosts list, not scaled by count\n"),
    ],
)
def test_scale_refuses_pools_it_cannot_scale_as_a_usage_error(dev, args, message):
    result = invoke(dev, *args)
    assert result.exit_code == 2 and result.stderr == message


def test_a_failed_update_exits_1_with_the_cli_error(dev, monkeypatch):
    monkeypatch.setenv("FAKE_PULUMI_FAIL", "up")
    result = invoke(dev, "up", "--yes")
    assert result.exit_code == 1
    assert "error: dev-a100-0: InsufficientInstanceCapacity: no capacity in us-east-1a" in result.stdout
    assert "dev-a100-0  create  failed" in result.stdout
    assert result.stderr == "pulumi failed: error: update failed\n"


def test_json_prints_the_event_stream_and_keeps_people_text_on_stderr(dev):
    result = invoke(dev, "up", "--yes", "--json")
    assert result.exit_code == 0
    events = [json.loads(line) for line in result.stdout.splitlines()]
    assert {"kind": "resource", "urn": "urn:pulumi:dev::trainyard::aws:ec2/instance:Instance::dev-a100-1",
            "type": "aws:ec2/instance:Instance", "name": "dev-a100-1", "op": "create", "status": "done"} in events
    assert events[-1] == {"kind": "summary", "changes": {"create": 10}, "duration_s": 1}
    assert "next steps" in result.stderr


def test_stack_comes_from_trainyard_stack_when_not_given(dev, monkeypatch):
    dev.init_stack("prod", CONFIG, select=False)
    monkeypatch.setenv("TRAINYARD_STACK", "prod")
    assert invoke(dev, "preview").stdout.startswith("Previewing stack prod")


def test_the_terminal_view_is_a_live_table_of_resources():
    out = io.StringIO()
    console = Console(file=out, force_terminal=True, width=120, color_system=None)
    urn = "urn:pulumi:dev::trainyard::aws:ec2/instance:Instance::dev-a100-0"
    with ProgressView(console, "Updating stack dev", preview=False) as view:
        view(InfraEvent(kind="resource", urn=urn, type="aws:ec2/instance:Instance", name="dev-a100-0", op="create", status="running"))
        view(InfraEvent(kind="resource", urn=urn, type="aws:ec2/instance:Instance", name="dev-a100-0", op="create", status="done"))
        view(InfraEvent(kind="resource", urn="u2", type="aws:ec2/vpc:Vpc", name="dev-vpc", op="same", status="done"))
        view(InfraEvent(kind="summary", changes={"create": 1, "same": 1}))
    text = out.getvalue()
    assert "type" in text and "status" in text  # the table's header
    assert "dev-a100-0" in text and "done" in text and "dev-vpc" not in text
    assert text.rstrip().endswith("Resources: 1 created, 1 unchanged")


def test_the_lead_cli_finds_infra_lazily_and_importing_it_does_not_load_pulumi():
    code = "import sys, infra.cli; print(sorted(m for m in sys.modules if m.split('.')[0] in ('pulumi', 'pulumi_aws', 'grpc')))"
    loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert loaded.strip() == "[]"
    from scheduler.cli import cli

    result = CliRunner().invoke(cli, ["infra", "--help"])
    assert result.exit_code == 0 and "scale" in result.stdout and "outputs" in result.stdout
