"""Where trainyard keeps things: TRAINYARD_HOME, the client's settings file, private files.

Light on purpose (the CLI imports it on every call); the typed trainyard.toml lives in
scheduler.settings, and `DaemonConfig` is reachable from here for the code that imports it.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import TYPE_CHECKING

from .units import parse_listen

if TYPE_CHECKING:
    from .daemon_config import DaemonConfig

DEFAULT_HOME = "~/.local/share/trainyard"


def home() -> Path:
    """The daemon's state directory (database, known_hosts, its SSH key): $TRAINYARD_HOME."""
    return Path(os.environ.get("TRAINYARD_HOME") or DEFAULT_HOME).expanduser()


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


def read_private(path: str, what: str) -> str:
    """The text of a secret file only its owner may read; ValueError naming the setting `what`,
    the file and the problem when it is missing, unreadable or readable by others. The text
    is never logged."""
    p = Path(path).expanduser()
    try:
        mode = p.stat().st_mode
        text = p.read_text()
    except FileNotFoundError:
        raise ValueError(f"{what}: {str(p)!r} does not exist") from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{what}: cannot read {str(p)!r}: {type(e).__name__}") from None
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{what}: {str(p)!r} is readable by others (mode {stat.S_IMODE(mode):o}); "
                         "chmod 600 it")
    return text


def __getattr__(name: str):
    # `from scheduler.config import DaemonConfig` keeps working without making every CLI
    # call pay for pydantic and the planner.
    if name == "DaemonConfig":
        from .daemon_config import DaemonConfig

        return DaemonConfig
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["DEFAULT_HOME", "DaemonConfig", "client_config_path", "home", "parse_listen",
           "write_private"]
