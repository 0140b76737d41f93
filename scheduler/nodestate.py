"""Where the agent keeps its files on a node, and the node identity that keeps that place its own.

Part of the agent's bundle (standard library, Python 3.8). The daemon also runs this file
before it uploads the agent (`python3 -c <this file> DIR NODE BUNDLE`): it prints one JSON
line saying which directory the agent will use, whether the bundle is already there, or why
the directory cannot be used.

The default is node-local disk, never the login directory: home directories are shared
over NFS on most clusters, and two nodes' agents in one directory mix up each other's jobs.
Root uses /var/lib/trainyard (like Slurm's /var/spool/slurmd). Any other account uses
/var/tmp/trainyard-<user>: /var/tmp is on the node's own disk, kept across reboots (unlike
/tmp on tmpfs, or /run/user/<uid>, which logind empties when the last session ends) and
writable without privileges; the directory is made 0700 and refused when someone else owns it.
"""

from __future__ import annotations

import errno
import json
import os
import pwd
import socket
import stat
import sys

IDENTITY_FILE = "node-identity"
DEFAULT_NAMES = ("", ".trainyard")  # what Node.agent_dir says when nobody chose a directory


class StateDirError(Exception):
    """The agent's directory cannot be used; the message says why and what to do."""


def default_dir(uid: int, user: str) -> str:
    return "/var/lib/trainyard" if uid == 0 else f"/var/tmp/trainyard-{user}"


def resolve(requested: str) -> str:
    """The absolute directory for a requested one ("" or ".trainyard": the node-local default)."""
    if requested in DEFAULT_NAMES:
        uid = os.geteuid()
        requested = os.environ.get("TRAINYARD_AGENT_DIR") or default_dir(uid, pwd.getpwuid(uid).pw_name)
    return os.path.abspath(os.path.expanduser(requested))


def machine_id() -> str:
    for path in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        try:
            with open(path) as f:
                text = f.read().strip()
        except OSError:
            continue
        if text:
            return text
    return socket.gethostname()


def identity(node: str) -> dict:
    return {"node": node or socket.gethostname(), "machine_id": machine_id(),
            "host": socket.gethostname()}


def claim(path: str, node: str, mode: int = 0o700) -> dict:
    """Make `path` this node's state directory, or raise StateDirError saying why not.

    Creates it (mode 0700; 0711 for a root agent, so job owners can reach their own job
    directories below it), checks that it is ours and private, and writes the node's identity
    in it, or checks the identity already there: a directory that holds another node's
    identity is shared (an NFS home, a cloned disk) and is refused."""
    me = identity(node)
    try:
        os.makedirs(path, mode=mode, exist_ok=True)
        st = os.lstat(path)
    except OSError as e:
        raise StateDirError(f"cannot create the agent directory {path}: {e.strerror}") from None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise StateDirError(f"the agent directory {path} is not a directory (a symlink or a file); "
                            "remove it or choose another agent_dir")
    if st.st_uid != os.geteuid():
        owner = _user_name(st.st_uid)
        raise StateDirError(f"the agent directory {path} belongs to {owner}, not to "
                            f"{_user_name(os.geteuid())}; remove it or choose another agent_dir")
    if st.st_mode & 0o022:
        raise StateDirError(f"the agent directory {path} is writable by others "
                            f"(mode {stat.S_IMODE(st.st_mode):o}); make it 0700")
    if os.geteuid() == 0:
        _check_parents(path)
    if stat.S_IMODE(st.st_mode) != mode:
        os.chmod(path, mode)
    ident = os.path.join(path, IDENTITY_FILE)
    try:
        fd = os.open(ident, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        fd = None
    except OSError as e:
        raise StateDirError(f"the agent directory {path} is not writable: {e.strerror}") from None
    if fd is not None:
        with os.fdopen(fd, "w") as f:
            json.dump(me, f)
        return me
    try:
        with open(ident) as f:
            there = json.load(f)
    except (OSError, ValueError) as e:
        raise StateDirError(f"{ident} is unreadable ({e}); remove it if no other node uses "
                            f"{path}") from None
    if there.get("node") != me["node"] or there.get("machine_id") != me["machine_id"]:
        raise StateDirError(
            f"the agent directory {path} holds the state of node {there.get('node')!r} (machine "
            f"{there.get('machine_id')}, host {there.get('host')}), not of {me['node']!r}: it is "
            "shared with another node (an NFS home?); give this node a node-local agent_dir "
            f"(the default), or if {there.get('node')!r} was renamed, remove {ident}")
    return me


def _check_parents(path: str) -> None:
    """A root agent's directory must not be swappable: every directory above it belongs to root
    and only root may rename its entries (group/world-writable only with the sticky bit, as
    /tmp and /var/tmp are). Otherwise another account could replace the job directories that
    root reads and runs."""
    parent = os.path.dirname(path)
    while True:
        try:
            st = os.stat(parent)
        except OSError as e:
            raise StateDirError(f"cannot check {parent} above the agent directory {path}: "
                                f"{e.strerror}") from None
        open_to_others = st.st_mode & 0o022 and not st.st_mode & stat.S_ISVTX
        if st.st_uid != 0 or open_to_others:
            who = (f"belongs to {_user_name(st.st_uid)}" if st.st_uid != 0 else
                   f"is writable by others (mode {stat.S_IMODE(st.st_mode):o})")
            raise StateDirError(
                f"the agent runs as root, and {parent} above its directory {path} {who}: another "
                "account could swap the directory; choose an agent_dir whose parents only root "
                "can change (the default /var/lib/trainyard)")
        if parent == "/":
            return
        parent = os.path.dirname(parent)


def _user_name(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


def probe(requested: str, node: str, bundle: str) -> dict:
    """What the daemon needs to know before it uploads the agent (one JSON object)."""
    uid = os.geteuid()
    out = {"uid": uid, "user": _user_name(uid), "python": "{}.{}".format(*sys.version_info[:2])}
    try:
        path = resolve(requested)
        claim(path, node, 0o711 if uid == 0 else 0o700)
    except StateDirError as e:
        out["error"] = str(e)
        return out
    except OSError as e:
        out["error"] = f"cannot prepare the agent directory: {e}"
        return out
    out["dir"] = path
    out["have_bundle"] = bool(bundle) and os.path.isfile(os.path.join(path, bundle))
    return out


if __name__ == "__main__" and len(sys.argv) == 4:
    try:
        print(json.dumps(probe(*sys.argv[1:4])))
    except Exception as e:  # noqa: BLE001 - the daemon shows any surprise as the node's reason
        code = errno.errorcode.get(getattr(e, "errno", 0) or 0, "")
        print(json.dumps({"error": f"{type(e).__name__}{' ' + code if code else ''}: {e}"}))
