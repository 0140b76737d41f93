"""Fixtures that build real things: OpenSSH sshd nodes, a trainyard daemon process, PostgreSQL."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(pred, timeout=15.0, interval=0.05, what="condition"):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        last = pred()
        if last:
            return last
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what} (last: {last!r})")


def require_or_skip(ok: bool, why: str) -> None:
    """A missing real part fails the run where CI promised it (TRAINYARD_REQUIRE_SSHD=1)."""
    if ok:
        return
    if os.environ.get("TRAINYARD_REQUIRE_SSHD") == "1":
        pytest.fail(f"{why} (TRAINYARD_REQUIRE_SSHD=1; install openssh-server)")
    pytest.skip(why)


def descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    out, todo = [], [root]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def kill_all(pids: list[int]) -> None:
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# ----------------------------------------------------------------------------- sshd nodes
SSHD = shutil.which("sshd") or ("/usr/sbin/sshd" if Path("/usr/sbin/sshd").exists() else None)


def shared_dir(prefix: str) -> Path:
    """A fresh directory every account can write (sticky, like /tmp): where test jobs, which run
    as another account when the suite runs as root, leave what the test then reads."""
    import tempfile

    root = Path("/var/tmp/trainyard-tests")
    root.mkdir(mode=0o711, exist_ok=True)
    d = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    os.chmod(d, 0o1777)
    return d


def agent_dir_for(base: Path, name: str) -> str:
    """The agent's directory for a test node. As root, jobs run as another account, which must be
    able to pass through the agent's directory to its job's own (as under /var/lib/trainyard):
    pytest's 0700 temp dirs would stop it, so root's test nodes keep theirs under /var/tmp."""
    if os.geteuid() != 0:
        return str(base / "agent")
    import tempfile

    root = Path("/var/tmp/trainyard-tests")
    root.mkdir(mode=0o711, exist_ok=True)
    os.chmod(root, 0o711)
    d = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=root))
    os.chmod(d, 0o711)
    return str(d / "agent")


class SshdNode:
    """A real OpenSSH sshd on a loopback port with its own host key, authorized_keys and HOME."""

    def __init__(self, base: Path, name: str, authorized_key: str):
        self.name = name
        self.dir = base / f"sshd-{name}"
        self.dir.mkdir(parents=True)
        os.chmod(self.dir, 0o700)
        self.port = free_port()
        self.host_key = self.dir / "host_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.host_key)], check=True)
        (self.dir / "authorized_keys").write_text(authorized_key)
        self.agent_dir = agent_dir_for(self.dir, name)
        self.proc: subprocess.Popen | None = None

    def config(self) -> Path:
        cfg = self.dir / "sshd_config"
        cfg.write_text(textwrap.dedent(f"""\
            Port {self.port}
            ListenAddress 127.0.0.1
            HostKey {self.host_key}
            PidFile {self.dir}/sshd.pid
            AuthorizedKeysFile {self.dir}/authorized_keys
            StrictModes no
            UsePAM no
            PasswordAuthentication no
            KbdInteractiveAuthentication no
            PermitRootLogin prohibit-password
            Subsystem sftp internal-sftp
            SetEnv HOME={self.dir} TRAINYARD_SIM_CPUS=32
            MaxStartups 100:30:200
            LogLevel ERROR
            """))
        return cfg

    def start(self) -> SshdNode:
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(exist_ok=True)
        self.proc = subprocess.Popen([SSHD, "-D", "-e", "-f", str(self.config())],
                                     stdout=subprocess.DEVNULL, stderr=open(self.dir / "sshd.log", "ab"))

        def listening():
            if self.proc.poll() is not None:
                raise AssertionError(f"sshd exited: {(self.dir / 'sshd.log').read_text()}")
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        wait_for(listening, 10, what=f"sshd {self.name} on port {self.port}")
        return self

    def kill(self) -> None:
        """A dead node: the listener and everything under it (sessions, agent, jobs)."""
        if not self.proc or self.proc.poll() is not None:
            return
        # established sessions live in their own sshd processes (notes/ssh.md pitfall 7)
        victims = descendants(self.proc.pid)
        self.proc.kill()
        self.proc.wait()
        kill_all(victims)

    def drop_connections(self) -> None:
        """Cut the link but keep the jobs: sshd and the agent go, the detached jobs stay."""
        if not self.proc or self.proc.poll() is not None:
            return
        victims = []
        for pid in descendants(self.proc.pid):
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            is_step = b"wrap" in cmd[2:3]  # the job's own step process (agent-<digest>.pyz wrap ...)
            if cmd[0].startswith(b"sshd") or (any(b"agent-" in part for part in cmd[:2]) and not is_step):
                victims.append(pid)
        self.proc.kill()
        self.proc.wait()
        kill_all(victims)

    def new_host_key(self) -> None:
        self.host_key.unlink()
        Path(str(self.host_key) + ".pub").unlink()
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(self.host_key)], check=True)

    def stop(self) -> None:
        self.kill()


@pytest.fixture
def sshd_factory(tmp_path):
    require_or_skip(SSHD is not None and shutil.which("ssh-keygen") is not None,
                    "OpenSSH sshd is not installed (apt-get install openssh-server)")
    nodes: list[SshdNode] = []

    def make(name: str, authorized_key: str) -> SshdNode:
        node = SshdNode(tmp_path, name, authorized_key).start()
        nodes.append(node)
        return node

    yield make
    for n in nodes:
        n.stop()


class NetnsSshdNode(SshdNode):
    """An sshd in a network namespace of its own, reached over a veth pair, so that a test can
    take the link down (no RST, no FIN: only keepalives notice). Its processes share this
    machine's file system; only the network is separate."""

    def __init__(self, base: Path, name: str, authorized_key: str):
        super().__init__(base, name, authorized_key)
        tag = f"{os.getpid() % 1000}{self.port % 100}"
        octet = (os.getpid() + self.port) % 250 + 1
        self.netns, self.host_if, self.ns_if = f"tyd-{tag}", f"tydh{tag}", f"tydn{tag}"
        self.host_ip, self.address = f"10.232.{octet}.1", f"10.232.{octet}.2"
        self.port = 22
        run = lambda *a: subprocess.run(a, check=True, capture_output=True)  # noqa: E731
        run("ip", "netns", "add", self.netns)
        run("ip", "link", "add", self.host_if, "type", "veth", "peer", "name", self.ns_if)
        run("ip", "link", "set", self.ns_if, "netns", self.netns)
        run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_if)
        run("ip", "link", "set", self.host_if, "up")
        for cmd in (["ip", "addr", "add", f"{self.address}/30", "dev", self.ns_if],
                    ["ip", "link", "set", self.ns_if, "up"], ["ip", "link", "set", "lo", "up"]):
            run("ip", "netns", "exec", self.netns, *cmd)

    def config(self) -> Path:
        cfg = super().config()
        cfg.write_text(cfg.read_text().replace("ListenAddress 127.0.0.1", f"ListenAddress {self.address}"))
        return cfg

    def start(self) -> NetnsSshdNode:
        if os.geteuid() == 0:
            Path("/run/sshd").mkdir(exist_ok=True)
        self.proc = subprocess.Popen(["ip", "netns", "exec", self.netns, SSHD, "-D", "-e", "-f", str(self.config())],
                                     stdout=subprocess.DEVNULL, stderr=open(self.dir / "sshd.log", "ab"))

        def listening():
            if self.proc.poll() is not None:
                raise AssertionError(f"sshd exited: {(self.dir / 'sshd.log').read_text()}")
            with socket.socket() as s:
                s.settimeout(0.5)
                return s.connect_ex((self.address, self.port)) == 0

        wait_for(listening, 10, what=f"sshd {self.name} in {self.netns}")
        return self

    def link(self, up: bool) -> None:
        subprocess.run(["ip", "link", "set", self.host_if, "up" if up else "down"], check=True)

    def stop(self) -> None:
        out = subprocess.run(["ip", "netns", "pids", self.netns], capture_output=True, text=True).stdout
        kill_all([int(p) for p in out.split()])
        if self.proc:
            self.proc.wait()
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)


def netns_available() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    probe = f"typrobe{os.getpid()}"
    ok = subprocess.run(["ip", "netns", "add", probe], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ok


@pytest.fixture
def netns_sshd_factory(tmp_path):
    require_or_skip(SSHD is not None, "OpenSSH sshd is not installed (apt-get install openssh-server)")
    if not netns_available():
        pytest.skip("network namespaces need root and iproute2 (`ip netns add` failed): link-down tests skipped")
    nodes: list[NetnsSshdNode] = []

    def make(name: str, authorized_key: str) -> NetnsSshdNode:
        node = NetnsSshdNode(tmp_path, name, authorized_key)
        nodes.append(node)
        return node.start()

    yield make
    for n in nodes:
        n.stop()


# ----------------------------------------------------------------------------- a daemon process
# As root, the agent runs each job as its owner's Unix account (DESIGN.md boundary 3). The test
# users (alice, user1, ...) have none, so the suite maps them all to one unprivileged account it
# creates; tests of per-user accounts (tests/nodes/) create real ones of their own.
JOB_ACCOUNT = "tyjobs"


def ensure_job_account() -> str:
    """The Unix account test jobs run as when the suite runs as root ("" when not root)."""
    if os.geteuid() != 0:
        return ""
    import pwd

    try:
        pwd.getpwnam(JOB_ACCOUNT)
    except KeyError:
        subprocess.run(["useradd", "--create-home", "--shell", "/bin/sh", JOB_ACCOUNT], check=True,
                       capture_output=True)
    return JOB_ACCOUNT


def users_table() -> str:
    account = ensure_job_account()
    return f'\n[users]\n"*" = "{account}"\n' if account else ""


TEST_CONFIG = """\
[daemon]
node_grace_s = {grace}
connect_timeout_s = 3.0
keepalive_interval_s = 1.0
keepalive_count_max = 2
reconnect_max_backoff_s = 1.0
kill_grace_s = 1.0
schedule_interval_s = 0.2
telemetry_interval_s = 0.5
"""


class DaemonProc:
    """`trainyard daemon` as a real process, with its own HOME, TRAINYARD_HOME and config dir."""

    def __init__(self, base: Path, db: str | None = None, grace: float = 3.0, extra_config: str = ""):
        self.base = base
        self.home = base / "home"
        self.env = {**os.environ, "HOME": str(base), "TRAINYARD_HOME": str(base / "state"),
                    "XDG_CONFIG_HOME": str(base / "config"), "PYTHONUNBUFFERED": "1", "USER": "alice"}
        self.env.pop("TRAINYARD_URL", None)
        self.env.pop("TRAINYARD_TOKEN", None)
        self.config = base / "trainyard.toml"
        users = "" if "[users]" in extra_config else users_table()  # a test's own map wins
        self.config.write_text(TEST_CONFIG.format(grace=grace) + extra_config + users)
        self.port = free_port()
        self.db = db
        self.proc: subprocess.Popen | None = None
        self.log = base / "daemon.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def state(self) -> Path:
        return self.base / "state"

    def start(self) -> DaemonProc:
        cmd = [PY, "-m", "scheduler.cli", "daemon", "--listen", f"127.0.0.1:{self.port}",
               "--config", str(self.config)]
        if self.db:
            cmd += ["--db", self.db]
        seen = self.log.stat().st_size if self.log.exists() else 0
        self.proc = subprocess.Popen(cmd, env=self.env, cwd=ROOT, stdout=subprocess.DEVNULL,
                                     stderr=open(self.log, "ab"))

        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"daemon exited {self.proc.returncode}: {self.log.read_text()[-3000:]}")
            return "listening on" in self.log.read_text()[seen:]

        wait_for(up, 20, what="daemon start")
        return self

    @property
    def token(self) -> str:
        path = self.base / "config" / "trainyard" / "client.toml"
        # on PostgreSQL the daemon writes it once it leads, which can come after it listens
        wait_for(path.exists, 20, what="the daemon's first admin token (client.toml)")
        return tomllib.loads(path.read_text())["token"]

    @property
    def public_key(self) -> str:
        return (self.state / "ssh" / "id_ed25519.pub").read_text()

    def client(self, token: str | None = None):
        from scheduler.client import Client

        return Client(self.url, token or self.token)

    def cli(self, *args: str, token: str | None = None, check: bool = False, input: str | None = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
        env = {**self.env, "TRAINYARD_URL": self.url, "TRAINYARD_TOKEN": token or self.token}
        r = subprocess.run([PY, "-m", "scheduler.cli", *args], env=env, cwd=ROOT, capture_output=True,
                           text=True, input=input, timeout=timeout)
        if check and r.returncode != 0:
            raise AssertionError(f"trainyard {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
        return r

    def kill9(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def daemon_factory(tmp_path):
    started: list[DaemonProc] = []

    def make(db: str | None = None, grace: float = 3.0, sub: str = "d", extra_config: str = "") -> DaemonProc:
        base = tmp_path / sub
        base.mkdir(exist_ok=True)
        d = DaemonProc(base, db=db, grace=grace, extra_config=extra_config).start()
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop()


@pytest.fixture
def daemon(daemon_factory):
    return daemon_factory()


class DemoProc:
    """`trainyard demo --no-tui` as a real process; its URL and token from the lines it prints."""

    def __init__(self, base: Path, nodes: int = 2, gpus: int = 4):
        self.env = {**os.environ, "HOME": str(base), "XDG_CONFIG_HOME": str(base / "cfg")}
        self.proc = subprocess.Popen(
            [PY, "-m", "scheduler.cli", "demo", "--no-tui", "--idle", "--nodes", str(nodes), "--gpus-per-node", str(gpus),
             "--dir", str(base / "demo")], cwd=ROOT, env=self.env, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True)
        self.url = self.proc.stdout.readline().strip().partition("=")[2]
        self.token = self.proc.stdout.readline().strip().partition("=")[2]
        if not self.url or not self.token:
            self.stop()
            raise AssertionError("trainyard demo did not print TRAINYARD_URL/TRAINYARD_TOKEN")

    def client(self, token: str | None = None):
        from scheduler.client import Client

        return Client(self.url, token or self.token)

    def cli(self, *args: str, check: bool = False) -> subprocess.CompletedProcess:
        env = {**self.env, "TRAINYARD_URL": self.url, "TRAINYARD_TOKEN": self.token}
        r = subprocess.run([PY, "-m", "scheduler.cli", *args], env=env, cwd=ROOT, capture_output=True,
                           text=True, timeout=60)
        if check and r.returncode != 0:
            raise AssertionError(f"trainyard {' '.join(args)} -> {r.returncode}\n{r.stdout}\n{r.stderr}")
        return r

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                return self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.proc.wait()


@pytest.fixture(scope="module")
def demo_cluster(tmp_path_factory):
    d = DemoProc(tmp_path_factory.mktemp("demo"))
    yield d
    d.stop()


def add_sshd_node(d: DaemonProc, node: SshdNode, gpus: int = 4, labels: dict | None = None) -> dict:
    """Register an sshd node (accepting its host key) and wait until it is UP."""
    c = d.client()
    c.add_node({"name": node.name, "address": getattr(node, "address", "127.0.0.1"), "port": node.port, "user": current_user(),
                "accept_new_host_key": True, "gpus": gpus, "gpu_model": "Test GPU",
                "agent_dir": node.agent_dir, "labels": labels or {}})
    return wait_for(lambda: (n := c.node(node.name))["state"] == "UP" and n["gpus_total"] == gpus and n,
                    20, what=f"node {node.name} UP")


def current_user() -> str:
    import pwd

    return pwd.getpwuid(os.geteuid()).pw_name


@pytest.fixture
def cluster(daemon, sshd_factory):
    """A daemon process with two real sshd nodes of 4 declared GPUs each, both UP."""
    nodes = [sshd_factory(f"n{i}", daemon.public_key) for i in (1, 2)]
    for n in nodes:
        add_sshd_node(daemon, n)
    return daemon, nodes


def wait_job(client, job_id: int, states, timeout=20.0) -> dict:
    states = {states} if isinstance(states, str) else set(states)
    return wait_for(lambda: (j := client.job(job_id))["state"] in states and j, timeout,
                    what=f"job {job_id} in {sorted(states)}")


# ----------------------------------------------------------------------------- PostgreSQL
def _pg_bindir() -> Path | None:
    for cand in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        if (cand / "initdb").exists():
            return cand
    found = shutil.which("initdb")
    return Path(found).parent if found else None


@contextlib.contextmanager
def pg_server():
    """A throwaway PostgreSQL server on a loopback port (Debian's postgresql package), its URL;
    stopped and removed on exit. None where the server binaries are not installed."""
    bindir = _pg_bindir()
    if bindir is None:
        yield None
        return
    import tempfile

    # not under pytest's 0700 tmp tree: the postgres user must be able to reach it
    base = Path(tempfile.mkdtemp(prefix="trainyard-pg-"))
    data = base / "data"
    port = free_port()
    as_user: list[str] = []
    if os.geteuid() == 0:  # postgres refuses to run as root
        as_user = ["runuser", "-u", "postgres", "--"]
        shutil.chown(base, "postgres")
    subprocess.run([*as_user, str(bindir / "initdb"), "-D", str(data), "-U", "trainyard", "--auth=trust",
                    "-E", "UTF8"], check=True, capture_output=True)
    proc = subprocess.Popen([*as_user, str(bindir / "postgres"), "-D", str(data), "-p", str(port),
                             "-k", str(base), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: subprocess.run([str(bindir / "pg_isready"), "-h", "127.0.0.1", "-p", str(port)],
                                        capture_output=True).returncode == 0, 30, what="postgres")
        subprocess.run([str(bindir / "createdb") if (bindir / "createdb").exists() else "createdb",
                        "-h", "127.0.0.1", "-p", str(port), "-U", "trainyard", "trainyard"], check=True)
        yield f"postgresql://trainyard@127.0.0.1:{port}/trainyard"
    finally:
        proc.terminate()
        proc.wait(20)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def postgres_url(tmp_path_factory):
    """A throwaway PostgreSQL server, or the one TRAINYARD_TEST_POSTGRES names."""
    url = os.environ.get("TRAINYARD_TEST_POSTGRES")
    if url and url != "1":
        yield url
        return
    with pg_server() as url:
        require_or_skip(url is not None, "PostgreSQL server binaries (initdb) are not installed "
                                         "(apt-get install postgresql)")
        yield url


def fresh_pg_db(url: str, name: str) -> str:
    """A new empty database on the test server, so tests do not see each other's rows."""
    import psycopg

    name = re.sub(r"[^a-z0-9_]", "_", name.lower())[:50]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
        conn.execute(f'CREATE DATABASE "{name}"')
    return url.rsplit("/", 1)[0] + "/" + name


def leading_daemon(request, tmp_path: Path, name: str, clock, **config):
    """An in-process Daemon on `request.param`'s database ("sqlite", or "postgresql": a fresh
    database on the test server), leading as the campaign would make it (its writes pass the
    epoch fence, and it has read and written what taking office does)."""
    from scheduler.config import DaemonConfig
    from scheduler.daemon import Daemon

    if request.param == "postgresql":
        config["db"] = fresh_pg_db(request.getfixturevalue("postgres_url"), f"ty_{name}_{os.getpid()}")
    d = Daemon(DaemonConfig(**config), tmp_path / "home", clock=clock)
    d.prepare()
    if request.param == "postgresql":
        d.leadership._take_office()
        d.leadership.role = "leader"
        d._load_state()  # the default queue, the active jobs
    return d


@pytest.fixture(scope="module")
def shared_cluster(tmp_path_factory):
    """Like `cluster`, but one per test module, for tests that leave the nodes as they found them."""
    require_or_skip(SSHD is not None, "OpenSSH sshd is not installed (apt-get install openssh-server)")
    base = tmp_path_factory.mktemp("cluster")
    d = DaemonProc(base).start()
    nodes = [SshdNode(base, f"n{i}", d.public_key).start() for i in (1, 2)]
    try:
        for n in nodes:
            add_sshd_node(d, n)
        yield d, nodes
    finally:
        d.stop()
        for n in nodes:
            n.stop()
