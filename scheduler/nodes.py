"""SSH sessions to nodes: one asyncssh connection per node, one long-lived agent channel on it.

Per session: connect (pinned host key), ask the node where the agent lives (nodestate.py run
by the node's python3), upload the agent's bundle when that version is not there yet (SFTP,
or `cat` over an exec channel where sshd has no SFTP subsystem), run it, and check the
protocol version in its hello. Every reason a node cannot come up reaches on_link in one line.

Two privilege modes (docs/nodes.md): `login` runs the agent as the login user (root on real
nodes; the demo's own user), `sudo` logs in as an unprivileged account that one sudo rule
lets start exactly the agent bundle the trainyard_node role installed root-owned; nothing is
uploaded then, since a file the login user can write must never run as root.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import io
import json
import logging
import py_compile
import random
import shlex
import sys
import tempfile
import zipfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import asyncssh
import orjson

from .containers import DEFAULT_HIGH_WATER_GB, DEFAULT_PULL_TIMEOUT_S
from .jobdirs import DEFAULT_KEEP_S
from .protocol import PROTOCOL_VERSION

log = logging.getLogger("trainyard.nodes")

HERE = Path(__file__).parent
# The agent's bundle: what real nodes run. The demo's GPU simulator (simgpu.py) is not in it.
BUNDLE_MODULES = ("agent", "protocol", "gpus", "nodestate", "accounts", "fencing", "jobstep",
                  "containers", "jobdirs", "nodefiles", "outputs", "ptys", "steps", "zygote",
                  # Slurm's srun and scontrol inside jobs, and what they import
                  "slurm/hostlist", "slurm/layout", "slurm/shims/srun", "slurm/shims/scontrol")
# `wrap` (a job's supervisor as a fresh interpreter) and `zygote` (the process that forks them)
# import only what they need, not the agent
BUNDLE_MAIN = ("import sys\n\nif sys.argv[1:2] == ['wrap']:\n    import jobstep\n\n"
               "    sys.exit(jobstep.main(sys.argv[2:]))\n"
               "if sys.argv[1:2] == ['zygote']:\n    import zygote\n\n"
               "    sys.exit(zygote.main(sys.argv[2:]))\n"
               "import agent\n\nsys.exit(agent.main(sys.argv[1:]))\n")
MIN_PYTHON = (3, 8)
# The sudo privilege mode: the bundle as the trainyard_node role installs it (root-owned), and
# the one command line its sudo rule allows (`--node` first: `wrap` and `zygote` can never be the
# command).
INSTALLED_AGENT = "/usr/local/lib/trainyard/agent.pyz"
SYSTEM_PYTHON = "/usr/bin/python3"
PRIVILEGES = ("login", "sudo")


@functools.cache
def agent_bundle() -> tuple[bytes, str]:
    """The agent as one zip application (`python3 agent-<digest>.pyz`), and its digest.

    Built reproducibly (fixed times and order), so the digest names this version (and the
    daemon's Python) exactly. Each module also comes compiled for the daemon's Python: zipimport
    cannot cache bytecode, and compiling the sources again in every job's supervisor process
    cost more than the job itself for short jobs; a node whose Python differs compiles them
    (zipimport skips bytecode of another version)."""
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        files = [(f"{m}.py", (HERE / f"{m}.py").read_bytes()) for m in BUNDLE_MODULES]
        files += [(f"{m}.pyc", _bytecode(HERE / f"{m}.py", f"{m}.py")) for m in BUNDLE_MODULES]
        files.append(("__main__.py", BUNDLE_MAIN.encode()))
        for name, data in files:
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_DEFLATED
            info.external_attr = 0o644 << 16
            z.writestr(info, data)
    data = buf.getvalue()
    return data, hashlib.sha256(data).hexdigest()[:16]


def _bytecode(path: Path, name: str) -> bytes:
    """`path` compiled to an unchecked hash-based .pyc (PEP 552: no timestamp to compare)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = py_compile.compile(str(path), cfile=f"{tmp}/{name}c", dfile=name, doraise=True,
                                 invalidation_mode=py_compile.PycInvalidationMode.UNCHECKED_HASH)
        return Path(out).read_bytes()


def one_line(text: str, limit: int = 600) -> str:
    """A reason for `trainyard nodes`: one line, the end kept when it is long."""
    text = " | ".join(part.strip() for part in str(text).strip().splitlines() if part.strip())
    return text if len(text) <= limit else "..." + text[-limit:]


def _python_check() -> str:
    """Shell that fails, with a sentence on stderr, where python3 is missing or too old."""
    want = ".".join(map(str, MIN_PYTHON))
    return (
        'command -v python3 >/dev/null 2>&1 || { echo "python3 is not installed on the node '
        '(not on PATH $PATH); bootstrap it first (trainyard bootstrap)" >&2; exit 127; }; '
        f"python3 -c 'import sys; sys.exit(sys.version_info < {MIN_PYTHON!r})' || "
        '{ echo "python3 on the node is $(python3 -V 2>&1); the agent needs Python '
        f'{want} or newer" >&2; exit 126; }}; '
    )


class NodeError(Exception):
    """A node could not be reached or refused us; the message is for people."""


@dataclass(frozen=True)
class SshTarget:
    name: str
    address: str
    port: int
    user: str
    key_path: str
    agent_dir: str = ""  # "" (or ".trainyard"): the node-local default, see nodestate.py
    declared_gpus: int = 0
    gpu_model: str = ""
    min_uid: int = 1000  # jobs never run as an account below this uid
    privilege: str = "login"  # "login": the agent runs as `user`; "sudo": see INSTALLED_AGENT


@dataclass(frozen=True)
class SshSettings:
    known_hosts: str
    connect_timeout_s: float = 10.0
    keepalive_interval_s: float = 3.0
    keepalive_count_max: int = 3
    reconnect_max_backoff_s: float = 10.0
    telemetry_interval_s: float = 2.0
    connect_concurrency: int = 32  # nodes in the handshake at once (NodeLinks shares one limit)
    hello_timeout_s: float = 60.0  # an agent started that has not said hello by then: the attempt failed
    pull_timeout_s: float = DEFAULT_PULL_TIMEOUT_S  # an image pull on a node, at most
    image_cache_gb: float = DEFAULT_HIGH_WATER_GB  # a node's image cache, before LRU eviction
    job_dir_retention_s: float = DEFAULT_KEEP_S  # an ended job's directory on its node, kept this long


def host_pattern(address: str, port: int) -> str:
    return address if port == 22 else f"[{address}]:{port}"


def fingerprint(key: asyncssh.SSHKey) -> str:
    return key.get_fingerprint("sha256")


async def fetch_host_key(address: str, port: int, timeout: float) -> asyncssh.SSHKey:
    """Ask a server for its host key (to pin it when the operator accepts it)."""
    try:
        key = await asyncio.wait_for(
            asyncssh.get_server_host_key(address, port, config=[]), timeout
        )
    except (TimeoutError, OSError, asyncssh.Error) as e:
        raise NodeError(f"cannot reach SSH at {address}:{port}: {describe(e)}") from None
    if key is None:
        raise NodeError(f"{address}:{port} sent no host key")
    return key


# known_hosts path -> (its bytes, parsed): see pinned_host_keys
_pinned: dict[str, tuple[bytes, asyncssh.SSHKnownHosts]] = {}


def pinned_host_keys(known_hosts: str) -> asyncssh.SSHKnownHosts | str:
    """The daemon's pinned host keys, parsed again only when the file's bytes changed. Given a
    file name, asyncssh reads and decodes every key in it at each handshake: O(nodes) per
    connection, O(nodes²) for a cluster connecting at once (at 1,000 nodes about a fifth of the
    daemon's CPU while they connect, tests/bench/bench_cluster_size.py). Reading and comparing
    the bytes each time keeps an edit by hand (a removed line, a replaced key) seen at the next
    handshake, however close in time to the last one."""
    try:
        data = Path(known_hosts).read_bytes()
    except OSError:
        return known_hosts  # absent or unreadable: asyncssh says so, as it always has
    was = _pinned.get(known_hosts)
    if was is None or was[0] != data:
        was = (data, asyncssh.import_known_hosts(data.decode()))
        _pinned[known_hosts] = was
    return was[1]


# key path -> (the file's bytes, its key pair as loaded): see client_keys
_client_keys: dict[str, tuple[bytes, list]] = {}


def client_keys(key_path: str) -> list:
    """The daemon's SSH key pair, parsed again only when the key file's bytes changed. Given a
    path, asyncssh reads and parses the key, and looks for its public key and certificate
    beside it, at every handshake: 0.36 ms a connection here, a thirtieth of a 1,000-node
    takeover's CPU. As with the pinned host keys, the bytes are read and compared each time,
    so a key replaced in place is the one the next handshake uses; a certificate added beside
    an unchanged key is read after the daemon's restart."""
    try:
        data = Path(key_path).read_bytes()
    except OSError:
        return [key_path]  # absent or unreadable: asyncssh says so, as it always has
    was = _client_keys.get(key_path)
    if was is None or was[0] != data:
        was = (data, asyncssh.load_keypairs([key_path]))
        _client_keys[key_path] = was
    return was[1]


def pin_host_key(known_hosts: Path, address: str, port: int, key: asyncssh.SSHKey) -> None:
    known_hosts.parent.mkdir(parents=True, exist_ok=True)
    line = f"{host_pattern(address, port)} {key.export_public_key().decode().strip()}\n"
    with open(known_hosts, "a") as f:
        f.write(line)


def unpin_host_key(known_hosts: Path, address: str, port: int) -> None:
    if not known_hosts.exists():
        return
    pattern = host_pattern(address, port)
    lines = [ln for ln in known_hosts.read_text().splitlines(True) if ln.split(" ", 1)[0] != pattern]
    known_hosts.write_text("".join(lines))


def is_pinned(known_hosts: Path, address: str, port: int) -> bool:
    if not known_hosts.exists():
        return False
    pattern = host_pattern(address, port)
    return any(ln.split(" ", 1)[0] == pattern for ln in known_hosts.read_text().splitlines())


def describe(e: BaseException) -> str:
    if isinstance(e, asyncssh.HostKeyNotVerifiable):
        return ("host key verification failed: the node's key does not match the pinned one "
                "(if the node was reinstalled, `trainyard node remove` it and add it again "
                "with --accept-new-host-key)")
    if isinstance(e, asyncssh.PermissionDenied):
        return "permission denied: the node does not accept the daemon's SSH key for this user"
    if isinstance(e, ConnectionRefusedError):
        return "connection refused (is sshd running on that port?)"
    if isinstance(e, asyncio.TimeoutError | TimeoutError):
        return "timed out"
    text = str(e) or type(e).__name__
    return text


# AES-GCM first: asyncssh seals each chacha20-poly1305 packet with new cipher objects made in
# Python (about 15 us a packet here), an AES-GCM packet in one call of the cryptography
# library (about 3 us). The client's order decides, so a node's sshd that offers both uses
# AES-GCM, and one that offers only the others still gets them, in asyncssh's own order.
PREFERRED_CIPHERS = ("aes128-gcm@openssh.com", "aes256-gcm@openssh.com")


@functools.cache
def encryption_algs() -> list[str]:
    """The ciphers offered to nodes, in order: AES-GCM, then asyncssh's defaults."""
    from asyncssh.encryption import get_default_encryption_algs
    rest = [a.decode() for a in get_default_encryption_algs()]
    return [a for a in PREFERRED_CIPHERS if a in rest] + [a for a in rest if a not in PREFERRED_CIPHERS]


async def connect(target: SshTarget, settings: SshSettings) -> asyncssh.SSHClientConnection:
    try:
        known_hosts = pinned_host_keys(settings.known_hosts)
    except ValueError as e:  # not UTF-8
        raise NodeError(f"cannot read the pinned host keys in {settings.known_hosts}: {e}") from None
    try:
        return await asyncssh.connect(
            target.address, target.port, username=target.user, encryption_algs=encryption_algs(),
            client_keys=client_keys(target.key_path), known_hosts=known_hosts,
            connect_timeout=settings.connect_timeout_s,
            keepalive_interval=settings.keepalive_interval_s,
            keepalive_count_max=settings.keepalive_count_max,
            agent_path=None, config=[], preferred_auth="publickey",
        )
    except (TimeoutError, OSError, asyncssh.Error) as e:
        raise NodeError(describe(e)) from None


def agent_argv(target: SshTarget, settings: SshSettings, bundle: str = "", directory: str = "") -> list:
    """The command line that starts the agent on the node, in the target's privilege mode."""
    if target.privilege not in PRIVILEGES:
        raise NodeError(f"privilege {target.privilege!r} is not one of {', '.join(PRIVILEGES)}")
    options = ["--node", target.name, "--gpus", str(target.declared_gpus),
               "--gpu-model", target.gpu_model, "--telemetry", f"{settings.telemetry_interval_s:g}",
               "--min-uid", str(target.min_uid), "--pull-timeout", f"{settings.pull_timeout_s:g}",
               "--image-cache-gb", f"{settings.image_cache_gb:g}",
               "--keep-job-dirs", f"{settings.job_dir_retention_s:g}"]
    if target.privilege == "sudo":
        where = ["--dir", target.agent_dir] if target.agent_dir not in ("", ".trainyard") else []
        return ["sudo", "-n", SYSTEM_PYTHON, "-I", INSTALLED_AGENT, *options, *where]
    return ["python3", bundle, *options, "--dir", directory]


def _sudo_refused(target: SshTarget, said: str) -> str:
    return one_line(
        f"{target.user} may not start the agent as root with sudo (sudo said: {said.strip()}); "
        f"install the rule and {INSTALLED_AGENT} with `trainyard bootstrap` (the trainyard_node "
        "role), or log in as root with privilege = \"login\"")


async def probe(target: SshTarget, settings: SshSettings) -> str:
    """Connect once and check that python3 is there and new enough (and, in the sudo mode, that
    the sudo rule lets the login user start the installed agent); returns python3's version or
    raises NodeError saying why the node cannot run the agent."""
    conn = await connect(target, settings)
    async with conn:
        result = await conn.run(_python_check() + "python3 -c 'import platform; "
                                "print(platform.python_version())'", timeout=15)
        if result.exit_status != 0:
            raise NodeError(one_line(result.stderr or f"python3 failed (exit {result.exit_status})"))
        if target.privilege == "sudo":
            argv = agent_argv(target, settings)
            allowed = await conn.run(" ".join(shlex.quote(a) for a in [*argv[:2], "-l", *argv[2:]]),
                                     timeout=15)
            if allowed.exit_status != 0:
                raise NodeError(_sudo_refused(target, allowed.stderr or "the command is not allowed"))
        return str(result.stdout).strip()


async def locate(conn: asyncssh.SSHClientConnection, target: SshTarget, bundle: str) -> dict:
    """Ask the node where its agent lives (nodestate.py, run by the node's python3): the
    directory, whether this bundle is there; NodeError says why the node cannot host it."""
    source = (HERE / "nodestate.py").read_text()
    cmd = _python_check() + "exec python3 -c " + " ".join(
        shlex.quote(a) for a in (source, target.agent_dir, target.name, bundle))
    try:
        result = await conn.run(cmd, timeout=30)
    except (OSError, asyncssh.Error) as e:
        raise NodeError(f"cannot run commands on the node: {describe(e)}") from None
    if result.exit_status != 0:
        raise NodeError(one_line(result.stderr or f"the node's python3 failed (exit {result.exit_status})"))
    try:
        info = json.loads(str(result.stdout).strip().splitlines()[-1])
    except (ValueError, IndexError):
        raise NodeError(one_line(f"unexpected answer from the node's python3: {result.stdout!r} "
                                 f"{result.stderr or ''}")) from None
    if info.get("error"):
        raise NodeError(one_line(info["error"]))
    return info


async def upload(conn: asyncssh.SSHClientConnection, remote: str, data: bytes) -> str:
    """Put the agent's bundle at `remote` atomically: over SFTP, else over an exec channel
    (`cat`), as Ansible does where sshd has no SFTP subsystem. Returns the way it went."""
    tmp = f"{remote}.{random.getrandbits(32):08x}.tmp"
    try:
        async with conn.start_sftp_client() as sftp:
            async with sftp.open(tmp, "wb", asyncssh.SFTPAttrs(permissions=0o600)) as f:
                await f.write(data)
            try:
                await sftp.posix_rename(tmp, remote)
            except asyncssh.SFTPOpUnsupported:
                await sftp.rename(tmp, remote)
        return "sftp"
    except (OSError, asyncssh.Error) as e:
        sftp_error = describe(e)
    q = shlex.quote
    cmd = f"umask 077 && cat > {q(tmp)} && mv -f {q(tmp)} {q(remote)}"
    try:
        result = await conn.run(cmd, input=data, encoding=None, timeout=120)
    except (OSError, asyncssh.Error) as e:
        raise NodeError(f"cannot upload the agent: no SFTP ({sftp_error}) and no exec channel "
                        f"either ({describe(e)})") from None
    if result.exit_status != 0:
        err = (result.stderr or b"").decode("utf-8", "replace")
        raise NodeError(one_line(f"cannot upload the agent: no SFTP ({sftp_error}), and `cat` "
                                 f"over an exec channel failed (exit {result.exit_status}): {err}"))
    return "exec"


MessageHandler = Callable[[str, dict], None]
StateHandler = Callable[[str, bool, str], Awaitable[None] | None]
AttemptHandler = Callable[[str], None]


class NodeLink:
    """Keeps one node's SSH connection and agent channel alive; reconnects with backoff."""

    def __init__(self, target: SshTarget, settings: SshSettings,
                 on_message: MessageHandler, on_link: StateHandler,
                 handshakes: asyncio.Semaphore | None = None, on_attempt: AttemptHandler | None = None):
        self.target = target
        self.handshakes = handshakes or asyncio.Semaphore(1)  # shared by the links of one daemon
        self.settings = settings
        self.on_message = on_message
        self.on_link = on_link
        self.on_attempt = on_attempt  # called when an attempt to connect begins (its turn came)
        self.connected = False
        self.last_error = ""
        self._stdin: asyncssh.SSHWriter | None = None
        self._out: list[str] = []  # messages queued this turn of the event loop (send) ...
        self._out_for: asyncssh.SSHWriter | None = None  # ... for this channel
        self._conn: asyncssh.SSHClientConnection | None = None
        self._task: asyncio.Task | None = None
        self._waiters: dict[int, asyncio.Future] = {}
        self._next_id = 0
        self._stopping = False

    @property
    def name(self) -> str:
        return self.target.name

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name=f"node-{self.name}")

    async def stop(self) -> None:
        self._stopping = True
        if self._conn is not None:
            self._conn.close()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def send(self, msg: dict) -> bool:
        """Queue one message for the agent; False when the link is down (caller retries later).
        The messages queued in one turn of the event loop go out in one write after it: a
        scheduling cycle that starts eight jobs on a node sends one SSH packet there, not eight
        (each is encrypted and sent on its own, and wakes the node's SSH server and agent)."""
        stdin = self._stdin
        if stdin is None or not self.connected:
            return False
        line = json.dumps(msg, separators=(",", ":"))
        if self._out_for is not stdin:  # nothing queued yet (or for a channel since replaced)
            if self._out_for is None:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:  # no event loop (a direct call): now
                    return self._write(stdin, [line])
                loop.call_soon(self._flush_out)
            self._out, self._out_for = [], stdin
        self._out.append(line)
        return True

    def _flush_out(self) -> None:
        lines, stdin = self._out, self._out_for
        self._out, self._out_for = [], None
        if lines and stdin is self._stdin:  # not for a channel that was replaced meanwhile
            self._write(stdin, lines)

    def _write(self, stdin, lines: list[str]) -> bool:
        try:
            stdin.write("\n".join(lines) + "\n")
        except (OSError, asyncssh.Error):  # the link is going down: a sync after the next
            return False  # connect finds out what the agent did not get
        return True

    async def request(self, msg: dict, timeout: float = 10.0) -> dict:
        self._next_id += 1
        rid = self._next_id
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._waiters[rid] = fut
        try:
            if not self.send({**msg, "id": rid}):
                raise NodeError(f"node {self.name} is not connected ({self.last_error or 'connecting'})")
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise NodeError(f"node {self.name} did not answer within {timeout:g} s") from None
        finally:
            self._waiters.pop(rid, None)

    async def _run(self) -> None:
        backoff = 0.2
        while not self._stopping:
            try:
                await self._session()
                backoff = 0.2
            except NodeError as e:
                self.last_error = one_line(str(e))
            except asyncio.CancelledError:
                raise
            except Exception as e:  # never let one node's surprise kill its link for good
                log.exception("node %s: unexpected error", self.name)
                self.last_error = f"{type(e).__name__}: {e}"
            was = self.connected
            self.connected = False
            self._stdin = None
            for fut in self._waiters.values():
                if not fut.done():
                    fut.set_exception(NodeError(f"node {self.name} disconnected"))
            if self._stopping:
                return
            if was or self.last_error:
                r = self.on_link(self.name, False, self.last_error)
                if asyncio.iscoroutine(r):
                    await r
            await asyncio.sleep(backoff * (0.5 + random.random()))
            backoff = min(backoff * 2, self.settings.reconnect_max_backoff_s)

    async def _session(self) -> None:
        conn = None
        try:
            # at most `connect_concurrency` nodes in the handshake (SSH key exchange, agent upload,
            # hello) at once: a daemon taking over a 1,000-node cluster does not open 1,000
            # handshakes in one burst and time most of them out
            async with self.handshakes:
                if self.on_attempt is not None:
                    self.on_attempt(self.name)
                conn = await connect(self.target, self.settings)
                self._conn = conn
                proc, hello = await self._open(conn)
            await self._serve(proc, hello)
        finally:
            self._conn = None
            if conn is not None:
                conn.close()

    async def _open(self, conn: asyncssh.SSHClientConnection):
        """Start the agent on a fresh connection; returns (process, hello)."""
        t = self.target
        if t.privilege == "sudo":
            return await self._start_installed_agent(conn)
        data, digest = agent_bundle()
        bundle = f"agent-{digest}.pyz"
        where = await locate(conn, t, bundle)
        remote = f"{where['dir']}/{bundle}"
        replace = not where.get("have_bundle")
        for attempt in (1, 2):
            if replace:
                how = await upload(conn, remote, data)
                log.info("node %s: agent %s uploaded over %s", self.name, digest, how)
            proc, hello = await self._start_agent(conn, remote, where["dir"])
            version = hello.get("protocol")
            if version == PROTOCOL_VERSION:
                break
            proc.close()
            if attempt == 2:
                raise NodeError(f"the agent at {remote} speaks protocol {version!r}, the "
                                f"daemon {PROTOCOL_VERSION}, and replacing it did not help")
            log.warning("node %s: agent speaks protocol %r, not %d: replacing it",
                        self.name, version, PROTOCOL_VERSION)
            replace = True
        return proc, hello

    async def _start_installed_agent(self, conn: asyncssh.SSHClientConnection):
        """The sudo mode: start the root-owned agent the trainyard_node role installed."""
        argv = agent_argv(self.target, self.settings)
        try:
            proc, hello = await self._start(conn, argv)
        except NodeError as e:
            text = str(e)
            if "a password is required" in text or "not allowed" in text or "sudoers" in text:
                raise NodeError(_sudo_refused(
                    self.target, text.rpartition("before it said hello: ")[2])) from None
            raise
        if hello.get("protocol") != PROTOCOL_VERSION:
            proc.close()
            raise NodeError(f"the agent installed at {INSTALLED_AGENT} speaks protocol "
                            f"{hello.get('protocol')!r}, the daemon {PROTOCOL_VERSION}: install this "
                            "version with `trainyard bootstrap --tags trainyard_node`")
        return proc, hello

    async def _start_agent(self, conn: asyncssh.SSHClientConnection, remote: str, directory: str):
        """Run the uploaded agent; returns (process, hello) or raises NodeError with the reason."""
        return await self._start(conn, agent_argv(self.target, self.settings,
                                                  remote, directory))

    async def _start(self, conn: asyncssh.SSHClientConnection, argv: list):
        cmd = "exec " + " ".join(shlex.quote(a) for a in argv)
        try:
            proc = await conn.create_process(cmd, encoding="utf-8")
        except (OSError, asyncssh.Error) as e:
            raise NodeError(f"cannot start the agent: {describe(e)}") from None
        wait = self.settings.hello_timeout_s
        try:
            # an agent stuck before its hello (a hung NFS mount, a python that never starts)
            # would otherwise hold its turn in the handshake queue for good
            async with asyncio.timeout(wait):
                async for line in proc.stdout:
                    try:
                        msg = json.loads(line)
                    except ValueError:
                        log.warning("node %s: agent said %r", self.name, line[:200])
                        continue
                    if msg.get("ev") == "hello":
                        return proc, msg
                    if msg.get("ev") == "error" and msg.get("fatal"):
                        proc.close()
                        raise NodeError(one_line(msg.get("error") or "the agent refused to start"))
        except TimeoutError:
            proc.close()
            raise NodeError(f"the agent started but did not say hello within {wait:g} s "
                            "(hello_timeout_s): is a file system on the node hung?") from None
        await proc.wait_closed()
        raise NodeError(await self._ended(proc, "before it said hello"))

    async def _ended(self, proc, when: str) -> str:
        status = proc.exit_status
        err = ""
        with contextlib.suppress(Exception):
            err = await asyncio.wait_for(proc.stderr.read(), 2)
        if status is None:
            return f"the connection was lost {when}"
        tail = one_line(err, 400)
        return f"the agent exited with status {status} {when}" + (f": {tail}" if tail else "")

    def _dispatch(self, line: str) -> None:
        """One line from the agent: an answer to a request, or a message for the daemon. A call of
        its own, so that the message dies with it instead of living in the serving loop's frame
        until the next line (at 1,000 nodes, 1,000 telemetry messages the collector walked)."""
        try:
            msg = decode_line(line)
        except ValueError:
            log.warning("node %s: agent said %r", self.name, line[:200])
            return
        rid = msg.get("id")
        if rid is not None and rid in self._waiters:
            fut = self._waiters[rid]
            if not fut.done():
                fut.set_result(msg)
            if msg.get("ev") != "error":
                return
        self.on_message(self.name, msg)

    async def _serve(self, proc, hello: dict) -> None:
        self._stdin = proc.stdin
        self.connected = True
        self.last_error = ""
        r = self.on_link(self.name, True, "")
        if asyncio.iscoroutine(r):
            await r
        self.on_message(self.name, hello)
        async for line in proc.stdout:
            self._dispatch(line)
        # stdout closed: the agent exited or the connection dropped
        await proc.wait_closed()
        raise NodeError(await self._ended(proc, "while serving the node"))


def decode_line(line: str) -> dict:
    """One agent message. orjson reads the telemetry stream (about 500 lines/s at 1,000 nodes)
    several times faster than `json`, which stays the fallback for the NaN and Infinity that
    Python's encoder writes and orjson refuses. Raises ValueError for a line that is not an
    object."""
    try:
        msg = orjson.loads(line)
    except orjson.JSONDecodeError:
        msg = json.loads(line)
    if not isinstance(msg, dict):
        raise ValueError(f"not a JSON object: {line[:200]!r}")
    return msg


def main(argv: list) -> int:
    """`python -m scheduler.nodes bundle PATH`: write the agent's bundle (the trainyard_node role
    installs it root-owned for the sudo privilege mode)."""
    if len(argv) != 2 or argv[0] != "bundle":
        print("usage: python -m scheduler.nodes bundle PATH", file=sys.stderr)
        return 2
    data, digest = agent_bundle()
    Path(argv[1]).write_bytes(data)
    print(digest)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
