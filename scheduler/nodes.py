"""SSH sessions to nodes: one asyncssh connection per node, one long-lived agent channel on it."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import random
import shlex
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import asyncssh

log = logging.getLogger("trainyard.nodes")

AGENT_SOURCE = Path(__file__).with_name("agent.py")


def agent_bytes() -> tuple[bytes, str]:
    data = AGENT_SOURCE.read_bytes()
    return data, hashlib.sha256(data).hexdigest()[:16]


class NodeError(Exception):
    """A node could not be reached or refused us; the message is for people."""


@dataclass(frozen=True)
class SshTarget:
    name: str
    address: str
    port: int
    user: str
    key_path: str
    agent_dir: str = ".trainyard"
    declared_gpus: int = 0
    gpu_model: str = ""


@dataclass(frozen=True)
class SshSettings:
    known_hosts: str
    connect_timeout_s: float = 10.0
    keepalive_interval_s: float = 3.0
    keepalive_count_max: int = 3
    reconnect_max_backoff_s: float = 10.0
    telemetry_interval_s: float = 2.0


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


async def connect(target: SshTarget, settings: SshSettings) -> asyncssh.SSHClientConnection:
    try:
        return await asyncssh.connect(
            target.address, target.port, username=target.user,
            client_keys=[target.key_path], known_hosts=settings.known_hosts,
            connect_timeout=settings.connect_timeout_s,
            keepalive_interval=settings.keepalive_interval_s,
            keepalive_count_max=settings.keepalive_count_max,
            agent_path=None, config=[], preferred_auth="publickey",
        )
    except (TimeoutError, OSError, asyncssh.Error) as e:
        raise NodeError(describe(e)) from None


async def probe(target: SshTarget, settings: SshSettings) -> str:
    """Connect once and check that python3 is there; returns its version or raises NodeError."""
    conn = await connect(target, settings)
    async with conn:
        result = await conn.run("python3 -c 'import sys; print(sys.version.split()[0])'", timeout=15)
        if result.exit_status != 0:
            raise NodeError(f"python3 is missing on the node ({(result.stderr or '').strip()[:200]}); "
                            "bootstrap it first (`trainyard bootstrap`)")
        return str(result.stdout).strip()


MessageHandler = Callable[[str, dict], None]
StateHandler = Callable[[str, bool, str], Awaitable[None] | None]


class NodeLink:
    """Keeps one node's SSH connection and agent channel alive; reconnects with backoff."""

    def __init__(self, target: SshTarget, settings: SshSettings,
                 on_message: MessageHandler, on_link: StateHandler):
        self.target = target
        self.settings = settings
        self.on_message = on_message
        self.on_link = on_link
        self.connected = False
        self.last_error = ""
        self._stdin: asyncssh.SSHWriter | None = None
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
        """Queue one message for the agent; False when the link is down (caller retries later)."""
        if self._stdin is None or not self.connected:
            return False
        try:
            self._stdin.write(json.dumps(msg, separators=(",", ":")) + "\n")
        except (OSError, asyncssh.Error):
            return False
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
                self.last_error = str(e)
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
        t = self.target
        conn = await connect(t, self.settings)
        self._conn = conn
        try:
            data, digest = agent_bytes()
            remote = f"{t.agent_dir.rstrip('/')}/agent-{digest}.py"
            try:
                async with conn.start_sftp_client() as sftp:
                    if not await sftp.exists(remote):
                        await sftp.makedirs(t.agent_dir, exist_ok=True)
                        tmp = remote + ".tmp"
                        async with sftp.open(tmp, "wb") as f:
                            await f.write(data)
                        await sftp.posix_rename(tmp, remote)
            except (OSError, asyncssh.Error) as e:
                raise NodeError(f"cannot upload the agent over SFTP: {describe(e)}") from None
            cmd = " ".join(shlex.quote(a) for a in [
                "exec", "python3", remote, "--root", t.agent_dir, "--gpus", str(t.declared_gpus),
                "--gpu-model", t.gpu_model, "--telemetry", str(self.settings.telemetry_interval_s),
            ])
            cmd = cmd.replace("'exec'", "exec", 1)
            try:
                proc = await conn.create_process(cmd, encoding="utf-8")
            except (OSError, asyncssh.Error) as e:
                raise NodeError(f"cannot start the agent: {describe(e)}") from None
            self._stdin = proc.stdin
            first = True
            async for line in proc.stdout:
                try:
                    msg = json.loads(line)
                except ValueError:
                    log.warning("node %s: agent said %r", self.name, line[:200])
                    continue
                if first:
                    first = False
                    self.connected = True
                    self.last_error = ""
                    r = self.on_link(self.name, True, "")
                    if asyncio.iscoroutine(r):
                        await r
                rid = msg.get("id")
                if rid is not None and rid in self._waiters:
                    fut = self._waiters[rid]
                    if not fut.done():
                        fut.set_result(msg)
                    if msg.get("ev") != "error":
                        continue
                self.on_message(self.name, msg)
            # stdout closed: the agent exited or the connection dropped
            status = proc.exit_status
            err = (await proc.stderr.read()) if proc.stderr else ""
            raise NodeError(
                "agent channel closed" + (f" (agent exit {status}: {err.strip()[-300:]})" if status else "")
            )
        finally:
            self._conn = None
            conn.close()
