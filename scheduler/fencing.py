"""Job fencing on a node: one cgroup per job for memory, CPUs, pids and the GPUs it may open.

Part of the agent's bundle (standard library, Python 3.8). Two kinds of node:

- cgroup v1 (the memory, cpu, pids, devices and freezer controllers, each its own hierarchy;
  Slurm's ConstrainDevices way): a cgroup per controller, GPUs denied in `devices.deny`.
- cgroup v2 (one unified hierarchy: Ubuntu 22.04+, RHEL 9 and most current GPU nodes): one
  cgroup per job under `<cgroup2 mount>/trainyard/<node>`, outside the agent's own (a login
  session's scope ends with its session; Docker's cgroupfs driver keeps its containers beside
  systemd's the same way), with `memory.max`, `memory.swap.max`, `cpu.max` and `pids.max`.
  v2 has no devices controller: the GPUs the job may not open are denied by an eBPF program of
  type BPF_PROG_TYPE_CGROUP_DEVICE attached to the job's cgroup (what runc and systemd's
  DeviceAllow= do), built here from raw instructions (a dozen, no compiler or library). The
  freeze (`cgroup.freeze`) and `cgroup.kill` replace v1's freezer.

On a node where something is missing `mode()` says in words what, so the operator sees a node
that cannot fence, or fences only part of a job.

Several nodes may share one cgroup tree and one PID space (test machines, containers): job
cgroups are named `trainyard/<node>/<key>`, their paths are recorded in the job's spec, and
only those recorded paths are ever signalled or removed. Nothing is killed by guessing.
"""

from __future__ import annotations

import contextlib
import errno
import glob
import os
import re
import signal
import struct
import time

V1_CONTROLLERS = ("memory", "cpu", "pids", "devices", "freezer")
V2_CONTROLLERS = ("memory", "cpu", "pids")  # the devices fence is an eBPF program there
FENCES = ("devices", "memory", "cpu", "pids")
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


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


# ------------------------------------------------------------------ eBPF device programs (v2)
# ctypes and platform are imported where used: the agent loads programs, the job supervisors
# (copies of the zygote, which imports this module) never do
_SYS_BPF = {"x86_64": 321, "amd64": 321, "aarch64": 280, "arm64": 280, "ppc64le": 361,
            "s390x": 351}
_BPF_PROG_LOAD, _BPF_PROG_ATTACH = 5, 8
_BPF_PROG_TYPE_CGROUP_DEVICE, _BPF_CGROUP_DEVICE = 15, 6
_BPF_F_ALLOW_MULTI = 2  # beside a program an ancestor has (systemd's), never replacing it
_BPF_DEVCG_DEV_CHAR = 2
_ATTR_SIZE = 128  # zero-filled past what is set: the kernel accepts a larger union so


def _insn(code: int, dst: int = 0, src: int = 0, off: int = 0, imm: int = 0) -> bytes:
    return struct.pack("<BBhi", code, (src << 4) | dst, off, imm)


def device_program(deny: list) -> bytes:
    """The instructions of a cgroup device program that refuses every access (read, write,
    mknod) to the character devices `deny` ((major, minor) pairs) and allows all else.

    Its context is struct bpf_cgroup_dev_ctx {u32 access_type (access << 16 | type); u32 major;
    u32 minor}; it returns 1 to allow, 0 to refuse (the open fails with EPERM, as with v1's
    devices.deny)."""
    n = len(deny)
    prog = [_insn(0x61, 2, 1, 0),             # r2 = ctx->access_type
            _insn(0x57, 2, 0, 0, 0xFFFF),     # r2 &= 0xffff: the device's type
            _insn(0x61, 3, 1, 4),             # r3 = ctx->major
            _insn(0x61, 4, 1, 8),             # r4 = ctx->minor
            _insn(0x55, 2, 0, 2 * n, _BPF_DEVCG_DEV_CHAR)]  # not a char device: allow
    for k, (major, minor) in enumerate(deny):
        prog.append(_insn(0x55, 3, 0, 1, major))            # another major: the next pair
        prog.append(_insn(0x15, 4, 0, 2 * (n - k), minor))  # this one: refuse
    prog += [_insn(0xB7, 0, 0, 0, 1), _insn(0x95),          # allow: r0 = 1; exit
             _insn(0xB7, 0, 0, 0, 0), _insn(0x95)]          # refuse: r0 = 0; exit
    return b"".join(prog)


def _bpf(cmd: int, attr: bytes) -> int:
    import ctypes
    import platform

    number = _SYS_BPF.get(platform.machine().lower())
    if number is None:
        raise OSError(errno.ENOSYS, f"no bpf system call number known for {platform.machine()}")
    libc = ctypes.CDLL(None, use_errno=True)
    buf = ctypes.create_string_buffer(attr, _ATTR_SIZE)
    ret = libc.syscall(number, cmd, buf, _ATTR_SIZE)
    if ret < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return ret


def _load_device_program(deny: list) -> int:
    """A loaded device program's file descriptor; OSError (with the verifier's words, where it
    said any) when the kernel refuses it."""
    import ctypes

    code = ctypes.create_string_buffer(device_program(deny))
    license_ = ctypes.create_string_buffer(b"GPL")
    count = len(code.raw) // 8

    def attr(log_level: int, log) -> bytes:
        return struct.pack("<IIQQIIQII16s", _BPF_PROG_TYPE_CGROUP_DEVICE, count,
                           ctypes.addressof(code), ctypes.addressof(license_), log_level,
                           len(log) if log is not None else 0,
                           ctypes.addressof(log) if log is not None else 0, 0, 0, b"trainyard_dev")
    try:
        return _bpf(_BPF_PROG_LOAD, attr(0, None))
    except OSError as e:
        if e.errno != errno.EINVAL and e.errno != errno.EACCES:
            raise
        log = ctypes.create_string_buffer(16384)
        try:
            return _bpf(_BPF_PROG_LOAD, attr(1, log))
        except OSError as again:
            words = log.value.decode(errors="replace").strip().splitlines()
            raise OSError(again.errno, f"{again.strerror}: {words[-1] if words else 'no verifier log'}") \
                from None


def attach_device_program(cgroup: str, deny: list) -> None:
    """Refuse the devices `deny` to every process in `cgroup` (a cgroup v2 directory), from now
    until the cgroup is removed (it holds the program)."""
    prog = _load_device_program(deny)
    try:
        fd = os.open(cgroup, os.O_RDONLY | os.O_DIRECTORY)
        try:
            _bpf(_BPF_PROG_ATTACH, struct.pack("<IIII", fd, prog, _BPF_CGROUP_DEVICE,
                                               _BPF_F_ALLOW_MULTI))
        finally:
            os.close(fd)
    finally:
        os.close(prog)


def device_programs_work() -> str:
    """"" when this kernel loads a cgroup device program (as the agent, root, will for each
    job); else why not, in words."""
    try:
        os.close(_load_device_program([(NVIDIA_MAJOR, 0)]))
    except OSError as e:
        return f"the kernel refused an eBPF device program ({e.strerror})"
    return ""


class Fencing:
    """How this node fences jobs, and the cgroups of each job."""

    def __init__(self, node: str, enabled: bool, why_not: str = "",
                 pids_max: int = DEFAULT_PIDS_MAX):
        self.node = re.sub(r"[^A-Za-z0-9_.-]", "_", node) or "node"
        self.pids_max = pids_max
        self.bases: dict = {}   # v1: controller -> the directory that holds this node's job cgroups
        self.base = ""          # v2: the directory that holds this node's job cgroups
        self.fences: set = set()  # which of FENCES this node applies
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
            self.fences = set(FENCES) & set(v1)
            missing = [c for c in V1_CONTROLLERS if c not in v1]
            if missing:
                self.reason = f"cgroup v1 without the {', '.join(missing)} controller(s)"
        elif "unified" in mounts:
            self.version = "v2"
            self._set_up_v2(mounts["unified"])
        else:
            self.reason = "no cgroup file system is mounted: jobs cannot be fenced"

    def _set_up_v2(self, mount: str) -> None:
        """Make `<mount>/trainyard/<node>` with the controllers this kernel offers enabled for
        the job cgroups below it; say what is missing."""
        top = os.path.join(mount, "trainyard")
        base = os.path.join(top, self.node)
        try:
            os.makedirs(base, exist_ok=True)
        except OSError as e:
            self.reason = f"cgroup v2: cannot make {base} ({e.strerror}): jobs run unfenced"
            return
        self.base = base
        offered = set(_read(os.path.join(mount, "cgroup.controllers")).split())
        why = []
        enabled = [c for c in V2_CONTROLLERS if c in offered]
        missing = [c for c in V2_CONTROLLERS if c not in offered]
        if missing:
            why.append(f"cgroup v2 without the {', '.join(missing)} controller(s) "
                       f"({os.path.join(mount, 'cgroup.controllers')} offers "
                       f"{' '.join(sorted(offered)) or 'none'})")
        for level in (mount, top, base):  # each parent hands the controllers down to its children
            ctl = os.path.join(level, "cgroup.subtree_control")
            need = [c for c in enabled if c not in _read(ctl).split()]
            if not need:
                continue
            try:
                _write(ctl, " ".join(f"+{c}" for c in need))
            except FencingError:  # which one: each on its own
                for c in need:
                    try:
                        _write(ctl, f"+{c}")
                    except FencingError as e:
                        enabled.remove(c)
                        why.append(f"the {c} controller cannot be enabled for job cgroups: {e}")
        self.fences = set(enabled)
        refused = device_programs_work()
        if refused:
            why.append(f"{refused}: GPUs are not fenced")
        else:
            self.fences.add("devices")
        self.reason = "; ".join(why)

    def mode(self) -> dict:
        """For hello: which fences this node applies, and in words why any is missing."""
        return {"cgroup": self.version, **{f: f in self.fences for f in FENCES},
                "reason": self.reason}

    @property
    def active(self) -> bool:
        return bool(self.bases or self.base)

    def denied_gpus(self, gpus: list) -> list:
        """(major, minor) of every GPU device on this node that is not one of `gpus`."""
        allowed = {int(g) for g in gpus or []}
        return [dev for index, dev in sorted(gpu_devices().items()) if index not in allowed]

    def create(self, key: str, gpus: list, cpus, mem_mb) -> list:
        """Make the job's cgroups with its limits; returns their paths (record them)."""
        if self.base:
            return [self._create_v2(key, gpus, cpus, mem_mb)]
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
                    for major, minor in self.denied_gpus(gpus):
                        _write(os.path.join(path, "devices.deny"), f"c {major}:{minor} rwm")
        except OSError as e:
            remove(made)
            raise FencingError(f"cannot create the job's cgroup: {e}") from None
        except FencingError:
            remove(made)
            raise
        return made

    def _create_v2(self, key: str, gpus: list, cpus, mem_mb) -> str:
        path = os.path.join(self.base, key)
        try:
            os.makedirs(path, exist_ok=True)
            if _read(os.path.join(path, "cgroup.freeze")).strip() == "1":
                _write(os.path.join(path, "cgroup.freeze"), "0")  # left frozen by a dead agent
            if "memory" in self.fences and mem_mb:
                _write(os.path.join(path, "memory.max"), str(int(mem_mb) * 2**20))
                if os.path.exists(os.path.join(path, "memory.swap.max")):  # no escape into swap
                    _write(os.path.join(path, "memory.swap.max"), "0")
            if "cpu" in self.fences and cpus:
                _write(os.path.join(path, "cpu.max"), f"{int(cpus) * CFS_PERIOD_US} {CFS_PERIOD_US}")
            if "pids" in self.fences and self.pids_max:
                _write(os.path.join(path, "pids.max"), str(self.pids_max))
            if "devices" in self.fences:
                deny = self.denied_gpus(gpus)
                if deny:
                    try:
                        attach_device_program(path, deny)
                    except OSError as e:
                        raise FencingError(f"cannot fence the job's GPUs in {path}: the kernel "
                                           f"refused its device program ({e.strerror})") from None
        except OSError as e:
            remove([path])
            raise FencingError(f"cannot create the job's cgroup: {e}") from None
        except FencingError:
            remove([path])
            raise
        return path


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


# (the file that freezes the cgroup, its frozen and thawed values, the file and the line that
# say it is frozen): v1's freezer controller, v2's core
_FREEZERS = (("freezer.state", "FROZEN", "THAWED", "freezer.state", "FROZEN"),
             ("cgroup.freeze", "1", "0", "cgroup.events", "frozen 1"))


def _freezer(paths: list) -> tuple:
    """(the job's cgroup that can be frozen, how), or (None, None)."""
    for path in paths:
        for how in _FREEZERS:
            if os.path.exists(os.path.join(path, how[0])):
                return path, how
    return None, None


def _freeze(path: str, how: tuple, frozen: bool) -> None:
    ctl, on, off, state, done = how
    _write(os.path.join(path, ctl), on if frozen else off)
    deadline = time.monotonic() + 1.0
    while frozen and time.monotonic() < deadline:
        if done in _read(os.path.join(path, state)).splitlines():
            break
        time.sleep(0.005)


def signal_all(paths: list, sig: int) -> int:
    """Signal every process of the job, also those that called setsid or double-forked.

    The cgroup is frozen first (v1's freezer, v2's cgroup.freeze) so that no process forks past
    the signal; on v2, SIGKILL is the kernel's own `cgroup.kill`, which nothing can outrun."""
    kill = [os.path.join(p, "cgroup.kill") for p in paths] if sig == signal.SIGKILL else []
    for ctl in filter(os.path.exists, kill):
        with contextlib.suppress(FencingError):
            _write(ctl, "1")
    freezer, how = _freezer(paths)
    if freezer:
        try:
            _freeze(freezer, how, True)
        except FencingError:
            freezer = None
    sent = 0
    try:
        for pid in procs(paths):
            try:
                os.kill(pid, sig)
                sent += 1
            except ProcessLookupError:
                pass
    finally:
        if freezer:
            with contextlib.suppress(FencingError):
                _freeze(freezer, how, False)
    return sent


def oom_killed(paths: list) -> bool:
    """Whether the kernel's OOM killer ended a process of this job (its memory cgroup: v1's
    memory.oom_control, v2's memory.events)."""
    for path in paths:
        for name in ("memory.oom_control", "memory.events"):
            for line in _read(os.path.join(path, name)).splitlines():
                field, _, value = line.partition(" ")
                if field == "oom_kill" and value.strip().isdigit() and int(value) > 0:
                    return True
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
