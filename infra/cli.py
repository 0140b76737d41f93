"""`trainyard infra`: preview, up, scale and outputs of the Pulumi program, through the Automation API."""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import click

# Exit codes shared by the whole trainyard CLI (DESIGN.md): 1 refused/failed, 2 usage, 3 daemon unreachable.
from scheduler.exitcodes import REFUSED as EXIT_FAILED
from scheduler.exitcodes import UNREACHABLE as EXIT_UNREACHABLE
from scheduler.exitcodes import USAGE as EXIT_USAGE

NEXT_STEPS = """next steps:
  trainyard infra outputs --inventory inventory.json
  trainyard bootstrap --inventory inventory.json
  trainyard node import inventory.json --accept-new-host-key"""


def _fail(message: str, code: int = EXIT_FAILED) -> NoReturn:
    click.echo(message, err=True)
    sys.exit(code)


def stack_command(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Shared options, the up-front pulumi check, and errors turned into one message and an exit code."""

    @click.option("--stack", "-s", "stack_name", envvar="TRAINYARD_STACK", help="stack name (default: the selected stack)")
    @click.option(
        "--project-dir",
        type=click.Path(file_okay=False, path_type=Path),
        help="directory of Pulumi.yaml (default: found from the working directory up)",
    )
    @click.option("--json", "as_json", is_flag=True, help="print the event stream as JSON lines instead of progress")
    @functools.wraps(fn)
    def wrapper(stack_name: str | None, project_dir: Path | None, as_json: bool, **kwargs: Any) -> None:
        from infra.automation import InfraError, InfraStack, find_project_dir, require_pulumi
        from infra.config import ConfigError
        from infra.scale import DaemonUnreachable, ScaleError

        try:
            require_pulumi()
            stack = InfraStack(project_dir or find_project_dir(), stack_name)
            fn(stack, as_json=as_json, **kwargs)
        except DaemonUnreachable as exc:
            _fail(str(exc), EXIT_UNREACHABLE)
        except (InfraError, ScaleError, ConfigError) as exc:
            _fail(str(exc))

    return wrapper


def _console():
    from rich.console import Console

    return Console(highlight=False)


def _view(title: str, *, preview: bool, as_json: bool):
    from infra.progress import JsonLines, ProgressView

    # With --json, stdout carries only the event stream; people-facing text goes to stderr.
    return JsonLines(_console()) if as_json else ProgressView(_console(), title, preview=preview)


def _say(as_json: bool) -> Callable[[str], None]:
    return lambda line: click.echo(line, err=as_json)


@click.group("infra")
def infra() -> None:
    """Provision the cluster as code: AWS GPU pools and on-prem hosts (the Pulumi program in infra/).

    Needs the pulumi CLI. The stack's config lives under trainyard:* (docs/infra.md).
    """


@infra.command()
@stack_command
def preview(stack: Any, *, as_json: bool) -> None:
    """Show what `up` would change, resource by resource."""
    with _view(f"Previewing stack {stack.name}", preview=True, as_json=as_json) as view:
        stack.preview(on_event=view)


@infra.command()
@click.option("--yes", "-y", is_flag=True, help="apply without the preview and confirmation")
@stack_command
def up(stack: Any, *, as_json: bool, yes: bool) -> None:
    """Create or update the cluster's resources to match the stack config."""
    say = _say(as_json)
    if not yes:
        with _view(f"Previewing stack {stack.name}", preview=True, as_json=as_json) as view:
            changes = stack.preview(on_event=view)
        if not any(n for op, n in changes.items() if op != "same"):
            say(f"stack {stack.name} already matches its config")
            return
        click.confirm(f"Apply these changes to stack {stack.name}?", abort=True, err=True)
    with _view(f"Updating stack {stack.name}", preview=False, as_json=as_json) as view:
        outputs = stack.up(on_event=view)
    say(f"{len(outputs.get('inventory') or [])} nodes in the inventory")
    say(NEXT_STEPS)


@infra.command()
@click.argument("pool")
@click.argument("count", type=click.IntRange(min=0))
@click.option("--yes", "-y", is_flag=True, help="do not ask for confirmation before removing nodes")
@click.option("--force", is_flag=True, help="remove nodes without waiting for their jobs to end (they are lost)")
@click.option(
    "--drain-timeout",
    type=click.FloatRange(min=0),
    default=3600.0,
    show_default=True,
    help="seconds to wait for leaving nodes to drain",
)
@click.option("--poll", type=click.FloatRange(min=0.1), default=10.0, hidden=True)
@stack_command
def scale(stack: Any, *, as_json: bool, pool: str, count: int, yes: bool, force: bool, drain_timeout: float, poll: float) -> None:
    """Set POOL to COUNT nodes; nodes that go are drained first (highest index first)."""
    from infra.config import ConfigError
    from infra.scale import plan_scale
    from infra.scale import scale as run_scale

    say = _say(as_json)
    config = stack.config()
    try:
        plan = plan_scale(config, pool, count)
    except ConfigError as exc:
        _fail("; ".join(exc.problems), EXIT_USAGE)
    if plan.target == plan.current:
        say(plan.describe())
        return
    if plan.leaving and not yes:
        click.confirm(f"Drain and remove {', '.join(plan.leaving)} from pool {pool}?", abort=True, err=True)
    list_nodes, drain_node, remove_node = daemon_callables()
    with _view(f"Scaling pool {pool} of stack {stack.name}", preview=False, as_json=as_json) as view:
        outputs = run_scale(
            stack,
            plan,
            list_nodes=list_nodes,
            drain_node=drain_node,
            remove_node=remove_node,
            report=say,
            on_event=view,
            force=force,
            timeout=drain_timeout,
            poll=poll,
        )
    say(f"{len(outputs.get('inventory') or [])} nodes in the inventory")
    if plan.joining:
        say(NEXT_STEPS)


@infra.command()
@click.option(
    "--inventory",
    "inventory_path",
    type=click.Path(dir_okay=False, path_type=Path, allow_dash=True),
    help="write the inventory document (JSON) to this file, '-' for stdout",
)
@stack_command
def outputs(stack: Any, *, as_json: bool, inventory_path: Path | None) -> None:
    """Show the stack's outputs; --inventory writes the node inventory for bootstrap and node import."""
    from infra import inventory

    values = stack.outputs()
    nodes = list(values.get("inventory") or [])
    if inventory_path is not None:
        if str(inventory_path) == "-":
            click.echo(inventory.dumps(nodes), nl=False)
        else:
            try:
                inventory.write(inventory_path, nodes)
            except ValueError as exc:
                _fail(str(exc))
            click.echo(f"wrote {len(nodes)} nodes to {inventory_path}", err=True)
        return
    if as_json:
        click.echo(json.dumps(values, indent=2))
        return
    if not values:
        click.echo(f"stack {stack.name} has no outputs yet: run `trainyard infra up`")
        return
    _print_nodes(nodes)


def _print_nodes(nodes: list[dict]) -> None:
    from rich.table import Table

    table = Table(box=None, header_style="bold", pad_edge=False)
    for column in ("name", "address", "login", "pool", "provider", "gpus"):
        table.add_column(column)
    for n in nodes:
        port = "" if n["ssh_port"] == 22 else f" (port {n['ssh_port']})"
        gpus = f"{n['gpu_count']}x {n['gpu_model']}" if n["gpu_count"] else "-"
        table.add_row(n["name"], n["address"] or "-", n["ssh_user"] + port, n["pool"], n["provider"], gpus)
    _console().print(table)


def daemon_callables():
    """The daemon's node list, drain and remove, as the plain callables infra.scale takes.

    The client is made on first use, so a scale-up never needs a daemon.
    """
    from infra.scale import DaemonUnreachable, DrainRefused

    client = None

    def call(method: str, *args: Any) -> Any:
        nonlocal client
        from scheduler.client import ApiError, Client, NotConfigured, Unreachable

        try:
            if client is None:
                client = Client.from_env()
            return getattr(client, method)(*args)
        except (Unreachable, NotConfigured) as exc:
            raise DaemonUnreachable(str(exc)) from None
        except ApiError as exc:
            raise DrainRefused(f"the daemon refused: {exc.detail}") from None

    return (
        lambda: call("nodes"),
        lambda name, reason: call("drain_node", name, reason),
        lambda name, force: call("remove_node", name, force),
    )
