"""Drives the Pulumi program through the Automation API: preview, up, outputs, and a pool's count."""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from infra.config import NAMESPACE, AwsPool, ClusterConfig, parse_config, raw_from_strings

INSTALL_URL = "https://www.pulumi.com/docs/install/"
INSTALL_HINT = (
    f"trainyard infra needs the pulumi CLI, which is not on PATH: install it ({INSTALL_URL}, "
    "e.g. `curl -fsSL https://get.pulumi.com | sh`) and open a new shell"
)


class InfraError(Exception):
    """Something the operator must fix; the message says what."""


class PulumiMissing(InfraError):
    pass


def require_pulumi() -> str:
    path = shutil.which("pulumi")
    if path is None:
        raise PulumiMissing(INSTALL_HINT)
    return path


def find_project_dir(start: Path | None = None) -> Path:
    """The directory holding Pulumi.yaml: the working directory or a parent, else this checkout."""
    start = (start or Path.cwd()).resolve()
    for d in (start, *start.parents):
        if (d / "Pulumi.yaml").is_file():
            return d
    checkout = Path(__file__).resolve().parent.parent
    if (checkout / "Pulumi.yaml").is_file():
        return checkout
    raise InfraError(f"no Pulumi.yaml in {start} or its parents; run from the trainyard checkout or pass --project-dir")


# -- the event stream ---------------------------------------------------------------------------


@dataclass(frozen=True)
class InfraEvent:
    """One thing that happened during a preview or an update, in a shape a terminal or the TUI can show.

    kind: "resource" (op + status for one resource), "diagnostic" (a message, maybe about a
    resource), or "summary" (the counts of changes at the end).
    status of a resource: "planned" (preview), "running", "done" or "failed".
    """

    kind: str
    urn: str = ""
    type: str = ""
    name: str = ""
    op: str = ""
    status: str = ""
    severity: str = ""
    message: str = ""
    changes: Mapping[str, int] = field(default_factory=dict)
    duration_s: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v not in ("", None, {})}


OnEvent = Callable[[InfraEvent], Any]

_ANSI = re.compile(r"\x1b\[[0-9;]*m|<\{%[^%]*%\}>")


def translate(event: Any) -> InfraEvent | None:
    """An engine event (pulumi.automation.EngineEvent) as an InfraEvent, or None for the ones we skip."""
    if event.resource_pre_event is not None:
        pre = event.resource_pre_event
        return _resource(pre.metadata, "planned" if pre.planning else "running")
    if event.res_outputs_event is not None:
        out = event.res_outputs_event
        return _resource(out.metadata, "planned" if out.planning else "done")
    if event.res_op_failed_event is not None:
        return _resource(event.res_op_failed_event.metadata, "failed")
    if event.diagnostic_event is not None:
        d = event.diagnostic_event
        message = _ANSI.sub("", d.message or "").strip()
        if not message:
            return None
        urn = d.urn or ""
        return InfraEvent(
            kind="diagnostic", urn=urn, name=_name(urn), severity=d.severity or "info", message=message
        )
    if event.summary_event is not None:
        s = event.summary_event
        return InfraEvent(kind="summary", changes=dict(s.resource_changes or {}), duration_s=s.duration_seconds)
    return None


def _resource(meta: Any, status: str) -> InfraEvent:
    op = getattr(meta.op, "value", meta.op)
    return InfraEvent(kind="resource", urn=meta.urn, type=meta.type, name=_name(meta.urn), op=op, status=status)


def _name(urn: str) -> str:
    return urn.rsplit("::", 1)[-1] if urn else ""


# -- the stack ----------------------------------------------------------------------------------


class InfraStack:
    """One stack of the trainyard project, driven through the Automation API (the pulumi CLI underneath)."""

    def __init__(self, project_dir: Path, stack: str | None = None):
        require_pulumi()
        from pulumi import automation as auto

        self._auto = auto
        try:
            workspace = auto.LocalWorkspace(work_dir=str(project_dir))
            if stack is None:
                current = workspace.stack()
                if current is None:
                    raise InfraError(
                        "no stack selected: pass --stack NAME (or set TRAINYARD_STACK), "
                        "or select one with `pulumi stack select NAME`"
                    )
                stack = current.name
            self._stack = auto.Stack.select(stack, workspace)
        except FileNotFoundError:
            raise PulumiMissing(INSTALL_HINT) from None
        except auto.StackNotFoundError:
            raise InfraError(
                f"no stack named {stack!r} in {project_dir}: create it with `pulumi stack init {stack}` "
                "and set its config (docs/infra.md)"
            ) from None
        except (auto.CommandError, auto.InvalidVersionError) as exc:
            raise InfraError(cli_message(exc)) from None
        self.name = stack

    # config --------------------------------------------------------------------------------

    def raw_config(self) -> dict[str, Any]:
        values = self._run(self._stack.get_all_config)
        prefix = f"{NAMESPACE}:"
        return raw_from_strings({k[len(prefix) :]: v.value for k, v in values.items() if k.startswith(prefix)})

    def config(self) -> ClusterConfig:
        from infra.program import default_cluster_name

        return parse_config(self.raw_config(), default_name=default_cluster_name(self.name))

    def set_pool_count(self, pool: AwsPool, count: int) -> None:
        """Change one pool's count in the stack config (`pulumi config set --path`), nothing else."""
        pools = self.raw_config().get("pools") or []
        names = [p.get("name") if isinstance(p, dict) else None for p in pools]
        if pool.name not in names:
            raise InfraError(f"stack {self.name} has no pool {pool.name!r} in {NAMESPACE}:pools")
        index = names.index(pool.name)
        value = self._auto.ConfigValue(value=str(count))
        self._run(self._stack.set_config, f"{NAMESPACE}:pools[{index}].count", value, path=True)

    # operations ----------------------------------------------------------------------------

    def preview(self, on_event: OnEvent | None = None) -> dict[str, int]:
        result = self._run(self._stack.preview, color="never", on_event=_relay(on_event))
        return dict(result.change_summary or {})

    def up(self, on_event: OnEvent | None = None) -> dict[str, Any]:
        result = self._run(self._stack.up, color="never", on_event=_relay(on_event))
        return {k: v.value for k, v in result.outputs.items()}

    def outputs(self) -> dict[str, Any]:
        return {k: v.value for k, v in self._run(self._stack.outputs).items()}

    def _run(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            raise PulumiMissing(INSTALL_HINT) from None
        except self._auto.ConcurrentUpdateError:
            raise InfraError(
                f"another update of stack {self.name} is running; wait for it (or, if it died, "
                f"`pulumi cancel --stack {self.name}`)"
            ) from None
        except self._auto.CommandError as exc:
            raise InfraError(cli_message(exc)) from None


def _relay(on_event: OnEvent | None) -> Callable[[Any], None] | None:
    if on_event is None:
        return None

    def relay(engine_event: Any) -> None:
        event = translate(engine_event)
        if event is not None:
            on_event(event)

    return relay


def cli_message(exc: Exception) -> str:
    """The lines of a failed pulumi command that say what went wrong, without the noise around them."""
    # A CommandError's text is the CommandResult's: "\n code: N\n stdout: ...\n stderr: ...".
    found = re.search(r"\n stdout: (.*)\n stderr: (.*)\Z", str(exc), re.S)
    stdout, stderr = found.groups() if found else ("", str(exc))
    lines = [_ANSI.sub("", ln).rstrip() for ln in (stderr + "\n" + stdout).splitlines()]
    lines = [ln for ln in lines if ln.strip()]
    picked: list[str] = []
    indent = None  # inside an error: its more-indented or "- " lines continue it
    for ln in lines:
        depth = len(ln) - len(ln.lstrip())
        if ln.strip().lower().startswith("error:"):
            picked.append(ln.strip())
            indent = depth
        elif indent is not None and (depth > indent or ln.strip().startswith("- ")):
            picked.append("  " + ln.strip())
        else:
            indent = None
    picked = list(dict.fromkeys(picked)) or [ln.strip() for ln in lines[-5:]] or [type(exc).__name__]
    return "pulumi failed: " + "\n  ".join(picked)
