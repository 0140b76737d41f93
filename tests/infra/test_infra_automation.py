"""The Automation API layer against a stand-in `pulumi` on PATH that records its arguments."""

from __future__ import annotations

import json

import pytest
from infra_helpers import aws_pool, onprem_pool, stack_config

from infra.automation import INSTALL_URL, InfraError, InfraStack, PulumiMissing, cli_message

CONFIG = stack_config(aws_pool("a100", "p4d.24xlarge", 3), aws_pool("l4", "g6.xlarge", 2, spot=True), onprem_pool("lab", 1))


@pytest.fixture
def dev(fake_pulumi):
    fake_pulumi.init_stack("dev", CONFIG)
    return fake_pulumi


def test_a_missing_cli_is_reported_with_what_to_install(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(PulumiMissing) as info:
        InfraStack(tmp_path, "dev")
    assert INSTALL_URL in str(info.value) and "\n" not in str(info.value)


def test_the_selected_stack_is_used_when_none_is_named(dev):
    stack = InfraStack(dev.project_dir)
    assert stack.name == "dev"
    assert dev.commands() == ["version", "stack ls", "stack select"]


def test_no_selected_stack_says_how_to_pick_one(fake_pulumi):
    with pytest.raises(InfraError, match=r"no stack selected: pass --stack NAME"):
        InfraStack(fake_pulumi.project_dir)


def test_an_unknown_stack_says_how_to_create_it(dev):
    with pytest.raises(InfraError, match=r"no stack named 'prod' in .*: create it with `pulumi stack init prod`"):
        InfraStack(dev.project_dir, "prod")


def test_preview_streams_one_event_per_resource_and_a_summary(dev):
    events = []
    changes = InfraStack(dev.project_dir, "dev").preview(on_event=events.append)

    argv = dev.calls()[-1]
    assert argv[:2] == ["--non-interactive", "preview"]
    assert argv[argv.index("--stack") + 1] == "dev"
    assert argv[argv.index("--exec-kind") + 1] == "auto.local"  # the program in infra/, as `pulumi up` runs it
    assert argv[argv.index("--color") + 1] == "never"
    assert argv[argv.index("--event-log") + 1].startswith("tcp://127.0.0.1:")
    instances = [e for e in events if e.kind == "resource" and e.type == "aws:ec2/instance:Instance"]
    assert [(e.name, e.op, e.status) for e in instances] == [
        ("dev-a100-0", "create", "planned"), ("dev-a100-1", "create", "planned"), ("dev-a100-2", "create", "planned"),
        ("dev-l4-0", "create", "planned"), ("dev-l4-1", "create", "planned"),
    ]
    assert events[-1].kind == "summary" and events[-1].changes == changes == {"create": 13}
    assert dev.state()["stacks"]["dev"]["deployed"] == {}


def test_up_runs_the_update_and_returns_the_inventory(dev):
    events = []
    stack = InfraStack(dev.project_dir, "dev")
    outputs = stack.up(on_event=events.append)

    assert dev.commands()[-4:] == ["up", "stack output", "stack output", "stack history"]
    up_argv = dev.calls()[-4]
    assert up_argv[:4] == ["--non-interactive", "up", "--yes", "--skip-preview"]
    names = [n["name"] for n in outputs["inventory"]]
    assert names == ["a100-0", "a100-1", "a100-2", "l4-0", "l4-1", "lab-gpu-01"]
    statuses = [(e.name, e.status) for e in events if e.name == "dev-a100-0"]
    assert statuses == [("dev-a100-0", "running"), ("dev-a100-0", "done")]
    assert stack.outputs() == outputs


def test_stack_config_is_read_back_typed(dev):
    config = InfraStack(dev.project_dir, "dev").config()
    assert [(p.name, p.kind) for p in config.pools] == [("a100", "aws"), ("l4", "aws"), ("lab", "onprem")]
    assert config.pool("l4").spot is True and config.name == "dev"


def test_setting_a_pool_count_sets_that_one_value_by_path(dev):
    stack = InfraStack(dev.project_dir, "dev")
    stack.set_pool_count(stack.config().pool("l4"), 5)

    assert dev.calls()[-1] == [
        "config", "set", "--path", "trainyard:pools[1].count", "--plaintext",
        "--stack", "dev", "--non-interactive", "--", "5",
    ]
    pools = dev.state()["stacks"]["dev"]["config"]["trainyard:pools"]
    assert pools[1]["count"] == 5 and pools[0] == CONFIG["pools"][0] and pools[2] == CONFIG["pools"][2]


def test_a_failed_update_names_the_failing_resource_and_the_cli_error(dev, monkeypatch):
    monkeypatch.setenv("FAKE_PULUMI_FAIL", "up")
    events = []
    with pytest.raises(InfraError) as info:
        InfraStack(dev.project_dir, "dev").up(on_event=events.append)
    assert str(info.value) == "pulumi failed: error: update failed"
    assert [e.name for e in events if e.status == "failed"] == ["dev-a100-0"]
    (error,) = [e for e in events if e.kind == "diagnostic" and e.severity == "error"]
    assert error.name == "dev-a100-0" and error.message == "InsufficientInstanceCapacity: no capacity in us-east-1a"


def test_a_config_error_in_the_stack_surfaces_as_the_programs_message(dev):
    state = dev.state()
    state["stacks"]["dev"]["config"]["trainyard:adminCidrs"] = ["0.0.0.0/0"]
    dev.state_path.write_text(json.dumps(state))
    with pytest.raises(InfraError, match="would open SSH to the whole internet"):
        InfraStack(dev.project_dir, "dev").preview()


def test_older_clis_stream_events_through_a_log_file(dev, monkeypatch):
    monkeypatch.setenv("FAKE_PULUMI_VERSION", "3.200.0")
    events = []
    InfraStack(dev.project_dir, "dev").preview(on_event=events.append)
    argv = dev.calls()[-1]
    assert argv[argv.index("--event-log") + 1].endswith("eventlog.txt")
    assert events[-1].kind == "summary" and sum(e.kind == "resource" for e in events) == 13


def test_cli_messages_keep_the_error_lines():
    from pulumi.automation import CommandError
    from pulumi.automation._cmd import CommandResult

    result = CommandResult(
        stdout="Updating (dev)\n  + aws:ec2/instance:Instance dev-a100-0 creating\nerror: update failed",
        stderr="\x1b[31merror:\x1b[0m 1 error occurred: InsufficientInstanceCapacity",
        code=255,
    )
    assert cli_message(CommandError(result)) == (
        "pulumi failed: error: 1 error occurred: InsufficientInstanceCapacity\n  error: update failed"
    )
    quiet = CommandResult(stdout="", stderr="panic: something\nexit status 2", code=2)
    assert cli_message(CommandError(quiet)) == "pulumi failed: panic: something\n  exit status 2"
