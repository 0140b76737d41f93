"""Where trainyard keeps things, and the daemon's settings (trainyard.toml)."""

from __future__ import annotations

import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any


def home() -> Path:
    """The daemon's state directory: database, known_hosts, its SSH key."""
    return Path(os.environ.get("TRAINYARD_HOME") or "~/.local/share/trainyard").expanduser()


def client_config_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or "~/.config"
    return Path(base).expanduser() / "trainyard" / "client.toml"


def write_private(path: Path, text: str) -> None:
    """Write a secret file readable by its owner only (created 0600, never world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_suffix(path.suffix + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def parse_listen(value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--listen {value!r}: expected HOST:PORT, e.g. 127.0.0.1:8471")
    return host.strip("[]") or "127.0.0.1", int(port)


@dataclass
class DaemonConfig:
    """Settings of `trainyard daemon`; every field can be set in the [daemon] table."""

    listen: str = "127.0.0.1:8471"  # loopback unless configured otherwise
    db: str = ""  # default: sqlite file under TRAINYARD_HOME
    cluster_name: str = "trainyard"
    # a node unreachable this long goes DOWN and its jobs NODE_FAIL
    node_grace_s: float = 60.0
    connect_timeout_s: float = 10.0
    keepalive_interval_s: float = 3.0
    keepalive_count_max: int = 3
    reconnect_max_backoff_s: float = 10.0
    # seconds between SIGTERM and SIGKILL for cancel, timeout and preemption
    kill_grace_s: float = 10.0
    schedule_interval_s: float = 1.0
    telemetry_interval_s: float = 2.0
    # the raw [scheduler], [queues.*] and [teams.*] tables, handed to the planner's policy
    policy: dict[str, Any] = field(default_factory=dict)
    # the raw [health] table: GPU health rules (scheduler/health.py)
    health: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def load(cls, path: str | Path | None) -> DaemonConfig:
        if path is None:
            return cls()
        p = Path(path).expanduser()
        try:
            data = tomllib.loads(p.read_text())
        except FileNotFoundError:
            raise ValueError(f"config file {str(p)!r} does not exist") from None
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"config file {str(p)!r} is not valid TOML: {e}") from None
        daemon = data.get("daemon", {})
        known = {f.name: f for f in fields(cls)}
        known.pop("policy")
        known.pop("health")
        kwargs: dict[str, Any] = {}
        for key, value in daemon.items():
            if key not in known:
                raise ValueError(f"{p}: unknown setting [daemon].{key}; known: {', '.join(sorted(known))}")
            want = type(getattr(cls(), key))
            if want is float and isinstance(value, int):
                value = float(value)
            if not isinstance(value, want):
                raise ValueError(f"{p}: [daemon].{key} = {value!r} should be a {want.__name__}")
            kwargs[key] = value
        policy = {k: v for k, v in data.items() if k in ("scheduler", "queues", "teams")}
        unknown = set(data) - {"daemon", "scheduler", "queues", "teams", "health"}
        if unknown:
            raise ValueError(f"{p}: unknown table [{sorted(unknown)[0]}]; known: daemon, scheduler, queues, teams, health")
        return cls(**kwargs, policy=policy, health=data.get("health", {}))
