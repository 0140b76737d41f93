"""The node agent: launches jobs detached, reports their exits and the node's GPUs, over JSON lines.

Runs on the node under `python3`, uploaded by the daemon over SFTP (DESIGN.md boundary 3).
Standard library only; pynvml is used when the node has it. The daemon writes one JSON object
per line on stdin (`launch`, `signal`, `sync`, `forget`, `log`, `watch`, `ping`, and `fault` for
the demo's simulated GPUs); the agent answers on stdout (`hello`, `started`, `exited`, `jobs`,
`log`, `pong`, `telemetry`, `fault`, `error`). GPU telemetry and its fields: docs/gpu.md.

Every job runs under a small sh wrapper in its own session, so it survives
the agent, the SSH link and the daemon. The wrapper writes the job's exit status atomically
to `<agent_dir>/jobs/<key>/rc`; whoever asks later reads it from there.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time

PROTOCOL = 1
SIGNALS = {"TERM": signal.SIGTERM, "KILL": signal.SIGKILL, "INT": signal.SIGINT,
           "USR1": signal.SIGUSR1, "HUP": signal.SIGHUP}


# ---------------------------------------------------------------- the wrapper (own session)

# The wrapper is a tiny sh script in its own session. `setsid` (util-linux) puts the job in a
# session and process group of its own whose id is the job's pid, so signals reach the job
# and its children but never the wrapper, which waits and records the exit status.
WRAPPER = """echo $$ > wpid
setsid "$@" >>log 2>&1 </dev/null &
pid=$!
echo $pid > pid.tmp && mv pid.tmp pid
wait $pid
echo $? > rc.tmp && mv rc.tmp rc
"""


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------- GPUs

# Every key a GPU's telemetry carries, whatever the source; a field the driver (or the source)
# cannot tell is present with the value None, never left out and never a crash.
GPU_FIELDS = (
    "index", "name", "uuid", "pci_bus_id", "util_gpu", "util_mem", "mem_total_mb", "mem_used_mb",
    "temp_c", "power_w", "power_limit_w", "sm_clock_mhz",
    "ecc_sbe_volatile", "ecc_dbe_volatile", "ecc_sbe_aggregate", "ecc_dbe_aggregate", "ecc_dbe",
    "remap_correctable", "remap_uncorrectable", "remap_pending", "remap_failure",
    "xid", "xid_events", "off_bus", "mig_mode", "mig_instances", "processes", "job_id",
)
NVML_LOST = 15       # NVML_ERROR_GPU_IS_LOST: the GPU fell off the bus
NVML_NOT_FOUND = 6   # NVML_ERROR_NOT_FOUND
NVML_TIMEOUT = 10    # NVML_ERROR_TIMEOUT: no event waiting
NVML_GPU_NOT_FOUND = 28
XID_EVENT = 0x8      # nvmlEventTypeXidCriticalError
FAULT_KINDS = ("xid", "ecc_dbe", "temp", "off_bus", "clear")


class GpuLost(Exception):
    """NVML said NVML_ERROR_GPU_IS_LOST for this GPU."""


def _nvml_code(e: BaseException):
    return getattr(e, "value", None)


def _text(v):
    return v.decode() if isinstance(v, bytes) else v


def _blank(i: int, name) -> dict:
    g = dict.fromkeys(GPU_FIELDS)
    g["index"], g["name"] = i, name
    return g


def _proc_ids(pid: int):
    """(process group, session) of a process, from /proc/<pid>/stat; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return int(fields[2]), int(fields[3])
    except (OSError, ValueError, IndexError):
        return None


def job_of_pid(pid: int, job_pids: dict) -> object:
    """The trainyard job a process belongs to: its group or session leader is a job's pid."""
    if pid in job_pids:
        return job_pids[pid]
    ids = _proc_ids(pid)
    if ids is None:
        return None
    for leader in ids:
        if leader in job_pids:
            return job_pids[leader]
    return None


class Gpus:
    """The node's GPUs: NVML when present, simulated in the demo, else what was declared.

    `source` is "nvml", "simulated", "declared" or "none"; `note` says in words why (for
    example why NVML was not used), and goes to the daemon in `hello`.
    """

    def __init__(self, declared: int, declared_model: str, nvml=None):
        self.source = "none"
        self.note = ""
        self.nvml = None
        self.count = 0
        self.model = declared_model
        self.handles: list = []
        self.names: list = []
        self.event_sets: dict[int, object] = {}   # GPU index -> its NVML event set (XIDs)
        self.last_xid: dict[int, int] = {}
        self.faults: dict[int, dict] = {}         # simulated GPUs only: injected faults
        sim = os.environ.get("TRAINYARD_SIM_GPUS")
        if sim:
            self.source, self.count = "simulated", int(sim)
            self.model = os.environ.get("TRAINYARD_SIM_GPU_MODEL", "NVIDIA H100 80GB HBM3")
            self.note = f"{self.count} simulated GPUs (TRAINYARD_SIM_GPUS)"
            return
        why = self._init_nvml(nvml)
        if self.source == "nvml":
            return
        if declared:
            self.source, self.count = "declared", declared
            self.note = f"{why}; using the {declared} GPUs declared for this node (no telemetry)"
        else:
            self.note = f"{why}; no GPUs declared for this node"

    # --- NVML
    def _init_nvml(self, nvml) -> str:
        """Start NVML; on failure say why in words (the node then falls back)."""
        try:
            if nvml is None:
                import pynvml as nvml  # noqa: PLC0415
        except ImportError:
            return "pynvml (nvidia-ml-py) is not installed"
        try:
            nvml.nvmlInit()
        except Exception as e:  # NVMLError_LibraryNotFound, DriverNotLoaded, ...
            return f"NVML unavailable: {e}"
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except Exception as e:
            return f"NVML could not count the GPUs: {e}"
        self.nvml, self.source, self.count = nvml, "nvml", count
        for i in range(count):
            h = self._call(lambda i=i: nvml.nvmlDeviceGetHandleByIndex(i))
            self.handles.append(h)
            name = self._call(lambda h=h: _text(nvml.nvmlDeviceGetName(h))) if h is not None else None
            self.names.append(name)
            if h is not None:
                self._register_xid_events(i, h)
        named = [n for n in self.names if n]
        if named:
            self.model = named[0]
        driver = self._call(lambda: _text(nvml.nvmlSystemGetDriverVersion()))
        self.note = f"{count} GPUs from NVML" + (f" (driver {driver})" if driver else "")
        return ""

    @staticmethod
    def _call(fn):
        try:
            return fn()
        except Exception:
            return None

    def _register_xid_events(self, i: int, h) -> None:
        """One event set per GPU, so every XID is known to belong to that GPU."""
        n = self.nvml
        try:
            supported = n.nvmlDeviceGetSupportedEventTypes(h)
            xid = getattr(n, "nvmlEventTypeXidCriticalError", XID_EVENT)
            if not supported & xid:
                return
            es = n.nvmlEventSetCreate()
            n.nvmlDeviceRegisterEvents(h, xid, es)
            self.event_sets[i] = es
        except Exception:  # no event support (or no permission): XIDs are reported missing
            return

    def _poll_xids(self, i: int) -> list:
        """XID codes that arrived since the last poll, without blocking (timeout 0)."""
        es = self.event_sets.get(i)
        if es is None:
            return []
        n, codes = self.nvml, []
        xid = getattr(n, "nvmlEventTypeXidCriticalError", XID_EVENT)
        for _ in range(256):
            try:
                data = n.nvmlEventSetWait_v2(es, 0)
            except Exception as e:
                if _nvml_code(e) == NVML_LOST:
                    raise GpuLost() from e
                break  # NVML_ERROR_TIMEOUT: nothing waiting (or the set broke: try again next time)
            if data.eventType & xid:
                codes.append(int(data.eventData))
        return codes

    def _handle(self, i: int):
        h = self.handles[i] if i < len(self.handles) else None
        if h is None:  # not found at start, or lost: ask again (a reset GPU may be back)
            h = self.nvml.nvmlDeviceGetHandleByIndex(i)
            self.handles[i] = h
            if i not in self.event_sets:
                self._register_xid_events(i, h)
        return h

    def _nvml_gpu(self, i: int, job, job_pids: dict) -> dict:
        n = self.nvml
        g = _blank(i, self.names[i] if i < len(self.names) else None)
        g["job_id"] = job
        g["off_bus"] = False
        try:
            h = self._handle(i)
        except Exception as e:
            code = _nvml_code(e)
            if code in (NVML_LOST, NVML_NOT_FOUND, NVML_GPU_NOT_FOUND):
                g["off_bus"] = True
            g["xid"] = self.last_xid.get(i)
            g["xid_events"] = []
            return g

        def guard(key, fn):
            """Run one NVML query; a field the driver does not support is reported missing."""
            try:
                g[key] = fn()
            except Exception as e:
                if _nvml_code(e) == NVML_LOST:
                    raise GpuLost() from e
                g[key] = None

        try:
            xids = self._poll_xids(i)
            if xids:
                self.last_xid[i] = xids[-1]
            g["xid_events"] = xids if i in self.event_sets else None
            g["xid"] = self.last_xid.get(i)
            guard("name", lambda: _text(n.nvmlDeviceGetName(h)))
            if g["name"]:
                self.names[i] = g["name"]
            guard("uuid", lambda: _text(n.nvmlDeviceGetUUID(h)))
            guard("pci_bus_id", lambda: _text(n.nvmlDeviceGetPciInfo(h).busId))
            util = {}
            guard("util_gpu", lambda: util.setdefault("u", n.nvmlDeviceGetUtilizationRates(h)).gpu)
            guard("util_mem", lambda: util["u"].memory)
            mem = {}
            guard("mem_total_mb", lambda: mem.setdefault("m", n.nvmlDeviceGetMemoryInfo(h)).total // 2**20)
            guard("mem_used_mb", lambda: mem["m"].used // 2**20)
            guard("temp_c", lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))
            guard("power_w", lambda: round(n.nvmlDeviceGetPowerUsage(h) / 1000, 1))
            guard("power_limit_w", lambda: round(n.nvmlDeviceGetEnforcedPowerLimit(h) / 1000, 1))
            guard("sm_clock_mhz", lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_SM))
            for key, kind, counter in (
                ("ecc_sbe_volatile", "NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_VOLATILE_ECC"),
                ("ecc_dbe_volatile", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_VOLATILE_ECC"),
                ("ecc_sbe_aggregate", "NVML_MEMORY_ERROR_TYPE_CORRECTED", "NVML_AGGREGATE_ECC"),
                ("ecc_dbe_aggregate", "NVML_MEMORY_ERROR_TYPE_UNCORRECTED", "NVML_AGGREGATE_ECC"),
            ):
                guard(key, lambda kind=kind, counter=counter: int(n.nvmlDeviceGetTotalEccErrors(
                    h, getattr(n, kind), getattr(n, counter))))
            g["ecc_dbe"] = g["ecc_dbe_volatile"]
            rows = {}
            guard("remap_correctable", lambda: rows.setdefault("r", n.nvmlDeviceGetRemappedRows(h))[0])
            guard("remap_uncorrectable", lambda: rows["r"][1])
            guard("remap_pending", lambda: bool(rows["r"][2]))
            guard("remap_failure", lambda: bool(rows["r"][3]))
            guard("mig_mode", lambda: bool(n.nvmlDeviceGetMigMode(h)[0]))
            if g["mig_mode"]:
                guard("mig_instances", lambda: self._mig_instances(h))
            elif g["mig_mode"] is False:
                g["mig_instances"] = []
            guard("processes", lambda: self._processes(h, job_pids))
        except GpuLost:
            g = _blank(i, g["name"])
            g.update(job_id=job, off_bus=True, xid=self.last_xid.get(i), xid_events=[])
            self.handles[i] = None
            es = self.event_sets.pop(i, None)
            if es is not None:
                with contextlib.suppress(Exception):
                    n.nvmlEventSetFree(es)
            return g
        if g["job_id"] is None and g["processes"]:
            g["job_id"] = next((p["job_id"] for p in g["processes"] if p["job_id"] is not None), None)
        return g

    def _mig_instances(self, h) -> list:
        n, out = self.nvml, []
        for k in range(n.nvmlDeviceGetMaxMigDeviceCount(h)):
            try:
                mh = n.nvmlDeviceGetMigDeviceHandleByIndex(h, k)
            except Exception as e:
                if _nvml_code(e) == NVML_LOST:
                    raise
                continue  # an empty slot
            inst = {"index": k, "uuid": None, "mem_total_mb": None, "mem_used_mb": None}
            with contextlib.suppress(Exception):
                inst["uuid"] = _text(n.nvmlDeviceGetUUID(mh))
            with contextlib.suppress(Exception):
                m = n.nvmlDeviceGetMemoryInfo(mh)
                inst["mem_total_mb"], inst["mem_used_mb"] = m.total // 2**20, m.used // 2**20
            out.append(inst)
        return out

    def _processes(self, h, job_pids: dict) -> list:
        n, seen, out = self.nvml, set(), []
        procs = list(n.nvmlDeviceGetComputeRunningProcesses(h))
        try:
            procs += list(n.nvmlDeviceGetGraphicsRunningProcesses(h))
        except Exception as e:
            if _nvml_code(e) == NVML_LOST:
                raise
        for p in procs:
            pid = int(p.pid)
            if pid in seen:
                continue
            seen.add(pid)
            used = getattr(p, "usedGpuMemory", None)
            out.append({"pid": pid, "used_mb": used // 2**20 if used is not None else None,
                        "job_id": job_of_pid(pid, job_pids)})
        return out

    # --- what the daemon sees
    def describe(self) -> list[dict]:
        """The GPUs this node can allocate (hello): a GPU NVML cannot reach is left out."""
        if self.source == "nvml":
            return [{"index": i, "name": self.names[i] or self.model}
                    for i in range(self.count) if self.handles[i] is not None]
        if self.source == "simulated":
            return [{"index": i, "name": self.model} for i in range(self.count)
                    if not self.faults.get(i, {}).get("off_bus")]
        return [{"index": i, "name": self.model} for i in range(self.count)]

    def telemetry(self, busy: dict, job_pids: dict | None = None) -> list[dict]:
        """One dict per GPU (keys: GPU_FIELDS). busy: GPU index -> job id; job_pids: a job's
        process-group leader pid -> job id (to map the processes NVML sees to jobs)."""
        job_pids = job_pids or {}
        out = []
        for i in range(self.count):
            if self.source == "nvml":
                out.append(self._nvml_gpu(i, busy.get(i), job_pids))
            elif self.source == "simulated":
                out.append(self._simulated_gpu(i, busy.get(i), job_pids))
            else:
                g = _blank(i, self.model)
                g["job_id"] = busy.get(i)
                out.append(g)
        return out

    # --- the demo's GPUs, and the faults an operator injects into them
    def _simulated_gpu(self, i: int, job, job_pids: dict) -> dict:
        f = self.faults.get(i, {})
        g = _blank(i, self.model)
        g.update(uuid=f"GPU-sim-{os.environ.get('TRAINYARD_SIM_NODE') or socket.gethostname()}-{i}", pci_bus_id=f"00000000:{0x18 + i:02X}:00.0",
                 job_id=job, off_bus=bool(f.get("off_bus")), xid=f.get("xid"),
                 xid_events=f.pop("new_xids", []))
        if g["off_bus"]:
            return g
        util = random.randint(85, 100) if job else random.randint(0, 3)
        used = 60000 + random.randint(0, 4000) if job else 0
        dbe = int(f.get("ecc_dbe", 0))
        g.update(
            util_gpu=util, util_mem=util // 2, mem_total_mb=81559, mem_used_mb=used,
            temp_c=f["temp"] if "temp" in f else 60 + util // 5 + random.randint(0, 3),
            power_w=90 + util * 6, power_limit_w=700, sm_clock_mhz=1980 if job else 345,
            ecc_sbe_volatile=0, ecc_dbe_volatile=dbe, ecc_sbe_aggregate=0, ecc_dbe_aggregate=dbe,
            ecc_dbe=dbe, remap_correctable=0, remap_uncorrectable=dbe, remap_pending=bool(dbe),
            remap_failure=False, mig_mode=False, mig_instances=[],
            processes=[{"pid": pid, "used_mb": used, "job_id": j}
                       for pid, j in job_pids.items() if job is not None and j == job],
        )
        return g

    def fault(self, gpu: int, kind: str, value=None, host: str = "") -> None:
        """Inject (or clear) a fault on a simulated GPU; ValueError says why not."""
        host = host or os.environ.get("TRAINYARD_SIM_NODE") or socket.gethostname()
        if self.source != "simulated":
            what = {"nvml": "real ones", "declared": "declared ones without telemetry"}.get(
                self.source, "none")
            raise ValueError(f"fault injection works only on simulated GPUs; {host} has {what}")
        if kind not in FAULT_KINDS:
            raise ValueError(f"unknown fault {kind!r}; use one of {', '.join(FAULT_KINDS)}")
        if not isinstance(gpu, int) or isinstance(gpu, bool) or not 0 <= gpu < self.count:
            raise ValueError(f"{host} has no GPU {gpu!r} (it has {self.count}: 0-{self.count - 1})")
        f = self.faults.setdefault(gpu, {})
        if kind == "clear":
            self.faults.pop(gpu, None)
        elif kind == "xid":
            code = _int_value(value, "xid", 1, 1 << 16)
            f["xid"] = code
            f.setdefault("new_xids", []).append(code)
        elif kind == "ecc_dbe":
            f["ecc_dbe"] = int(f.get("ecc_dbe", 0)) + (1 if value is None else _int_value(value, "ecc_dbe", 1, 1 << 20))
        elif kind == "temp":
            f["temp"] = _int_value(value, "temp", 0, 200)
        elif kind == "off_bus":
            f["off_bus"] = True


def _int_value(value, what: str, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or int(value) != value:
        raise ValueError(f"fault {what} needs a whole number, not {value!r}")
    if not lo <= int(value) <= hi:
        raise ValueError(f"fault {what} value {value} is out of range {lo}-{hi}")
    return int(value)


# ---------------------------------------------------------------- the agent

class Agent:
    def __init__(self, root: str, declared_gpus: int, declared_model: str, telemetry_s: float):
        self.root = os.path.abspath(root)
        self.jobs_dir = os.path.join(self.root, "jobs")
        os.makedirs(self.jobs_dir, exist_ok=True)
        self.out_lock = threading.Lock()
        self.inbox: queue.Queue = queue.Queue()
        self.wrappers: dict[str, subprocess.Popen] = {}
        self.watching: dict[str, dict] = {}  # key -> {"gpus": [...], "job_id": ...}
        self.gpus = Gpus(declared_gpus, declared_model)
        self.telemetry_s = telemetry_s

    def send(self, msg: dict) -> None:
        line = json.dumps(msg, separators=(",", ":")) + "\n"
        with self.out_lock:
            sys.stdout.write(line)
            sys.stdout.flush()

    def job_dir(self, key: str) -> str:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"bad job key {key!r}")
        return os.path.join(self.jobs_dir, key)

    # --- requests
    def on_launch(self, msg: dict) -> None:
        key = msg["key"]
        d = self.job_dir(key)
        info = {"gpus": msg.get("gpus", []), "job_id": msg.get("job_id"), "announced": False}
        try:
            os.mkdir(d)
        except FileExistsError:
            # launched before (the daemon retries after a crash): report, never run twice
            self.watching.setdefault(key, info)
            self.report(key)
            return
        self.watching[key] = info
        argv = msg.get("argv")
        if msg.get("script") is not None:
            path = os.path.join(d, "script")
            with open(path, "w") as f:
                f.write(msg["script"])
            os.chmod(path, 0o700)
            argv = [path] if msg["script"].startswith("#!") else ["/bin/sh", path]
        workdir = msg.get("workdir")
        if workdir and not os.path.isdir(workdir):
            _write_atomic(os.path.join(d, "log"),
                          f"trainyard: workdir {workdir!r} does not exist on {socket.gethostname()}\n")
            _write_atomic(os.path.join(d, "rc"), "127")
            self.report(key)
            return
        if workdir:
            argv = ["sh", "-c", 'cd "$0" && exec "$@"', workdir, *argv]
        env = dict(os.environ)
        env.update(msg.get("env") or {})
        with open(os.path.join(d, "spec.json"), "w") as f:
            json.dump({"argv": argv, "env": msg.get("env") or {}, "workdir": workdir}, f)
        self.wrappers[key] = subprocess.Popen(
            ["/bin/sh", "-c", WRAPPER, "trainyard-wrapper", *argv], cwd=d, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, close_fds=True,
        )

    def exists(self, d: str, name: str) -> bool:
        return os.path.exists(os.path.join(d, name))

    def status(self, key: str) -> dict:
        d = self.job_dir(key)
        if not os.path.isdir(d):
            return {"key": key, "state": "unknown"}
        for attempt in (0, 1):
            rc = self.read(d, "rc")
            if rc is not None:
                end = os.stat(os.path.join(d, "rc")).st_mtime
                return {"key": key, "state": "exited", "rc": int(rc), "end_time": end}
            if attempt:
                break
            pid = self.read(d, "pid")
            if pid is not None and self.alive(int(pid)):
                # running once setsid has made it the leader of its own process group
                state = "running" if self.group_leader(int(pid)) else "starting"
                return {"key": key, "state": state, "pid": int(pid)}
            wpid = self.read(d, "wpid")
            if wpid is None or self.alive(int(wpid)):
                # the wrapper is still starting the job, or about to write its exit status
                return {"key": key, "state": "starting" if pid is None else "running",
                        "pid": int(pid) if pid else None}
        # job and wrapper are gone and no exit status was written (e.g. the node rebooted)
        return {"key": key, "state": "lost"}

    @staticmethod
    def read(d: str, name: str):
        try:
            with open(os.path.join(d, name)) as f:
                return f.read().strip()
        except FileNotFoundError:
            return None

    @staticmethod
    def group_leader(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[2]) == pid
        except (OSError, ValueError, IndexError):
            try:
                return os.getpgid(pid) == pid if hasattr(os, "getpgid") else True
            except ProcessLookupError:  # it ended meanwhile; the next pass reports its exit
                return False

    @staticmethod
    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:  # kill -0 succeeds on zombies
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return True

    def report(self, key: str) -> None:
        st = self.status(key)
        if st["state"] == "running":
            self.send({"ev": "started", "key": key, "pid": st["pid"]})
        elif st["state"] in ("exited", "lost"):
            self.send({"ev": "exited", "key": key, "rc": st.get("rc"), "end_time": st.get("end_time"),
                       "lost": st["state"] == "lost"})
            self.watching.pop(key, None)

    def on_signal(self, msg: dict) -> None:
        key, sig = msg["key"], SIGNALS[msg.get("sig", "TERM")]
        pid = self.read(self.job_dir(key), "pid")
        if pid is None:
            return
        try:
            os.killpg(int(pid), sig)
        except ProcessLookupError:  # not yet its own group leader: signal the process itself
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), sig)

    def on_sync(self, msg: dict) -> None:
        """Report every job that has not been forgotten: running ones and exits nobody heard."""
        jobs = []
        for key in sorted(os.listdir(self.jobs_dir)):
            d = os.path.join(self.jobs_dir, key)
            if os.path.exists(os.path.join(d, "forgotten")):
                continue
            st = self.status(key)
            jobs.append(st)
            if st["state"] in ("running", "starting"):
                self.watching.setdefault(key, {"gpus": [], "job_id": None})
        self.send({"ev": "jobs", "id": msg.get("id"), "jobs": jobs})

    def on_watch(self, msg: dict) -> None:
        """After a reconnect the daemon says which GPUs each running job holds (for telemetry)."""
        for key, info in msg.get("jobs", {}).items():
            if key in self.watching:
                self.watching[key] = info

    def on_forget(self, msg: dict) -> None:
        for key in msg.get("keys", []):
            d = self.job_dir(key)
            if os.path.isdir(d):
                open(os.path.join(d, "forgotten"), "w").close()
            self.watching.pop(key, None)
            w = self.wrappers.pop(key, None)
            if w is not None:
                w.poll()

    def on_log(self, msg: dict) -> None:
        d = self.job_dir(msg["key"])
        offset, limit = int(msg.get("offset", 0)), int(msg.get("limit", 65536))
        data, size = b"", 0
        try:
            with open(os.path.join(d, "log"), "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(min(offset, size))
                data = f.read(limit)
        except FileNotFoundError:
            pass
        self.send({"ev": "log", "id": msg.get("id"), "key": msg["key"], "offset": offset,
                   "data": data.decode("utf-8", "replace"), "next": offset + len(data), "size": size})

    # --- loops
    def read_stdin(self) -> None:
        for line in sys.stdin:
            line = line.strip()
            if line:
                self.inbox.put(line)
        self.inbox.put(None)  # EOF: the daemon went away

    def hello(self) -> dict:
        mem_mb = 0
        try:
            with open("/proc/meminfo") as f:
                mem_mb = int(f.readline().split()[1]) // 1024
        except (OSError, ValueError, IndexError):
            pass
        # simulated nodes (demo, tests) share one machine, so they may claim a size of their own
        cpus = int(os.environ.get("TRAINYARD_SIM_CPUS") or os.cpu_count() or 1)
        mem_mb = int(os.environ.get("TRAINYARD_SIM_MEM_MB") or mem_mb)
        return {"ev": "hello", "protocol": PROTOCOL, "host": socket.gethostname(), "pid": os.getpid(),
                "cpus": cpus, "mem_mb": mem_mb, "gpu_source": self.gpus.source,
                "gpu_model": self.gpus.model, "gpus": self.gpus.describe(), "gpu_note": self.gpus.note,
                "root": self.root}

    def run(self) -> None:
        self.send(self.hello())
        threading.Thread(target=self.read_stdin, daemon=True).start()
        handlers = {"launch": self.on_launch, "signal": self.on_signal, "sync": self.on_sync,
                    "forget": self.on_forget, "log": self.on_log, "watch": self.on_watch,
                    "fault": self.on_fault,
                    "ping": lambda m: self.send({"ev": "pong", "id": m.get("id")})}
        next_tel = next_lost_check = time.monotonic()
        while True:
            try:
                starting = any(not i.get("announced", True) for i in self.watching.values())
                # poll fast while jobs start, often while they run (exits are noticed by their rc
                # file), and rarely when idle
                line = self.inbox.get(timeout=0.002 if starting else 0.01 if self.watching else 0.05)
            except queue.Empty:
                line = ""
            if line is None:
                return
            if line:
                try:
                    msg = json.loads(line)
                    handlers[msg["op"]](msg)
                except Exception as e:  # a bad request never kills the agent
                    self.send({"ev": "error", "id": _get_id(line), "error": f"{type(e).__name__}: {e}"})
            check_lost = time.monotonic() >= next_lost_check
            if check_lost:
                next_lost_check = time.monotonic() + 1.0
            for key, info in list(self.watching.items()):
                d = self.job_dir(key)
                if self.exists(d, "rc"):
                    self.report(key)
                elif not info.get("announced", True) and self.exists(d, "pid"):
                    if self.status(key)["state"] != "starting":
                        info["announced"] = True
                        self.report(key)
                elif check_lost and self.status(key)["state"] == "lost":
                    self.report(key)
            for key, w in list(self.wrappers.items()):
                if w.poll() is not None and key not in self.watching:
                    del self.wrappers[key]
            if self.telemetry_s > 0 and time.monotonic() >= next_tel:
                next_tel = time.monotonic() + self.telemetry_s
                self.send_telemetry()

    def job_pids(self) -> dict:
        """Process-group leader pid of each running job -> its job id (to map GPU processes)."""
        out = {}
        for key, info in self.watching.items():
            pid = self.read(self.job_dir(key), "pid")
            if pid and pid.isdigit():
                out[int(pid)] = info.get("job_id")
        return out

    def send_telemetry(self) -> None:
        busy = {g: info.get("job_id") for info in self.watching.values() for g in info.get("gpus", [])}
        try:
            gpus = self.gpus.telemetry(busy, self.job_pids())
        except Exception as e:  # telemetry never kills the agent that runs the jobs
            self.send({"ev": "error", "id": None, "error": f"telemetry: {type(e).__name__}: {e}"})
            return
        self.send({"ev": "telemetry", "time": time.time(), "source": self.gpus.source, "gpus": gpus})

    def on_fault(self, msg: dict) -> None:
        """Inject a fault into a simulated GPU (demo only); refused on real or declared GPUs."""
        try:
            self.gpus.fault(msg.get("gpu"), str(msg.get("kind")), msg.get("value"))
        except ValueError as e:
            self.send({"ev": "error", "id": msg.get("id"), "error": str(e)})
            return
        self.send({"ev": "fault", "id": msg.get("id"), "ok": True, "gpu": msg.get("gpu"),
                   "kind": msg.get("kind")})


def _get_id(line: str):
    try:
        return json.loads(line).get("id")
    except Exception:
        return None


def main(argv: list[str]) -> int:
    import argparse  # noqa: PLC0415

    p = argparse.ArgumentParser(prog="trainyard-agent")
    p.add_argument("--root", default=".trainyard")
    p.add_argument("--gpus", type=int, default=0, help="GPUs declared for this node (used without NVML)")
    p.add_argument("--gpu-model", default="")
    p.add_argument("--telemetry", type=float, default=2.0, help="seconds between telemetry reports")
    args = p.parse_args(argv)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    Agent(args.root, args.gpus, args.gpu_model, args.telemetry).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
