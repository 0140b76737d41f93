"""Files on a node as the agent and the job step write them: atomically, and readable where jobs need them.

Standard library only: shipped in the agent's bundle.
"""

from __future__ import annotations

import _socket
import os
import socket

# the agent's wake-up socket in its directory: a job step says here that a job's pid or rc file
# was written, so the agent reports a start or an end at once instead of at its next poll
WAKE_SOCKET = "wake.sock"


def write_file(path: str, text: str, mode: int = 0o600) -> None:
    """`path` created (or emptied) with `text` in it. Plain os calls, no file object: a supervisor
    forked from the zygote writes with each object it creates into pages it shares with the
    zygote, and each is a page copied (and the daemon's file thread holds the interpreter's lock
    for less)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        data = text.encode()
        while data:
            data = data[os.write(fd, data):]
    finally:
        os.close(fd)


def write_atomic(path: str, text: str) -> None:
    """`path` replaced with `text` in one step: a reader sees the old file or the new one whole."""
    tmp = path + ".tmp"
    write_file(tmp, text)
    os.replace(tmp, path)


def wake(path) -> None:
    """Wake the agent listening on `path` (best effort: the agent polls as well, so a wake-up
    that is lost or refused costs latency, never a report). A bare `_socket.socket`, not the
    `socket` module's class: a supervisor does this twice a job, see `write_atomic`."""
    if not path:
        return
    try:
        s = _socket.socket(_socket.AF_UNIX, _socket.SOCK_DGRAM | _socket.SOCK_NONBLOCK)
    except OSError:
        return
    try:
        s.sendto(b"1", path)
    except OSError:
        pass
    finally:
        s.close()


def listen_wake(path: str, woken) -> bool:
    """Bind the agent's wake-up socket at `path` (only its owner may write to it) and call
    `woken()` from a thread for each wake-up. False where it cannot be bound (a path longer
    than a socket address allows, a read-only directory): the agent then polls faster."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError:
        return False
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        sock.bind(path)
        os.chmod(path, 0o600)
    except OSError:
        sock.close()
        return False

    def serve() -> None:
        while True:
            try:
                sock.recv(16)
            except OSError:
                return
            woken()

    import threading  # noqa: PLC0415 - the agent's; the zygote that imports this module has no threads

    threading.Thread(target=serve, name="wake", daemon=True).start()
    return True


def own_file(rel: str) -> bytes:
    """A file shipped beside this module: in the agent's zip bundle, or in the source tree."""
    import zipfile  # noqa: PLC0415 - not loaded in the zygote (jobstep imports this module)

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
