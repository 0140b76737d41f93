"""Files on a node as the agent and the job step write them: atomically, and readable where jobs need them.

Standard library only: shipped in the agent's bundle.
"""

from __future__ import annotations

import os
import zipfile


def write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def own_file(rel: str) -> bytes:
    """A file shipped beside this module: in the agent's zip bundle, or in the source tree."""
    here = os.path.dirname(os.path.abspath(__file__))
    if zipfile.is_zipfile(here):
        with zipfile.ZipFile(here) as z:
            return z.read(rel)
    with open(os.path.join(here, rel), "rb") as f:
        return f.read()


def install_public(top: str, rel: str, data: bytes) -> None:
    """Write top/rel so that every job's account may read it (and run it, under bin/), atomically."""
    path = os.path.join(top, rel)
    for d in (top, os.path.dirname(path)):  # rel is at most one directory deep
        os.makedirs(d, exist_ok=True)
        os.chmod(d, 0o755)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(tmp, 0o755 if os.path.basename(os.path.dirname(path)) == "bin" else 0o644)
    os.replace(tmp, path)
