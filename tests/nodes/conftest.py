"""Nodes shaped like a real cluster's: root sshd in mount namespaces, NFS-like shared home, users.

Each node is a real OpenSSH sshd started as root in a mount namespace of its own, where the
places a real node has on local disk are private tmpfs mounts (/tmp, /var/tmp,
/var/lib/trainyard), /dev is private and holds fake GPUs (`mknod -m 666 /dev/nvidiaN c 195 N`
plus /dev/nvidiactl), and one shared directory is bind-mounted as root's home: two nodes
logging in as root share that home, as nodes with NFS homes do. /etc and /home stay the
machine's, so the accounts alice and bob (created here, removed after) exist on every node.

The tests drive scheduler.nodes.NodeLink, the daemon's own link code, against these nodes, or
a real daemon process (tests.conftest.DaemonProc) with a `[users]` map, through its API and CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import glob
import os
import pwd
import queue
import shutil
import signal
import subprocess
import tempfile
import textwrap
import threading
import time
import uuid
from pathlib import Path

import pytest

from scheduler.nodes import NodeLink, SshSettings, SshTarget
from tests.conftest import SSHD, TEST_CONFIG, DaemonProc, free_port, require_or_skip, wait_for

# a node of a pure cgroup v2 host: the v1 hierarchies gone from its view, the unified one in place
V2_ONLY = "umount -l /sys/fs/cgroup\nmount -t cgroup2 cgroup2 /sys/fs/cgroup\n"
TEST_BASE = Path("/var/lib/trainyard-tests")  # outside /tmp and /var/tmp, which nodes mask
USERS = ("alice", "bob")
BASIC_DEVICES = {"null": (1, 3), "zero": (1, 5), "full": (1, 7), "random": (1, 8),
                 "urandom": (1, 9), "tty": (5, 0)}


def _need_root_nodes() -> None:
    require_or_skip(SSHD is not None, "OpenSSH sshd is not installed (apt-get install openssh-server)")
    require_or_skip(os.geteuid() == 0, "node tests log into sshd as root and create accounts: run as root")
    require_or_skip(shutil.which("unshare") is not None and shutil.which("useradd") is not None,
                    "unshare (util-linux) and useradd (passwd) are needed for the node tests")
    require_or_skip(os.path.isdir("/sys/fs/cgroup/devices"),
                    "the cgroup v1 devices controller is not mounted at /sys/fs/cgroup/devices")


@pytest.fixture(scope="session")
def users():
    """Real Unix accounts alice and bob (uid >= 1000); removed after when made here."""
    _need_root_nodes()
    made = []
    for name in USERS:
        try:
            pwd.getpwnam(name)
        except KeyError:
            subprocess.run(["useradd", "-m", "-s", "/bin/sh", name], check=True, capture_output=True)
            # no password, but not locked ("!"): sshd without PAM refuses locked accounts' keys
            subprocess.run(["usermod", "-p", "*", name], check=True, capture_output=True)
            made.append(name)
    yield {name: pwd.getpwnam(name) for name in USERS}
    for name in made:
        subprocess.run(["userdel", "-r", name], capture_output=True)


def make_base() -> Path:
    TEST_BASE.mkdir(mode=0o755, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix="t-", dir=TEST_BASE))
    os.chmod(d, 0o755)
    return d


@pytest.fixture
def base():
    d = make_base()
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def client_key(base):
    key = base / "id_ed25519"
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
    os.chmod(key, 0o600)
    return key


def tally_dir(base: Path) -> Path:
    """Where jobs count their runs: seen by every node (not masked like /tmp and /var/tmp) and
    writable by every job's account."""
    d = base / "tally"
    d.mkdir(mode=0o1777)
    os.chmod(d, 0o1777)
    return d


class Node:
    """One node: sshd as root in its own mount namespace (see the module's docstring)."""

    def __init__(self, base: Path, name: str, client_pub: str, home: Path, gpus: int = 4,
                 sftp: bool = True, path: str = "/usr/local/bin:/usr/bin:/bin", setup: str = "",
                 ciphers: str = "", cgroup: str = "v1"):
        self.name = f"{name}-{uuid.uuid4().hex[:6]}"  # cgroups are named by node: keep them apart
        self.dir = base / name
        self.dir.mkdir(mode=0o711)  # sshd reads authorized_keys as the logging-in account
        os.chmod(self.dir, 0o711)
        self.port = free_port()
        self.home, self.gpus, self.sftp, self.path = home, gpus, sftp, path
        self.setup = setup  # more shell run in the node's namespace before sshd starts
        self.ciphers = ciphers  # sshd's `Ciphers` (its own default when empty)
        # "v2": the node sees only the unified hierarchy at /sys/fs/cgroup, as a pure cgroup v2
        # host (Ubuntu 22.04+, RHEL 9) does; this machine's is the same kernel's, beside v1's
        self.cgroup = cgroup
        self.host_key = self.dir / "host_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.host_key)],
                       check=True)
        (self.dir / "authorized_keys").write_text(client_pub)
        os.chmod(self.dir / "authorized_keys", 0o644)
        self.proc: subprocess.Popen | None = None
        self.mntns = ""

    def script(self) -> str:
        devices = "\n".join(f"mknod -m 666 /dev/{n} c {a} {b}" for n, (a, b) in BASIC_DEVICES.items())
        gpus = "\n".join(f"mknod -m 666 /dev/nvidia{i} c 195 {i}" for i in range(self.gpus))
        return textwrap.dedent(f"""\
            set -e
            mount -t tmpfs -o mode=1777 tmpfs /tmp
            mount -t tmpfs -o mode=1777 tmpfs /var/tmp
            mount -t tmpfs -o mode=755 tmpfs /var/lib/trainyard
            mount -t tmpfs -o mode=755 tmpfs /usr/local/lib/trainyard
            mount --bind {self.home} /root
            mount -t tmpfs -o mode=755 tmpfs /dev
            """) + devices + "\n" + gpus + "\n" + (V2_ONLY if self.cgroup == "v2" else "") \
            + textwrap.dedent(f"""\
            mknod -m 666 /dev/nvidiactl c 195 255
            ln -s /proc/self/fd /dev/fd
            ln -s /proc/self/fd/0 /dev/stdin
            ln -s /proc/self/fd/1 /dev/stdout
            ln -s /proc/self/fd/2 /dev/stderr
            mkdir /dev/shm /dev/pts
            {self.setup}
            exec {SSHD} -D -e -f {self.dir}/sshd_config
            """)

    def config(self) -> None:
        (self.dir / "sshd_config").write_text(textwrap.dedent(f"""\
            Port {self.port}
            ListenAddress 127.0.0.1
            HostKey {self.host_key}
            PidFile none
            AuthorizedKeysFile {self.dir}/authorized_keys
            StrictModes no
            UsePAM no
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            PermitRootLogin prohibit-password
            SetEnv PATH={self.path}
            MaxStartups 100:30:200
            LogLevel ERROR
            """) + ("Subsystem sftp internal-sftp\n" if self.sftp else "")
            + (f"Ciphers {self.ciphers}\n" if self.ciphers else ""))

    def start(self) -> Node:
        Path("/run/sshd").mkdir(exist_ok=True)
        for point in ("/var/lib/trainyard", "/usr/local/lib/trainyard"):  # the node's own tmpfs
            Path(point).mkdir(parents=True, exist_ok=True)
        self.config()
        self.proc = subprocess.Popen(
            ["unshare", "-m", "--propagation", "private", "sh", "-c", self.script()],
            stdout=subprocess.DEVNULL, stderr=open(self.dir / "sshd.log", "ab"))

        def listening():
            if self.proc.poll() is not None:
                raise AssertionError(f"node {self.name} exited: {(self.dir / 'sshd.log').read_text()}")
            import socket

            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        wait_for(listening, 10, what=f"sshd of {self.name} on port {self.port}")
        self.mntns = os.readlink(f"/proc/{self.proc.pid}/ns/mnt")
        return self

    def run(self, cmd: str, timeout: float = 20) -> subprocess.CompletedProcess:
        """A command inside the node (its mounts, its /dev), as root."""
        return subprocess.run(["nsenter", "-t", str(self.proc.pid), "-m", "sh", "-c", cmd],
                              capture_output=True, text=True, timeout=timeout)

    def processes(self) -> list[int]:
        """Every process in this node's mount namespace: sshd, agent, job steps, jobs."""
        out = []
        for ns in glob.glob("/proc/[0-9]*/ns/mnt"):
            with contextlib.suppress(OSError):
                if os.readlink(ns) == self.mntns:
                    out.append(int(ns.split("/")[2]))
        return out

    def stop(self) -> None:
        if self.proc is None:
            return
        for _ in range(3):
            for pid in self.processes():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            time.sleep(0.05)
        self.proc.wait(5)
        # only this node's job cgroups (named after this test's unique node name)
        for d in sorted(glob.glob(f"/sys/fs/cgroup/*/**/trainyard/{self.name}/*", recursive=True),
                        key=len, reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(d)
        for d in glob.glob(f"/sys/fs/cgroup/*/**/trainyard/{self.name}", recursive=True):
            with contextlib.suppress(OSError):
                os.rmdir(d)


@pytest.fixture
def shared_home(base):
    home = base / "shared-home"
    home.mkdir(mode=0o700)
    return home


@pytest.fixture
def node_factory(base, client_key, shared_home, users):
    made: list[Node] = []

    def make(name: str = "n1", authorized: str = "", **kw) -> Node:
        node = Node(base, name, authorized or (client_key.with_suffix(".pub")).read_text(),
                    shared_home, **kw)
        made.append(node)
        return node.start()

    yield make
    for n in made:
        n.stop()


class Link:
    """NodeLink, the daemon's link code, on an event loop of its own, for synchronous tests."""

    def __init__(self, node: Node, key: Path, base: Path, agent_dir: str = "", gpus: int = 4,
                 min_uid: int = 1000, user: str = "root", privilege: str = "login",
                 hello_timeout_s: float = 60.0):
        self.known_hosts = base / f"known_hosts-{node.name}"
        pub = Path(str(node.host_key) + ".pub").read_text().split()
        self.known_hosts.write_text(f"[127.0.0.1]:{node.port} {pub[0]} {pub[1]}\n")
        self.target = SshTarget(node.name, "127.0.0.1", node.port, user, str(key), agent_dir,
                                gpus, "Test GPU", min_uid, privilege)
        self.settings = SshSettings(str(self.known_hosts), connect_timeout_s=5,
                                    keepalive_interval_s=1, keepalive_count_max=3,
                                    reconnect_max_backoff_s=0.5, telemetry_interval_s=0,
                                    hello_timeout_s=hello_timeout_s)
        self.messages: queue.Queue = queue.Queue()
        self.states: queue.Queue = queue.Queue()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.link = NodeLink(self.target, self.settings, self._on_message, self._on_link)
        self.loop.call_soon_threadsafe(self.link.start)

    def _on_message(self, name: str, msg: dict) -> None:
        self.messages.put(msg)

    def _on_link(self, name: str, up: bool, error: str) -> None:
        self.states.put((up, error))

    def wait_state(self, timeout: float = 20.0) -> tuple[bool, str]:
        """The next link change: (True, "") when the agent said hello, else (False, reason)."""
        try:
            return self.states.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"the link reported nothing in {timeout} s") from None

    def wait_up(self, timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        error = ""
        while time.monotonic() < deadline:
            try:
                up, error = self.states.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if up:
                return self.wait_for("hello")
        raise AssertionError(f"the node did not come up; last reason: {error or 'none'}")

    def wait_down_reason(self, timeout: float = 20.0) -> str:
        up, error = self.wait_state(timeout)
        assert not up, "the node came up"
        return error

    def send(self, **msg) -> None:
        ok = asyncio.run_coroutine_threadsafe(self._send(msg), self.loop).result(5)
        assert ok, "the link is down"

    async def _send(self, msg):
        return self.link.send(msg)

    def request(self, timeout: float = 10.0, **msg) -> dict:
        return asyncio.run_coroutine_threadsafe(self.link.request(msg, timeout), self.loop).result(timeout + 2)

    def wait_for(self, ev: str, key: str | None = None, timeout: float = 20.0) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                msg = self.messages.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if msg.get("ev") == ev and (key is None or msg.get("key") == key):
                return msg
        raise AssertionError(f"no {ev} for {key} within {timeout} s")

    def close(self) -> None:
        if not self.thread.is_alive():  # closed already (a test that closed it itself)
            return
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.link.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture
def link_factory(base, client_key):
    made: list[Link] = []

    def make(node: Node, **kw) -> Link:
        link = Link(node, client_key, base, **kw)
        made.append(link)
        return link

    yield make
    for link in made:
        link.close()


def job_pids(node: Node, marker: str) -> list[int]:
    """Processes of this node whose command line holds `marker`."""
    out = []
    for pid in node.processes():
        with contextlib.suppress(OSError):
            if marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes():
                out.append(pid)
    return out


# ----------------------------------------------------------------------------- through a daemon
def start_daemon(base: Path, users: dict[str, str], grace: float = 3.0) -> DaemonProc:
    """A real daemon whose `[users]` map is `users` (and nothing else: no catch-all account)."""
    where = base / "daemon"
    where.mkdir(exist_ok=True)
    d = DaemonProc(where, grace=grace)
    table = "".join(f'"{k}" = "{v}"\n' for k, v in users.items())
    d.config.write_text(TEST_CONFIG.format(grace=grace) + "\n[users]\n" + table)
    return d.start()


def add_node(d: DaemonProc, node: Node, gpus: int = 4, up: bool = True, **extra) -> dict:
    """Register a node with the daemon as root@127.0.0.1; wait until it is UP (when `up`)."""
    c = d.client()
    c.add_node({"name": node.name, "address": "127.0.0.1", "port": node.port, "user": "root",
                "accept_new_host_key": True, "gpus": gpus, "gpu_model": "Test GPU", **extra})
    if not up:
        return c.node(node.name)
    return wait_for(lambda: (n := c.node(node.name))["state"] == "UP" and n, 30,
                    what=f"node {node.name} UP")
