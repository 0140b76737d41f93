"""Fixtures for the playbook tests: a throwaway Debian host reached over real SSH.

The target is a Debian 12 root filesystem (debootstrap, cached between sessions) mounted as an
overlay, with its own sshd running chrooted inside its own network namespace and mount
namespace. Ansible reaches it over a veth pair; nothing runs against the machine under test.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import shlex
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PLAYBOOKS = ROOT / "playbooks"
SUITE = "bookworm"
MIRROR = os.environ.get("TRAINYARD_TEST_DEBIAN_MIRROR", "http://deb.debian.org/debian")
# Everything site.yml would install on a Debian 12 node without a GPU is in the image, so the
# real run needs no network inside the namespace.
PACKAGES = [
    "acl",
    "ca-certificates",
    "chrony",
    "curl",
    "gnupg",
    "kmod",
    "nfs-common",
    "numactl",
    "openssh-server",
    "pciutils",
    "python3",
    "python3-apt",
    "python3-packaging",
    "python3-venv",
    "rsync",
    "sudo",
]
# The agent's Python package, served to the target from a local wheelhouse (air-gapped style).
AGENT_WHEEL = "nvidia-ml-py==13.615.71"
WHEELHOUSE_IN_TARGET = "/var/cache/trainyard-wheels"
CACHE = Path(os.environ.get("TRAINYARD_TEST_CACHE", "/var/tmp/trainyard-tests"))


@dataclass
class Target:
    root: Path  # the target's filesystem, as seen from here (for assertions only)
    address: str
    port: int
    user: str
    private_key: Path
    known_hosts: Path
    public_key: str  # the "daemon's" key that bootstrap must authorize for the trainyard user

    def document(self, **overrides) -> list[dict]:
        node = {
            "name": "node-a",
            "address": self.address,
            "ssh_user": self.user,
            "ssh_port": self.port,
            "pool": "h100",
            "provider": "onprem",
            "gpu_model": "H100",
            "gpu_count": 8,
            "labels": {"rack": "r12", "fabric": "ib"},
        }
        node.update(overrides)
        return [node]

    def ssh_vars(self) -> dict:
        return {
            "ansible_ssh_private_key_file": str(self.private_key),
            "ansible_ssh_common_args": f"-o UserKnownHostsFile={self.known_hosts} -o StrictHostKeyChecking=yes",
        }

    def run(self, command: str, as_user: str | None = None) -> subprocess.CompletedProcess:
        """Run a shell command inside the target over SSH (through su when `as_user` is given)."""
        cmd = command if as_user is None else f"su -s /bin/sh {as_user} -c {shlex.quote(command)}"
        return subprocess.run(
            [
                "ssh",
                "-i",
                str(self.private_key),
                "-p",
                str(self.port),
                "-o",
                f"UserKnownHostsFile={self.known_hosts}",
                "-o",
                "StrictHostKeyChecking=yes",
                "-o",
                "BatchMode=yes",
                f"{self.user}@{self.address}",
                cmd,
            ],
            capture_output=True,
            text=True,
            timeout=60,
        )


def _missing_prerequisite() -> str | None:
    if sys.platform != "linux":
        return "the throwaway target needs Linux namespaces"
    if os.geteuid() != 0:
        return "the throwaway target needs root (network namespaces, chroot, overlay mounts)"
    for tool in ("ip", "unshare", "chroot", "ssh", "ssh-keygen", "mount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not _cached_rootfs().exists() and shutil.which("debootstrap") is None:
        return "debootstrap is not installed (apt-get install debootstrap) and no cached target image exists"
    probe = f"typrobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"cannot create a network namespace: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def _cached_rootfs() -> Path:
    digest = hashlib.sha256(" ".join([SUITE, *PACKAGES, AGENT_WHEEL]).encode()).hexdigest()[:12]
    return CACHE / f"debian-{SUITE}-{digest}"


def _build_rootfs() -> Path:
    """The cached Debian root, built once per machine (about a minute with a nearby mirror)."""
    final = _cached_rootfs()
    if (final / ".complete").exists():
        return final
    CACHE.mkdir(parents=True, exist_ok=True)
    staging = final.with_name(final.name + f".build{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    built = subprocess.run(
        [
            "debootstrap",
            "--variant=minbase",
            f"--include={','.join(PACKAGES)}",
            SUITE,
            str(staging),
            MIRROR,
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    if built.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(
            f"debootstrap failed ({built.returncode}):\n{built.stdout[-2000:]}\n{built.stderr[-2000:]}"
        )
    wheels = staging / WHEELHOUSE_IN_TARGET.lstrip("/")
    wheels.mkdir(parents=True)
    fetched = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(wheels),
            AGENT_WHEEL,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    if fetched.returncode != 0:
        shutil.rmtree(staging, ignore_errors=True)
        raise RuntimeError(f"pip download {AGENT_WHEEL} failed:\n{fetched.stderr[-2000:]}")
    # Host keys are made per session, never baked into the shared image.
    for key in (staging / "etc" / "ssh").glob("ssh_host_*"):
        key.unlink()
    (staging / ".complete").touch()
    if final.exists():  # another session finished first
        shutil.rmtree(staging, ignore_errors=True)
    else:
        staging.rename(final)
    return final


def _sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True, text=True)


def _wait_for_port(address: str, port: int, proc: subprocess.Popen, seconds: float = 15) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"the target's sshd exited with {proc.returncode}: {proc.stderr.read()}"
            )
        try:
            with socket.create_connection((address, port), timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise RuntimeError(f"the target's sshd did not listen on {address}:{port} within {seconds}s")


@pytest.fixture(scope="session")
def target_image() -> Path:
    """The Debian root every target starts from (built once, then cached on disk)."""
    missing = _missing_prerequisite()
    if missing:
        if os.environ.get("TRAINYARD_REQUIRE_SSHD") == "1":
            pytest.fail(
                f"TRAINYARD_REQUIRE_SSHD=1 but the throwaway target cannot be built: {missing}"
            )
        pytest.skip(f"no throwaway Ansible target: {missing}")
    return _build_rootfs()


@pytest.fixture(scope="module")
def target(target_image, tmp_path_factory) -> Target:
    """A fresh host per test module: an overlay on the image, so no module sees another's changes."""
    base = target_image
    work = tmp_path_factory.mktemp("target")
    merged, upper, scratch = work / "root", work / "upper", work / "work"
    for d in (merged, upper, scratch):
        d.mkdir()
    _sh(
        "mount",
        "-t",
        "overlay",
        "overlay",
        "-o",
        f"lowerdir={base},upperdir={upper},workdir={scratch}",
        str(merged),
    )

    tag = secrets.token_hex(3)
    netns, host_if, ns_if = f"ty-{tag}", f"tyh{tag}", f"tyn{tag}"
    octet = int(tag[:2], 16) % 250 + 1
    host_ip, ns_ip = f"10.231.{octet}.1", f"10.231.{octet}.2"
    proc = None
    # Ansible's SSH multiplexers must not outlive the target by long.
    ssh_args_before = os.environ.get("ANSIBLE_SSH_ARGS")
    os.environ["ANSIBLE_SSH_ARGS"] = "-C -o ControlMaster=auto -o ControlPersist=5s"
    try:
        etc_ssh = merged / "etc" / "ssh"
        _sh(
            "ssh-keygen",
            "-q",
            "-t",
            "ed25519",
            "-N",
            "",
            "-f",
            str(etc_ssh / "ssh_host_ed25519_key"),
        )
        admin_key = work / "admin_ed25519"
        _sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", "test-admin", "-f", str(admin_key))
        daemon_key = work / "daemon_ed25519"
        _sh(
            "ssh-keygen",
            "-q",
            "-t",
            "ed25519",
            "-N",
            "",
            "-C",
            "trainyard@test-daemon",
            "-f",
            str(daemon_key),
        )
        root_ssh = merged / "root" / ".ssh"
        root_ssh.mkdir(mode=0o700, exist_ok=True)
        (root_ssh / "authorized_keys").write_text((work / "admin_ed25519.pub").read_text())
        (root_ssh / "authorized_keys").chmod(0o600)
        (etc_ssh / "sshd_trainyard_test").write_text(
            f"ListenAddress {ns_ip}\nPort 22\nHostKey /etc/ssh/ssh_host_ed25519_key\n"
            "PermitRootLogin prohibit-password\nPasswordAuthentication no\nKbdInteractiveAuthentication no\n"
            "UsePAM no\nPidFile /run/sshd-test.pid\nSubsystem sftp internal-sftp\nLogLevel ERROR\n"
        )
        (merged / "run" / "sshd").mkdir(parents=True, exist_ok=True)
        host_pub = (etc_ssh / "ssh_host_ed25519_key.pub").read_text().split()
        known_hosts = work / "known_hosts"
        known_hosts.write_text(f"{ns_ip} {host_pub[0]} {host_pub[1]}\n")

        _sh("ip", "netns", "add", netns)
        _sh("ip", "link", "add", host_if, "type", "veth", "peer", "name", ns_if)
        _sh("ip", "link", "set", ns_if, "netns", netns)
        _sh("ip", "addr", "add", f"{host_ip}/30", "dev", host_if)
        _sh("ip", "link", "set", host_if, "up")
        _sh("ip", "netns", "exec", netns, "ip", "addr", "add", f"{ns_ip}/30", "dev", ns_if)
        _sh("ip", "netns", "exec", netns, "ip", "link", "set", ns_if, "up")
        _sh("ip", "netns", "exec", netns, "ip", "link", "set", "lo", "up")
        # Own mount namespace: /proc and /dev exist only for the target and vanish with it.
        script = (
            f"mount -t proc proc {merged}/proc && mount --rbind /dev {merged}/dev && "
            f"exec chroot {merged} /usr/sbin/sshd -D -e -f /etc/ssh/sshd_trainyard_test"
        )
        proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                netns,
                "unshare",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
                script,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        _wait_for_port(ns_ip, 22, proc)
        yield Target(
            root=merged,
            address=ns_ip,
            port=22,
            user="root",
            private_key=admin_key,
            known_hosts=known_hosts,
            public_key=(work / "daemon_ed25519.pub").read_text().strip(),
        )
    finally:
        if proc is not None and proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
                proc.wait(timeout=10)
        # Session processes sshd forked for Ansible live in the namespace: end them with it.
        pids = subprocess.run(
            ["ip", "netns", "pids", netns], capture_output=True, text=True
        ).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), 9)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "netns", "del", netns], capture_output=True)
        if ssh_args_before is None:
            os.environ.pop("ANSIBLE_SSH_ARGS", None)
        else:
            os.environ["ANSIBLE_SSH_ARGS"] = ssh_args_before
        subprocess.run(["ip", "link", "del", host_if], capture_output=True)
        if subprocess.run(["umount", str(merged)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(merged)], capture_output=True)
