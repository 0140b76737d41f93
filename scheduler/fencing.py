"""Job fencing on a node: one cgroup per job for memory, CPUs, pids and the GPUs it may open.

Part of the agent's bundle (standard library, Python 3.8). Implemented for cgroup v1 (the
memory, cpu, pids, devices and freezer controllers, Slurm's ConstrainDevices way); on other
nodes `mode()` says in words what is missing, so the operator sees a node that cannot fence.

Several nodes may share one cgroup tree and one PID space (test machines, containers): job
cgroups are named `trainyard/<node>/<key>`, their paths are recorded in the job's spec, and
only those recorded paths are ever signalled or removed. Nothing is killed by guessing.
"""

from __future__ import annotations

import errno
import glob
import os
import re
import signal
import time

V1_CONTROLLERS = ("memory", "cpu", "pids", "devices", "freezer")
CFS_PERIOD_US = 100_000
DEFAULT_PIDS_MAX = 8192
NVIDIA_MAJOR = 195
# cgroup v1 mount options that name no hierarchy
_MOUNT_OPTIONS = frozenset({"rw", "ro", "xattr", "noprefix", "clone_children", "cpuset_v2_mode"})


class FencingError(Exception):
    """A job's cgroup could not be made; the message says which file refused what."""


def cgroup_mounts() -> dict:
    """cgroup v1 controller (and named hierarchy, `name=systemd`) -> its mount point, and
    "unified" -> the cgroup2 mount (if any), from /proc/self/mountinfo."""
    out: dict = {}
    try:
        with open("/proc/self/mountinfo") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        fields, rfields = left.split(), right.split()
        if len(fields) < 5 or len(rfields) < 3:
            continue
        point, fstype, opts = fields[4], rfields[0], rfields[2].split(",")
        if fstype == "cgroup2":
            out.setdefault("unified", point)
        elif fstype == "cgroup":
            for c in opts:
                if c not in _MOUNT_OPTIONS and ("=" not in c or c.startswith("name=")):
                    out.setdefault(c, point)
    return out


def own_cgroup_paths() -> dict:
    """controller -> this process's cgroup path in that hierarchy ("unified" for cgroup2),
    from /proc/self/cgroup."""
    out = {}
    try:
        with open("/proc/self/cgroup") as f:
            for line in f:
                _, ctrls, path = line.rstrip("\n").split(":", 2)
                for c in ctrls.split(","):
                    out[c or "unified"] = path
    except (OSError, ValueError):
        pass
    return out


def gpu_devices(dev: str = "/dev") -> dict:
    """GPU index N -> (major, minor) of /dev/nvidiaN, for every NVIDIA GPU device file."""
    out = {}
    for path in glob.glob(os.path.join(dev, "nvidia[0-9]*")):
        m = re.fullmatch(r"nvidia(\d+)", os.path.basename(path))
        if not m:
            continue
        try:
            st = os.stat(path)
        except OSError:
            continue
        out[int(m.group(1))] = (os.major(st.st_rdev), os.minor(st.st_rdev))
    return out


def _write(path: str, value: str) -> None:
    try:
        with open(path, "w") as f:
            f.write(value)
    except OSError as e:
        raise FencingError(f"cannot write {value!r} to {path}: {e.strerror}") from None


class Fencing:
    """How this node fences jobs, and the cgroups of each job."""

    def __init__(self, node: str, enabled: bool, why_not: str = "",
                 pids_max: int = DEFAULT_PIDS_MAX):
        self.node = re.sub(r"[^A-Za-z0-9_.-]", "_", node) or "node"
        self.pids_max = pids_max
        self.bases: dict = {}   # controller -> the directory that holds this node's job cgroups
        self.version = "none"
        self.reason = "" if enabled else why_not
        if not enabled:
            return
        mounts, own = cgroup_mounts(), own_cgroup_paths()
        v1 = {c: mounts[c] for c in V1_CONTROLLERS if c in mounts}
        if v1:
            self.version = "v1"
            for c, point in v1.items():
                self.bases[c] = os.path.join(point, own.get(c, "/").lstrip("/"), "trainyard",
                                             self.node)
            missing = [c for c in V1_CONTROLLERS if c not in v1]
            if missing:
                self.reason = f"cgroup v1 without the {', '.join(missing)} controller(s)"
        elif "unified" in mounts:
            self.version = "v2"
            self.reason = ("cgroup v2: job fencing is implemented for cgroup v1 only; jobs run "
                           "without memory, CPU or device limits here")
        else:
            self.reason = "no cgroup file system is mounted: jobs cannot be fenced"

    def mode(self) -> dict:
        """For hello: which fences this node applies, and in words why any is missing."""
        has = set(self.bases)
        return {"cgroup": self.version, "devices": "devices" in has, "memory": "memory" in has,
                "cpu": "cpu" in has, "pids": "pids" in has, "reason": self.reason}

    @property
    def active(self) -> bool:
        return bool(self.bases)

    def create(self, key: str, gpus: list, cpus, mem_mb) -> list:
        """Make the job's cgroups with its limits; returns their paths (record them)."""
        made = []
        try:
            for c, base in self.bases.items():
                path = os.path.join(base, key)
                os.makedirs(path, exist_ok=True)
                made.append(path)
                state = os.path.join(path, "freezer.state")
                if c == "freezer" and os.path.exists(state):
                    # a cgroup of this name left frozen (its agent died between freezing and
                    # thawing it): a new process joining it would never run
                    _write(state, "THAWED")
                if c == "memory" and mem_mb:
                    limit = str(int(mem_mb) * 2**20)
                    _write(os.path.join(path, "memory.limit_in_bytes"), limit)
                    memsw = os.path.join(path, "memory.memsw.limit_in_bytes")
                    if os.path.exists(memsw):  # no escape into swap
                        _write(memsw, limit)
                elif c == "cpu" and cpus:
                    _write(os.path.join(path, "cpu.cfs_period_us"), str(CFS_PERIOD_US))
                    _write(os.path.join(path, "cpu.cfs_quota_us"), str(int(cpus) * CFS_PERIOD_US))
                elif c == "pids" and self.pids_max:
                    _write(os.path.join(path, "pids.max"), str(self.pids_max))
                elif c == "devices":
                    allowed = {int(g) for g in gpus or []}
                    for index, (major, minor) in sorted(gpu_devices().items()):
                        if index not in allowed:
                            _write(os.path.join(path, "devices.deny"), f"c {major}:{minor} rwm")
        except OSError as e:
            remove(made)
            raise FencingError(f"cannot create the job's cgroup: {e}") from None
        except FencingError:
            remove(made)
            raise
        return made


def join(paths: list, pid: int = 0) -> None:
    """Move a process (default: this one) into every cgroup of a job."""
    for path in paths:
        _write(os.path.join(path, "cgroup.procs"), str(pid or os.getpid()))


def procs(paths: list) -> set:
    """Every process in the job's cgroups."""
    out: set = set()
    for path in paths:
        try:
            with open(os.path.join(path, "cgroup.procs")) as f:
                out.update(int(p) for p in f.read().split())
        except (OSError, ValueError):
            continue
    return out


def _freezer(paths: list):
    return next((p for p in paths if os.path.exists(os.path.join(p, "freezer.state"))), None)


def signal_all(paths: list, sig: int) -> int:
    """Signal every process of the job, also those that called setsid or double-forked.

    With the freezer, the cgroup is frozen first so that no process forks past the signal."""
    frozen = _freezer(paths)
    if frozen:
        state = os.path.join(frozen, "freezer.state")
        try:
            _write(state, "FROZEN")
            deadline = time.monotonic() + 1.0
            while time.monotonic() < deadline:
                with open(state) as f:
                    if f.read().strip() == "FROZEN":
                        break
                time.sleep(0.005)
        except (OSError, FencingError):
            frozen = None
    sent = 0
    try:
        for pid in procs(paths):
            try:
                os.kill(pid, sig)
                sent += 1
            except ProcessLookupError:
                pass
    finally:
        if frozen:
            try:
                _write(os.path.join(frozen, "freezer.state"), "THAWED")
            except FencingError:
                pass
    return sent


def oom_killed(paths: list) -> bool:
    """Whether the kernel's OOM killer ended a process of this job (its memory cgroup)."""
    for path in paths:
        ctl = os.path.join(path, "memory.oom_control")
        try:
            with open(ctl) as f:
                for line in f:
                    name, _, value = line.partition(" ")
                    if name == "oom_kill" and int(value) > 0:
                        return True
        except (OSError, ValueError):
            continue
    return False


def remove(paths: list, timeout: float = 2.0) -> None:
    """End whatever still runs in the job's cgroups, then remove them (only these paths)."""
    deadline = time.monotonic() + timeout
    while procs(paths) and time.monotonic() < deadline:
        signal_all(paths, signal.SIGKILL)
        time.sleep(0.02)
    for path in paths:
        try:
            os.rmdir(path)
        except OSError as e:
            if e.errno not in (errno.ENOENT,):
                continue
