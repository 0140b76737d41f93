"""Container start time on a real node (root sshd in a mount namespace, podman with runc): the
time from launch to exit of `true` bare and in a cached image, and of the first (pulling) job.
Bare and cached runs alternate, so both see the same load. Prints its figures. Needs root,
sshd, podman, runc, docker-registry and busybox-static."""

from __future__ import annotations

import os
import pwd
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from _harness import discard  # noqa: E402

from scheduler import nodes as node_links  # noqa: E402
from tests.nodes.conftest import TEST_BASE, Link, Node  # noqa: E402
from tests.nodes.registry import Registry, build_image, missing, podman_config, use_podman_config  # noqa: E402

RUNS = 10


def timed_job(link: Link, key: str, **launch) -> float:
    t0 = time.perf_counter()
    link.send(op="launch", key=key, job_id=int(key.split(".")[0]), user="alice",
              argv=["true"], **launch)
    end = link.wait_for("exited", key, timeout=120)
    elapsed = time.perf_counter() - t0
    assert end["rc"] == 0, link.request(op="log", key=key)["data"]
    return elapsed


def spread(samples: list[float]) -> str:
    """median, quartiles and range of seconds, in milliseconds."""
    q1, median, q3 = (x * 1000 for x in statistics.quantiles(samples, n=4))
    return (f"median {statistics.median(samples) * 1000:.0f} ms (quartiles {q1:.0f}-{q3:.0f}, "
            f"range {min(samples) * 1000:.0f}-{max(samples) * 1000:.0f}; n={len(samples)})")


def main() -> int:
    lacking = missing()
    if os.geteuid() != 0 or lacking:
        print(f"skipped: needs root and {lacking or 'nothing else'}")
        return 0
    if "containers" not in node_links.BUNDLE_MODULES:
        node_links.BUNDLE_MODULES += ("containers",)
    made_user = False
    try:
        pwd.getpwnam("alice")
    except KeyError:
        subprocess.run(["useradd", "-m", "-s", "/bin/sh", "alice"], check=True)
        made_user = True
    TEST_BASE.mkdir(mode=0o755, exist_ok=True)
    base = Path(tempfile.mkdtemp(prefix="bench-", dir=TEST_BASE))
    os.chmod(base, 0o755)
    registry = node = link = None
    try:
        key = base / "id_ed25519"
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(key)], check=True)
        home = base / "home"
        home.mkdir(mode=0o700)
        registry = Registry(base, "registry", base / "registry-data")
        image = f"{registry.address}/tiny:1"
        build_image(base / "builder", podman_config(base / "builder", [registry.address], base / "builder" / "run"), image)
        node = Node(base, "n1", (base / "id_ed25519.pub").read_text(), home).start()
        use_podman_config(node, podman_config(node.dir / "podman", [registry.address]))
        link = Link(node, key, base)
        link.wait_up(60)
        timed_job(link, "1.0")  # warm the node's Python and page cache
        load_before = os.getloadavg()
        cold = timed_job(link, "2.0", image=image)
        pulled = registry.requests("tiny")
        bare, cached = [], []
        for i in range(RUNS):  # alternate, so that both kinds see the same load
            bare.append(timed_job(link, f"{100 + i}.0"))
            cached.append(timed_job(link, f"{200 + i}.0", image=image))
        load_after = os.getloadavg()
        added = [c - b for b, c in zip(bare, cached, strict=True)]
        version = subprocess.run(["podman", "--version"], capture_output=True, text=True).stdout
        print(f"machine: {os.cpu_count()} CPUs, load average (1 min) {load_before[0]:.2f} before, "
              f"{load_after[0]:.2f} after; podman {version.split()[-1] if version else '?'}, "
              "runc, vfs storage, a busybox image")
        print(f"bare job (launch -> exit of `true`): {spread(bare)}")
        print(f"first container job (pull from a loopback registry): {cold * 1000:.0f} ms")
        print(f"container job, image cached: {spread(cached)}")
        print(f"added by the container (cached minus the bare run beside it): {spread(added)}")
        print(f"registry requests by the {RUNS} cached jobs: "
              f"{registry.requests('tiny') - pulled}")
    finally:
        if link:
            link.close()
        if node:
            node.stop()
        if registry:
            registry.stop()
        discard(base)
        if made_user:
            subprocess.run(["userdel", "-r", "alice"], capture_output=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
