"""The node's GPUs as the agent sees them: NVML when the driver is there, else those declared.

Part of the agent's bundle (standard library; pynvml when the node has it). The demo's
simulated GPUs live in simgpu.py, which only simulated nodes load.
"""

from __future__ import annotations

import contextlib

if __package__:
    from .protocol import GPU_FIELDS
else:  # inside the agent's bundle on a node
    from protocol import GPU_FIELDS

# ---------------------------------------------------------------- GPUs

NVML_LOST = 15       # NVML_ERROR_GPU_IS_LOST: the GPU fell off the bus
NVML_NOT_FOUND = 6   # NVML_ERROR_NOT_FOUND
NVML_TIMEOUT = 10    # NVML_ERROR_TIMEOUT: no event waiting
NVML_GPU_NOT_FOUND = 28
XID_EVENT = 0x8      # nvmlEventTypeXidCriticalError
FAULT_KINDS = ("xid", "ecc_dbe", "temp", "off_bus", "remap_pending", "clear")


# DCGM's profiling fields (dcgm-exporter's defaults) and the GPM metric that measures each
GPM_METRICS = (("prof_gr_engine_active", "NVML_GPM_METRIC_GRAPHICS_UTIL"),
               ("prof_pipe_tensor_active", "NVML_GPM_METRIC_ANY_TENSOR_UTIL"),
               ("prof_dram_active", "NVML_GPM_METRIC_DRAM_BW_UTIL"))


class GpuLost(Exception):
    """NVML said NVML_ERROR_GPU_IS_LOST for this GPU."""


def _nvml_code(e: BaseException):
    return getattr(e, "value", None)


def _text(v):
    return v.decode() if isinstance(v, bytes) else v


# nvmlValueType_t -> the member of nvmlValue_t that holds such a value
_FIELD_VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal",
                        6: "usVal"}


def _field_value(n, h, field_id):
    """One NVML field value (nvmlDeviceGetFieldValues) as a number; None where the driver
    answered that it has none."""
    fv = n.nvmlDeviceGetFieldValues(h, [field_id])[0]
    if fv.nvmlReturn != 0:
        return None
    member = _FIELD_VALUE_MEMBERS.get(fv.valueType)
    return getattr(fv.value, member) if member else None


def blank(i: int, name) -> dict:
    """Telemetry of one GPU with every field present and unknown."""
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
    """The node's GPUs: NVML when present, else what was declared for the node.

    `source` is "nvml", "declared" or "none"; `note` says in words why (for example why NVML
    was not used), and goes to the daemon in `hello`. simgpu.SimulatedGpus has the same face.
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
        self.gpm_samples: dict[int, list] = {}    # GPU index -> [previous, spare] GPM samples
        self.gpm_unsupported: set[int] = set()
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

    def _gpm(self, i: int, h) -> dict:
        """DCGM's profiling ratios from NVML's GPU performance monitoring (Hopper and later):
        each read takes a sample and measures over the time since the last one, so the first
        read of a GPU gives none. {} where the GPU or the driver has no GPM."""
        n = self.nvml
        if i in self.gpm_unsupported:
            return {}
        try:
            samples = self.gpm_samples.get(i)
            if samples is None:
                if not n.nvmlGpmQueryDeviceSupport(h).isSupportedDevice:
                    self.gpm_unsupported.add(i)
                    return {}
                samples = self.gpm_samples[i] = [None, n.nvmlGpmSampleAlloc()]
            prev, cur = samples
            n.nvmlGpmSampleGet(h, cur)
            samples[:] = [cur, prev if prev is not None else n.nvmlGpmSampleAlloc()]
            if prev is None:
                return {}
            get = n.c_nvmlGpmMetricsGet_t()
            get.version = n.NVML_GPM_METRICS_GET_VERSION
            get.sample1, get.sample2 = prev, cur
            get.numMetrics = len(GPM_METRICS)
            for k, (_key, metric) in enumerate(GPM_METRICS):
                get.metrics[k].metricId = getattr(n, metric)
            n.nvmlGpmMetricsGet(get)
            # GPM gives percentages; DCGM's PROF_* fields are ratios of 1
            return {key: round(get.metrics[k].value / 100.0, 4)
                    for k, (key, _metric) in enumerate(GPM_METRICS)
                    if get.metrics[k].nvmlReturn == 0}
        except Exception as e:
            if _nvml_code(e) == NVML_LOST:
                raise GpuLost() from e
            samples = self.gpm_samples.get(i)
            if samples is None or samples[0] is None:
                # the support query or the first sample failed (a GPU in MIG mode answers
                # only per instance): not asked again
                self.gpm_unsupported.add(i)
                self._free_gpm(i)
            return {}

    def _free_gpm(self, i: int) -> None:
        for sample in self.gpm_samples.pop(i, None) or ():
            if sample is not None:
                with contextlib.suppress(Exception):
                    self.nvml.nvmlGpmSampleFree(sample)

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
        g = blank(i, self.names[i] if i < len(self.names) else None)
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
            # the rest of dcgm-exporter's default counters (docs/metrics.md)
            guard("mem_clock_mhz", lambda: n.nvmlDeviceGetClockInfo(h, n.NVML_CLOCK_MEM))
            guard("mem_temp_c", lambda: _field_value(n, h, n.NVML_FI_DEV_MEMORY_TEMP))
            guard("energy_mj", lambda: int(n.nvmlDeviceGetTotalEnergyConsumption(h)))
            guard("pcie_replay", lambda: int(n.nvmlDeviceGetPcieReplayCounter(h)))
            guard("util_enc", lambda: n.nvmlDeviceGetEncoderUtilization(h)[0])
            guard("util_dec", lambda: n.nvmlDeviceGetDecoderUtilization(h)[0])
            guard("mem_reserved_mb", lambda: n.nvmlDeviceGetMemoryInfo(
                h, version=n.nvmlMemory_v2).reserved // 2**20)
            guard("power_mgmt_limit_w",
                  lambda: round(n.nvmlDeviceGetPowerManagementLimit(h) / 1000, 1))
            for key, value in self._gpm(i, h).items():
                g[key] = value
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
            g = blank(i, g["name"])
            g.update(job_id=job, off_bus=True, xid=self.last_xid.get(i), xid_events=[])
            self.handles[i] = None
            es = self.event_sets.pop(i, None)
            if es is not None:
                with contextlib.suppress(Exception):
                    n.nvmlEventSetFree(es)
            self._free_gpm(i)
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
        return [{"index": i, "name": self.model} for i in range(self.count)]

    def telemetry(self, busy: dict, job_pids: dict | None = None) -> list[dict]:
        """One dict per GPU (keys: GPU_FIELDS). busy: GPU index -> job id; job_pids: a job's
        process-group leader pid -> job id (to map the processes NVML sees to jobs)."""
        job_pids = job_pids or {}
        out = []
        for i in range(self.count):
            if self.source == "nvml":
                out.append(self._nvml_gpu(i, busy.get(i), job_pids))
            else:
                g = blank(i, self.model)
                g["job_id"] = busy.get(i)
                out.append(g)
        return out

    def fault(self, gpu, kind: str, value=None, host: str = "") -> None:
        """Fault injection is the demo's: real and declared GPUs refuse it."""
        what = {"nvml": "real ones", "declared": "declared ones without telemetry"}.get(self.source, "none")
        raise ValueError(f"fault injection works only on simulated GPUs; {host or 'this node'} has {what}")
