"""`trainyard bootstrap`: run playbooks/site.yml on nodes through ansible-runner and report per host."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import click

from . import exitcodes
from .config import home

PLAYBOOKS = Path(__file__).resolve().parent.parent / "playbooks"
INVENTORY_SCRIPT = PLAYBOOKS / "inventory" / "trainyard_inventory.py"

# Events that say how one task went on one host, and the word the progress line shows.
RESULT_EVENTS = {
    "runner_on_ok": "ok",
    "runner_on_failed": "failed",
    "runner_on_unreachable": "unreachable",
    "runner_on_skipped": "skipped",
    "runner_item_on_failed": "failed",
}

ProgressSink = Callable[[dict[str, Any]], None]
NodeBootstrapFn = Callable[..., Any]


class BootstrapError(Exception):
    """Bootstrap cannot start (bad inventory, missing key, no hosts); the message says what to do."""


def _inventory_module():
    """The inventory script under playbooks/, loaded as a module: one conversion for both paths."""
    spec = importlib.util.spec_from_file_location("trainyard_inventory", INVENTORY_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def inventory_from_document(doc: Any) -> dict:
    """Ansible inventory for an inventory document (DESIGN.md boundary 6)."""
    module = _inventory_module()
    try:
        return module.to_inventory(doc)
    except module.InventoryError as exc:
        raise BootstrapError(str(exc)) from None


def inventory_from_file(path: str | os.PathLike) -> dict:
    module = _inventory_module()
    try:
        return module.load(str(path))
    except module.InventoryError as exc:
        raise BootstrapError(str(exc)) from None


def document_from_daemon_nodes(
    nodes: Iterable[Mapping[str, Any]], ssh_user: str | None = None
) -> list[dict]:
    """The inventory document for the nodes the daemon knows (`Client.nodes()` dicts)."""
    doc = []
    for node in nodes:
        doc.append(
            {
                "name": node["name"],
                "address": node["address"],
                "ssh_user": ssh_user or node.get("user") or "root",
                "ssh_port": int(node.get("port") or 22),
                "pool": node.get("pool") or "default",
                "provider": node.get("provider") or "onprem",
                "gpu_model": node.get("gpu_model") or "",
                "gpu_count": int(node.get("gpus_total") or 0),
                "labels": dict(node.get("labels") or {}),
            }
        )
    return doc


@dataclass
class HostSummary:
    """How the play went on one host (the numbers of Ansible's PLAY RECAP)."""

    host: str
    ok: int = 0
    changed: int = 0
    failed: int = 0
    unreachable: int = 0
    skipped: int = 0
    first_error: str = ""

    @property
    def outcome(self) -> str:
        if self.unreachable:
            return "unreachable"
        if self.failed:
            return "failed"
        return "changed" if self.changed else "ok"


@dataclass
class BootstrapResult:
    rc: int
    status: str
    check: bool
    hosts: dict[str, HostSummary] = field(default_factory=dict)
    events_path: str | None = None
    warnings: list[str] = field(default_factory=list)

    @property
    def succeeded(self) -> bool:
        return (
            self.status == "successful"
            and bool(self.hosts)
            and all(h.outcome in ("ok", "changed") for h in self.hosts.values())
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "rc": self.rc,
            "status": self.status,
            "check": self.check,
            "events": self.events_path,
            "warnings": self.warnings,
            "hosts": {
                name: {**asdict(h), "outcome": h.outcome} for name, h in sorted(self.hosts.items())
            },
        }


def _error_text(res: Mapping[str, Any]) -> str:
    """The most telling line of a failed task's result."""
    if res.get("results"):  # a loop: the first failed item says it
        for item in res["results"]:
            if isinstance(item, Mapping) and item.get("failed"):
                return _error_text(item)
    for key in ("msg", "stderr", "module_stderr", "stdout", "reason"):
        value = res.get(key)
        if value:
            text = str(value).strip()
            return text.splitlines()[0][:400] if key != "msg" else text[:400]
    return "failed without a message"


class EventTranslator:
    """Turns ansible-runner events into progress records (one per host and task) and a summary."""

    def __init__(
        self, sink: ProgressSink | None = None, on_host_start: Callable[[str], None] | None = None
    ):
        self.sink = sink
        self.on_host_start = on_host_start
        self.hosts: dict[str, HostSummary] = {}
        self.started: set[str] = set()
        self.stats_seen = False

    def _host(self, name: str) -> HostSummary:
        return self.hosts.setdefault(name, HostSummary(host=name))

    def __call__(self, event: Mapping[str, Any]) -> bool:
        kind = event.get("event", "")
        data = event.get("event_data") or {}
        host = data.get("host") or data.get("remote_addr")
        record: dict[str, Any] | None = None
        if kind == "runner_on_start" and host and host not in self.started:
            self.started.add(host)
            self._host(host)
            if self.on_host_start:
                self.on_host_start(host)
        elif kind == "playbook_on_play_start":
            record = {"type": "play", "play": data.get("play", "")}
        elif kind in RESULT_EVENTS and host:
            res = data.get("res") or {}
            status = RESULT_EVENTS[kind]
            if status == "ok" and res.get("changed"):
                status = "changed"
            record = {
                "type": "task",
                "host": host,
                "role": data.get("role", ""),
                "task": data.get("task", ""),
                "status": status,
            }
            ignored = bool(data.get("ignore_errors"))
            if status in ("failed", "unreachable"):
                record["error"] = _error_text(res)
                record["ignored"] = ignored
                summary = self._host(host)
                if not ignored and not summary.first_error and kind != "runner_item_on_failed":
                    where = (
                        f"{data.get('role')} : {data.get('task')}"
                        if data.get("role")
                        else data.get("task", "")
                    )
                    summary.first_error = f"{where}: {record['error']}"
            if kind == "runner_item_on_failed":
                record = None  # the task's own runner_on_failed follows and is reported
        elif kind == "playbook_on_stats":
            self.stats_seen = True
            for key, attr in (
                ("ok", "ok"),
                ("changed", "changed"),
                ("failures", "failed"),
                ("dark", "unreachable"),
                ("skipped", "skipped"),
            ):
                for name, count in (data.get(key) or {}).items():
                    setattr(self._host(name), attr, int(count))
            record = {"type": "stats", "hosts": {n: asdict(h) for n, h in self.hosts.items()}}
        if record is not None and self.sink:
            record["time"] = round(time.time(), 3)
            self.sink(record)
        return True  # keep ansible-runner's own artifact files too


def _venv_path() -> str:
    """PATH with this interpreter's bin/ first, so ansible-runner finds our ansible-playbook."""
    bin_dir = str(Path(sys.executable).parent)
    return os.pathsep.join([bin_dir, os.environ.get("PATH", "")])


def run_bootstrap(
    inventory: dict,
    *,
    playbook: str | os.PathLike = "site.yml",
    project_dir: str | os.PathLike = PLAYBOOKS,
    limit: str | None = None,
    check: bool = False,
    tags: Iterable[str] = (),
    extravars: Mapping[str, Any] | None = None,
    envvars: Mapping[str, str] | None = None,
    progress: ProgressSink | None = None,
    events_path: str | os.PathLike | None = None,
    node_bootstrap: NodeBootstrapFn | None = None,
    timeout: int | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
) -> BootstrapResult:
    """Run a playbook with ansible-runner in a fresh private data dir; return the per-host summary.

    `progress` receives one record per play, per host-and-task result and the final stats; the
    same records go, as JSON lines, to `events_path`. `node_bootstrap(name, phase, detail)`
    tells the daemon when a host starts ("start") and how it ended ("done"/"failed"); it is not
    called in check mode, and its errors become warnings, never a failed bootstrap. `on_event`
    sees every raw ansible-runner event.
    """
    import ansible_runner  # heavy: only when a bootstrap really runs

    warnings: list[str] = []
    events_file = open(events_path, "a", encoding="utf-8") if events_path else None  # noqa: SIM115

    def sink(record: dict[str, Any]) -> None:
        if events_file:
            events_file.write(json.dumps(record) + "\n")
            events_file.flush()
        if progress:
            progress(record)

    def tell_daemon(name: str, phase: str, detail: str = "") -> None:
        if node_bootstrap is None or check:
            return
        try:
            node_bootstrap(name, phase, detail)
        except Exception as exc:  # the daemon's view is secondary to the bootstrap itself
            message = f"could not tell the daemon that {name} {phase}: {exc}"
            warnings.append(message)
            sink({"type": "warning", "host": name, "message": message})

    translator = EventTranslator(sink, on_host_start=lambda host: tell_daemon(host, "start"))

    def handle(event: dict[str, Any]) -> bool:
        if on_event:
            on_event(event)
        return translator(event)

    env = {
        "PATH": _venv_path(),
        "ANSIBLE_CONFIG": str(Path(project_dir) / "ansible.cfg"),
        "ANSIBLE_FORCE_COLOR": "0",
        "ANSIBLE_NOCOLOR": "1",
        **(envvars or {}),
    }
    cmdline = "--check --diff" if check else None
    rc, status = -1, "error"
    try:
        with tempfile.TemporaryDirectory(prefix="trainyard-bootstrap-") as private_data_dir:
            runner = ansible_runner.run(
                private_data_dir=private_data_dir,
                project_dir=str(project_dir),
                playbook=str(playbook),
                inventory=inventory,
                extravars=dict(extravars or {}),
                envvars=env,
                limit=limit or None,
                tags=",".join(tags) or None,
                cmdline=cmdline,
                event_handler=handle,
                quiet=True,
                timeout=timeout,
            )
            rc, status = runner.rc, runner.status
            if not translator.stats_seen and rc != 0:
                # Ansible stopped before the play (bad limit, syntax error): keep its words.
                stdout = runner.stdout.read() if runner.stdout else ""
                lines = [ln for ln in stdout.splitlines() if ln.strip()]
                text = "\n".join(lines[-5:]) or f"ansible-playbook exited with {rc}"
                warnings.append(text)
                sink({"type": "error", "message": text})
    finally:
        result_hosts = translator.hosts
        if events_file:
            events_file.close()

    result = BootstrapResult(
        rc=rc,
        status=status,
        check=check,
        hosts=dict(result_hosts),
        events_path=str(events_path) if events_path else None,
        warnings=warnings,
    )
    for name in sorted(translator.started):
        summary = result.hosts[name]
        if summary.outcome in ("ok", "changed"):
            tell_daemon(name, "done")
        else:
            tell_daemon(name, "failed", summary.first_error or summary.outcome)
    return result


# ---------------------------------------------------------------- terminal output

STATUS_COLOURS = {
    "ok": "green",
    "changed": "yellow",
    "failed": "red",
    "unreachable": "red",
    "skipped": "cyan",
}


def format_progress(record: Mapping[str, Any]) -> str | None:
    """One terminal line for a progress record (None for records not worth a line)."""
    kind = record.get("type")
    if kind == "play":
        return click.style(f"PLAY {record['play']}", bold=True)
    if kind == "task":
        status = record["status"]
        if status == "skipped":
            return None
        task = f"{record['role']} : {record['task']}" if record.get("role") else record["task"]
        line = f"{click.style(f'{status:<11}', fg=STATUS_COLOURS.get(status))} {record['host']:<20} {task}"
        if record.get("error"):
            suffix = " (ignored)" if record.get("ignored") else ""
            line += f"\n{'':<32}{record['error']}{suffix}"
        return line
    if kind in ("warning", "error"):
        return click.style(
            f"{kind}: {record['message']}", fg="yellow" if kind == "warning" else "red"
        )
    return None


def format_summary(result: BootstrapResult) -> str:
    """The per-host recap: ok / changed / failed / unreachable, and each failed host's first error."""
    if not result.hosts:
        return "no host was bootstrapped"
    width = max(len("HOST"), *(len(h) for h in result.hosts))
    lines = [
        f"{'HOST':<{width}}  {'RESULT':<11}  {'OK':>4}  {'CHANGED':>7}  {'FAILED':>6}  {'UNREACHABLE':>11}"
    ]
    for name, h in sorted(result.hosts.items()):
        outcome = click.style(f"{h.outcome:<11}", fg=STATUS_COLOURS.get(h.outcome))
        lines.append(
            f"{name:<{width}}  {outcome}  {h.ok:>4}  {h.changed:>7}  {h.failed:>6}  {h.unreachable:>11}"
        )
    for name, h in sorted(result.hosts.items()):
        if h.first_error:
            lines.append(f"{name}: {h.first_error}")
    failed = [n for n, h in result.hosts.items() if h.outcome in ("failed", "unreachable")]
    mode = " (check mode: nothing was changed)" if result.check else ""
    if failed:
        lines.append(f"{len(failed)} of {len(result.hosts)} host(s) failed{mode}")
    else:
        lines.append(f"{len(result.hosts)} host(s) bootstrapped{mode}")
    return "\n".join(lines)


def default_ssh_public_key() -> Path:
    return home() / "ssh" / "id_ed25519.pub"


def default_events_path() -> Path:
    stamp = time.strftime("%Y%m%dT%H%M%S")
    return home() / "bootstrap" / f"{stamp}-{os.getpid()}.jsonl"


def read_public_key(path: Path) -> str:
    try:
        key = path.read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        raise BootstrapError(
            f"the daemon's SSH public key {path} does not exist; start `trainyard daemon` once "
            "(it creates the key there) or pass --ssh-public-key PATH"
        ) from None
    except OSError as exc:
        raise BootstrapError(f"cannot read the SSH public key {path}: {exc.strerror}") from None
    if not key.startswith(("ssh-", "ecdsa-", "sk-")) or "\n" in key:
        raise BootstrapError(
            f"{path} does not hold one OpenSSH public key (a line like 'ssh-ed25519 AAAA...')"
        )
    return key


@click.command("bootstrap")
@click.option(
    "--inventory",
    "inventory_file",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Inventory document (JSON, as `pulumi stack output inventory --json` writes it).",
)
@click.option("--from-daemon", is_flag=True, help="Bootstrap the nodes the daemon knows.")
@click.option(
    "--limit",
    metavar="HOSTS",
    help="Only these hosts or groups (Ansible pattern, e.g. 'gpu-a*,pool_h100').",
)
@click.option(
    "--check", is_flag=True, help="Show what would change, change nothing (ansible --check --diff)."
)
@click.option(
    "--tags",
    multiple=True,
    metavar="TAG",
    help="Only these roles' tasks: common, nvidia_driver, cuda, container_toolkit, storage, trainyard_node, gpu. Repeatable or comma-separated.",
)
@click.option(
    "--ssh-public-key",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Public key the daemon logs in with [default: $TRAINYARD_HOME/ssh/id_ed25519.pub].",
)
@click.option(
    "--ssh-user",
    metavar="USER",
    help="Log in as USER (with sudo) instead of the inventory's ssh_user.",
)
@click.option(
    "--private-key",
    type=click.Path(exists=True, dir_okay=False),
    help="SSH private key to log in with.",
)
@click.option(
    "--known-hosts",
    type=click.Path(dir_okay=False),
    help="known_hosts file that pins the nodes' host keys (strict checking).",
)
@click.option(
    "-e",
    "--extra-vars",
    "extra",
    multiple=True,
    metavar="KEY=VALUE",
    help="Role variable, e.g. -e nvidia_driver_branch=570 (value parsed as JSON when it is JSON).",
)
@click.option(
    "--register",
    is_flag=True,
    help="Register each node with the daemon (TRAINYARD_URL/TRAINYARD_TOKEN).",
)
@click.option(
    "--accept-new-host-key",
    is_flag=True,
    help="With --register: let the daemon pin each node's SSH host key on first contact.",
)
@click.option(
    "--events",
    "events_path",
    type=click.Path(dir_okay=False, path_type=Path),
    help="Write progress as JSON lines here [default: $TRAINYARD_HOME/bootstrap/<time>.jsonl].",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print the summary as JSON (progress goes to stderr)."
)
def bootstrap(
    inventory_file,
    from_daemon,
    limit,
    check,
    tags,
    ssh_public_key,
    ssh_user,
    private_key,
    known_hosts,
    extra,
    register,
    accept_new_host_key,
    events_path,
    as_json,
):
    """Bootstrap nodes: drivers, CUDA, container toolkit and the trainyard user (Ansible site.yml)."""
    if bool(inventory_file) == bool(from_daemon):
        raise click.UsageError("give exactly one of --inventory FILE or --from-daemon")
    tag_list = [t.strip() for value in tags for t in value.split(",") if t.strip()]
    extravars: dict[str, Any] = {}
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise click.UsageError(f"--extra-vars {item!r} is not KEY=VALUE")
        try:
            extravars[key] = json.loads(value)
        except json.JSONDecodeError:
            extravars[key] = value

    out = sys.stderr if as_json else sys.stdout
    client = None
    try:
        key_path = ssh_public_key or default_ssh_public_key()
        extravars.setdefault("common_trainyard_ssh_public_key", read_public_key(key_path))
        client = _client(required=from_daemon or register)
        if inventory_file:
            inventory = inventory_from_file(inventory_file)
        else:
            inventory = inventory_from_document(
                document_from_daemon_nodes(_daemon_nodes(client), ssh_user)
            )
        if not inventory["all"]["hosts"]:
            raise BootstrapError("the inventory has no nodes; nothing to bootstrap")
    except BootstrapError as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exitcodes.FAILED)

    if ssh_user:
        extravars["ansible_user"] = ssh_user
    if private_key:
        extravars["ansible_ssh_private_key_file"] = str(Path(private_key).resolve())
    if known_hosts:
        extravars["ansible_ssh_common_args"] = (
            f"-o UserKnownHostsFile={Path(known_hosts).resolve()} -o StrictHostKeyChecking=yes"
        )
    if register:
        url, token = _client_credentials(client)
        extravars.update(
            trainyard_node_register=True,
            trainyard_node_daemon_url=url,
            trainyard_node_daemon_token=token,
            trainyard_node_register_accept_new_host_key=accept_new_host_key,
        )

    events = events_path or default_events_path()
    events.parent.mkdir(parents=True, exist_ok=True)

    def progress(record: dict[str, Any]) -> None:
        line = format_progress(record)
        if line:
            click.echo(line, file=out)

    result = run_bootstrap(
        inventory,
        limit=limit,
        check=check,
        tags=tag_list,
        extravars=extravars,
        progress=progress,
        events_path=events,
        node_bootstrap=_notifier(client) if client is not None else None,
    )
    if as_json:
        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        click.echo("", file=out)
        click.echo(format_summary(result), file=out)
        click.echo(f"events: {events}", file=out)
    sys.exit(exitcodes.OK if result.succeeded else exitcodes.FAILED)


def _client(required: bool):
    """The daemon's API client. Exit 3 when it is required but not configured; else None."""
    from scheduler import client as client_module  # lazy: the CLI stays fast

    try:
        return client_module.Client.from_env()
    except client_module.BadSettings as exc:
        click.echo(f"error: {exc}", err=True)
        sys.exit(exitcodes.USAGE)
    except client_module.NotConfigured as exc:
        if required:
            click.echo(f"error: {exc}", err=True)
            sys.exit(exitcodes.UNREACHABLE)
        return None


def _notifier(client) -> NodeBootstrapFn:
    """client.node_bootstrap, quiet about nodes the daemon does not know (not imported yet)."""
    from scheduler import client as client_module

    def notify(name: str, phase: str, detail: str = "") -> None:
        try:
            client.node_bootstrap(name, phase, detail)
        except client_module.ApiError as exc:
            if exc.status != 404:
                raise

    return notify


def _daemon_nodes(client) -> list[dict]:
    from scheduler import client as client_module

    try:
        return list(client.nodes())
    except client_module.Unreachable as exc:
        click.echo(
            f"error: the daemon is unreachable: {exc}; start it or check TRAINYARD_URL", err=True
        )
        sys.exit(exitcodes.UNREACHABLE)
    except client_module.ApiError as exc:
        click.echo(
            f"error: the daemon refused to list nodes: {getattr(exc, 'detail', exc)}", err=True
        )
        sys.exit(exitcodes.REFUSED)


def _client_credentials(client) -> tuple[str, str]:
    """Daemon URL and token for the trainyard_node role's registration call."""
    from scheduler import client as client_module

    return client_module.load_settings()
