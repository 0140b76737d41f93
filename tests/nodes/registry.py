"""A local image registry (Debian's docker-registry), podman set up per node, a tiny image.

No registry on the internet is reachable from the test machines, so the image is a busybox
root file system imported with podman and pushed to a registry on a loopback port. Each node
gets its own podman configuration and image storage, bind-mounted over /etc/containers in the
node's mount namespace, as a real node has its own /etc/containers and /var/lib/containers.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

from tests.conftest import free_port, wait_for

REGISTRY = shutil.which("docker-registry")
PODMAN = shutil.which("podman")
RUNC = shutil.which("runc")
BUSYBOX = next((p for p in ("/bin/busybox", "/usr/bin/busybox") if os.path.exists(p)), None)
BUSYBOX_TOOLS = ("sh", "id", "ls", "cat", "echo", "sleep", "env", "true", "head")


def missing() -> str:
    """What the container tests lack on this machine, in words ("" when nothing)."""
    need = {"podman": PODMAN, "runc": RUNC, "docker-registry": REGISTRY,
            "busybox-static": BUSYBOX}
    lacking = [name for name, path in need.items() if not path]
    return f"apt-get install -y {' '.join(lacking)}" if lacking else ""


class Registry:
    """docker-registry serving a directory on a loopback port; optionally with htpasswd users."""

    def __init__(self, base: Path, name: str, data: Path, users: dict | None = None):
        self.dir = base / name
        self.dir.mkdir(mode=0o700, exist_ok=True)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.log = self.dir / "access.log"
        auth = ""
        if users:
            lines = [f"{u}:{_bcrypt(p)}" for u, p in users.items()]
            (self.dir / "htpasswd").write_text("\n".join(lines) + "\n")
            auth = f"auth:\n  htpasswd:\n    realm: trainyard-tests\n    path: {self.dir}/htpasswd\n"
        (self.dir / "config.yml").write_text(textwrap.dedent(f"""\
            version: 0.1
            log:
              level: warn
            storage:
              filesystem:
                rootdirectory: {data}
            http:
              addr: {self.address}
            """) + auth)
        self.proc = subprocess.Popen([REGISTRY, "serve", str(self.dir / "config.yml")],
                                     stdout=open(self.log, "ab"), stderr=subprocess.STDOUT)

        def up():
            if self.proc.poll() is not None:
                raise AssertionError(f"docker-registry exited: {self.log.read_text()}")
            with socket.socket() as s:
                return s.connect_ex(("127.0.0.1", self.port)) == 0

        wait_for(up, 10, what=f"docker-registry on {self.address}")

    def requests(self, repository: str) -> int:
        """How many requests for this repository the registry has served (its access log)."""
        return len(re.findall(rf'"(?:GET|HEAD) /v2/{re.escape(repository)}/',
                              self.log.read_text()))

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(5)


class Hanging:
    """A 'registry' that accepts connections and never answers: a pull that hangs."""

    def __init__(self):
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"

    def stop(self) -> None:
        self.sock.close()


class Throttled:
    """A loopback proxy in front of a registry that sends its answers slowly (one 16 KiB chunk
    per `delay_s`): a pull that takes seconds, long enough to watch its progress."""

    def __init__(self, upstream: str, delay_s: float = 0.05):
        host, _, port = upstream.rpartition(":")
        self.upstream, self.delay_s = (host, int(port)), delay_s
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.address = f"127.0.0.1:{self.sock.getsockname()[1]}"
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            threading.Thread(target=self._pipe, args=(client, server, 0.0), daemon=True).start()
            threading.Thread(target=self._pipe, args=(server, client, self.delay_s),
                             daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, delay_s: float) -> None:
        try:
            while data := src.recv(16384):
                time.sleep(delay_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)

    def stop(self) -> None:
        self.sock.close()


def _bcrypt(password: str) -> str:
    # docker-registry's htpasswd takes bcrypt only; the system Python's crypt module makes it
    code = ("import crypt, sys; "
            "print(crypt.crypt(sys.argv[1], crypt.mksalt(crypt.METHOD_BLOWFISH)))")
    python = shutil.which("python3") or sys.executable
    return subprocess.run([python, "-W", "ignore", "-c", code, password], check=True,
                          capture_output=True, text=True).stdout.strip()


NODE_RUNROOT = "/tmp/podman-run"  # on the node's own /tmp (a tmpfs that ends with the node)


def podman_config(directory: Path, insecure: list[str], runroot: str | Path = NODE_RUNROOT) -> Path:
    """A complete /etc/containers for one node (or, with a runroot of its own, the test itself):
    runc, cgroupfs, vfs storage under `directory`, the loopback registries marked insecure.

    The run state stays short: podman hands its runroot to the exit command that records a
    container's end (`podman --runroot DIR container cleanup`), which refuses one of more than
    50 characters; `podman run` then waits out its 20 s conmon timeout for every container.
    The test's own podman (import, push: no containers) may keep its run state anywhere."""
    etc = directory / "etc-containers"
    if etc.exists():
        shutil.rmtree(etc)
    shutil.copytree("/etc/containers", etc, symlinks=True)
    for sub in ("storage", "tmp"):
        (directory / sub).mkdir(mode=0o711, exist_ok=True)
    (etc / "containers.conf").write_text(textwrap.dedent(f"""\
        [containers]
        default_ulimits = []
        [engine]
        runtime = "runc"
        cgroup_manager = "cgroupfs"
        events_logger = "file"
        events_logfile_path = "{directory}/events.log"
        tmp_dir = "{directory}/tmp"
        """))
    (etc / "storage.conf").write_text(textwrap.dedent(f"""\
        [storage]
        driver = "vfs"
        graphroot = "{directory}/storage"
        runroot = "{runroot}"
        """))
    (etc / "registries.conf").write_text('unqualified-search-registries = []\n' + "".join(
        f'[[registry]]\nlocation = "{r}"\ninsecure = true\n' for r in insecure))
    return etc


def podman_env(etc: Path) -> dict:
    """The environment that points podman at this configuration (for the test's own podman)."""
    return {**os.environ, "CONTAINERS_CONF": str(etc / "containers.conf"),
            "CONTAINERS_STORAGE_CONF": str(etc / "storage.conf"),
            "CONTAINERS_REGISTRIES_CONF": str(etc / "registries.conf")}


def build_image(work: Path, etc: Path, ref: str) -> str:
    """A busybox image pushed to `ref` (REGISTRY/REPO:TAG); its digest in the registry."""
    root = work / "rootfs"
    (root / "bin").mkdir(parents=True)
    for d in ("dev", "proc", "sys", "etc", "tmp"):
        (root / d).mkdir()
    os.chmod(root / "tmp", 0o1777)
    shutil.copy(BUSYBOX, root / "bin" / "busybox")
    for tool in BUSYBOX_TOOLS:
        (root / "bin" / tool).symlink_to("busybox")
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    subprocess.run(["tar", "-C", str(root), "-cf", str(work / "rootfs.tar"), "."], check=True)
    env = podman_env(etc)
    local = "localhost/trainyard-test:1"
    subprocess.run([PODMAN, "import", "--change", "ENV PATH=/bin", str(work / "rootfs.tar"),
                    local], check=True, capture_output=True, env=env)
    digest_file = work / "digest"
    subprocess.run([PODMAN, "push", "--tls-verify=false", "--digestfile", str(digest_file),
                    local, ref], check=True, capture_output=True, env=env)
    return digest_file.read_text().strip()


def use_podman_config(node, etc: Path) -> None:
    """Give a running node this /etc/containers (a bind mount in its own mount namespace)."""
    r = node.run(f"mount --bind {etc} /etc/containers")
    assert r.returncode == 0, r.stderr
