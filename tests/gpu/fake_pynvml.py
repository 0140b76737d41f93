"""A fake NVML with pynvml's function names, constants and error types, driven by scenarios.

    nvml = fake_pynvml.scenario("xid79", gpus=4)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)   # the agent's `import pynvml` gets it

Scenarios: healthy, hot (GPU 1 at 96 °C), xid79 (an XID 79 waits in GPU 2's event queue),
ecc_dbe (GPU 0 has two volatile double-bit ECC errors), remap_failure (GPU 3), not_supported
(every optional query answers NVML_ERROR_NOT_SUPPORTED, as on consumer cards and old drivers),
gpu_lost (GPU 1 answers NVML_ERROR_GPU_IS_LOST), mig (GPU 0 in MIG mode with two instances),
library_missing (nvmlInit raises NVMLError_LibraryNotFound, as on a node without a driver).
A scenario can be changed while a test runs: `nvml.gpus[i][...]`, `nvml.queue_xid(i, code)`,
`nvml.lose(i)`.
"""

from __future__ import annotations

import string
import types
from dataclasses import dataclass

# the constants pynvml exposes (same values as nvidia-ml-py)
NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_ALREADY_INITIALIZED = 5
NVML_ERROR_NOT_FOUND = 6
NVML_ERROR_INSUFFICIENT_SIZE = 7
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_TIMEOUT = 10
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_UNKNOWN = 999

NVML_TEMPERATURE_GPU = 0
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2
NVML_FI_DEV_MEMORY_TEMP = 82
NVML_VALUE_TYPE_UNSIGNED_INT = 1
NVML_GPM_METRIC_GRAPHICS_UTIL = 1
NVML_GPM_METRIC_DRAM_BW_UTIL = 10
NVML_GPM_METRIC_ANY_TENSOR_UTIL = 20
NVML_GPM_METRICS_GET_VERSION = 1
NVML_SINGLE_BIT_ECC = 0
NVML_DOUBLE_BIT_ECC = 1
NVML_MEMORY_ERROR_TYPE_CORRECTED = 0
NVML_MEMORY_ERROR_TYPE_UNCORRECTED = 1
NVML_VOLATILE_ECC = 0
NVML_AGGREGATE_ECC = 1
NVML_DEVICE_MIG_DISABLE = 0
NVML_DEVICE_MIG_ENABLE = 1
nvmlEventTypeSingleBitEccError = 0x1
nvmlEventTypeDoubleBitEccError = 0x2
nvmlEventTypeXidCriticalError = 0x8
nvmlEventTypeAll = 0x1 | 0x2 | 0x4 | 0x8 | 0x10

_STRINGS = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized", NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported", NVML_ERROR_NO_PERMISSION: "Insufficient Permissions",
    NVML_ERROR_ALREADY_INITIALIZED: "Already Initialized", NVML_ERROR_NOT_FOUND: "Not Found",
    NVML_ERROR_INSUFFICIENT_SIZE: "Insufficient Size", NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
    NVML_ERROR_TIMEOUT: "Timeout", NVML_ERROR_LIBRARY_NOT_FOUND: "NVML Shared Library Not Found",
    NVML_ERROR_FUNCTION_NOT_FOUND: "Function Not Found", NVML_ERROR_GPU_IS_LOST: "GPU is lost",
    NVML_ERROR_UNKNOWN: "Unknown Error",
}


class NVMLError(Exception):
    """As in pynvml: NVMLError(code) builds the subclass for that code (NVMLError_NotSupported...)."""

    _valClassMapping: dict = {}

    def __new__(cls, value):
        if cls is NVMLError:
            cls = NVMLError._valClassMapping.get(value, cls)
        obj = Exception.__new__(cls)
        obj.value = value
        return obj

    def __init__(self, value=None):
        super().__init__()

    def __str__(self):
        return _STRINGS.get(self.value, f"NVML Error with code {self.value}")


for _name, _code in list(globals().items()):
    if _name.startswith("NVML_ERROR_"):
        _cls_name = "NVMLError_" + string.capwords(_name[len("NVML_ERROR_"):], "_").replace("_", "")

        def _new(cls, *args, _code=_code):
            return NVMLError.__new__(cls, _code)

        _cls = type(_cls_name, (NVMLError,), {"__new__": _new})
        globals()[_cls_name] = _cls
        NVMLError._valClassMapping[_code] = _cls

ERRORS = {n: c for n, c in globals().items() if n.startswith("NVMLError")}
CONSTANTS = {n: v for n, v in globals().items() if n.startswith(("NVML_", "nvmlEventType"))}


@dataclass
class Handle:
    index: int
    mig: int | None = None


@dataclass
class Utilization:
    gpu: int
    memory: int


@dataclass
class Memory:
    total: int
    free: int
    used: int


@dataclass
class MemoryV2(Memory):
    reserved: int = 0


nvmlMemory_v2 = 0x02000028  # the version pynvml passes for nvmlDeviceGetMemoryInfo_v2


@dataclass
class FieldValueNumber:
    uiVal: int  # noqa: N815


@dataclass
class FieldValue:
    fieldId: int  # noqa: N815
    nvmlReturn: int  # noqa: N815
    valueType: int  # noqa: N815
    value: FieldValueNumber


@dataclass
class GpmSupport:
    isSupportedDevice: int  # noqa: N815


@dataclass
class GpmSample:
    """What a GPU's counters held when sampled: its busy fractions (percent) so far."""
    taken: dict | None = None


@dataclass
class GpmMetric:
    metricId: int = 0  # noqa: N815
    nvmlReturn: int = 0  # noqa: N815
    value: float = 0.0


class c_nvmlGpmMetricsGet_t:  # noqa: N801 (pynvml's name)
    def __init__(self):
        self.version = 0
        self.numMetrics = 0
        self.sample1 = self.sample2 = None
        self.metrics = [GpmMetric() for _ in range(16)]


@dataclass
class PciInfo:
    busId: bytes  # noqa: N815 (pynvml's name)


@dataclass
class ProcessInfo:
    pid: int
    usedGpuMemory: int | None  # noqa: N815
    gpuInstanceId: int = 0xFFFFFFFF  # noqa: N815
    computeInstanceId: int = 0xFFFFFFFF  # noqa: N815


@dataclass
class EventData:
    device: Handle
    eventType: int  # noqa: N815
    eventData: int  # noqa: N815
    gpuInstanceId: int = 0  # noqa: N815
    computeInstanceId: int = 0  # noqa: N815


class EventSet:
    def __init__(self):
        self.devices: dict[int, int] = {}  # GPU index -> registered event mask


MIB = 2**20
# queries a node may not support; `not_supported` makes every one of them fail
OPTIONAL = ("nvmlDeviceGetUtilizationRates", "nvmlDeviceGetTemperature", "nvmlDeviceGetPowerUsage",
            "nvmlDeviceGetEnforcedPowerLimit", "nvmlDeviceGetClockInfo", "nvmlDeviceGetTotalEccErrors",
            "nvmlDeviceGetRemappedRows", "nvmlDeviceGetMigMode", "nvmlDeviceGetComputeRunningProcesses",
            "nvmlDeviceGetGraphicsRunningProcesses", "nvmlDeviceGetSupportedEventTypes",
            "nvmlDeviceGetPciInfo", "nvmlDeviceGetFieldValues", "nvmlDeviceGetTotalEnergyConsumption",
            "nvmlDeviceGetPcieReplayCounter", "nvmlDeviceGetEncoderUtilization",
            "nvmlDeviceGetDecoderUtilization", "nvmlDeviceGetMemoryInfo_v2",
            "nvmlDeviceGetPowerManagementLimit", "nvmlGpmQueryDeviceSupport")
SCENARIOS = ("healthy", "hot", "xid79", "ecc_dbe", "remap_failure", "not_supported", "gpu_lost",
             "mig", "library_missing")


class FakeNvml(types.ModuleType):
    """The module object the agent gets for `import pynvml`."""

    def __init__(self, scenario_name: str = "healthy", gpus: int = 4):
        super().__init__("pynvml")
        if scenario_name not in SCENARIOS:
            raise ValueError(f"unknown scenario {scenario_name!r}; one of {SCENARIOS}")
        self.__dict__.update(ERRORS)
        self.__dict__.update(CONSTANTS)
        self.nvmlMemory_v2 = nvmlMemory_v2
        self.c_nvmlGpmMetricsGet_t = c_nvmlGpmMetricsGet_t
        self.scenario = scenario_name
        self.initialized = False
        self.init_error: int | None = None
        self.unsupported: set[str] = set()
        self.lost: set[int] = set()
        self.xids: dict[int, list[int]] = {}
        self.processes: dict[int, list[ProcessInfo]] = {}
        self.calls: list[str] = []
        self.gpus = [{
            "name": "NVIDIA H100 80GB HBM3", "uuid": f"GPU-fake-{i:04d}", "bus": f"00000000:{0x18 + i:02X}:00.0",
            "util": 37, "mem_util": 12, "total": 81559 * MIB, "used": 2048 * MIB, "temp": 41,
            "power_mw": 123456, "limit_mw": 700000, "sm_clock": 1980,
            "ecc": {(0, 0): 5, (1, 0): 0, (0, 1): 17, (1, 1): 0},  # (type, counter) -> count
            "rows": (0, 0, 0, 0), "mig": 0, "mig_instances": [],
            "mem_clock": 2619, "mem_temp": 48, "energy_mj": 10**9 + i, "pcie_replay": i,
            "enc": 0, "dec": 3, "reserved": 512 * MIB, "mgmt_limit_mw": 650000,
            # GPM: percent busy over the time between two samples, as the driver measures it
            "gpm": True, "gpm_pct": {NVML_GPM_METRIC_GRAPHICS_UTIL: 61.5,
                                     NVML_GPM_METRIC_ANY_TENSOR_UTIL: 42.0,
                                     NVML_GPM_METRIC_DRAM_BW_UTIL: 30.25},
        } for i in range(gpus)]
        if scenario_name == "hot":
            self.gpus[1]["temp"] = 96
        elif scenario_name == "xid79":
            self.queue_xid(2, 79)
        elif scenario_name == "ecc_dbe":
            self.gpus[0]["ecc"].update({(1, 0): 2, (1, 1): 2})
        elif scenario_name == "remap_failure":
            self.gpus[3 % gpus]["rows"] = (1, 3, 0, 1)
        elif scenario_name == "not_supported":
            self.unsupported = set(OPTIONAL)
        elif scenario_name == "gpu_lost":
            self.lost.add(1)
        elif scenario_name == "mig":
            self.gpus[0].update(mig=1, mig_instances=[(f"MIG-fake-0-{k}", 9856 * MIB, 13 * MIB) for k in (0, 1)])
        elif scenario_name == "library_missing":
            self.init_error = NVML_ERROR_LIBRARY_NOT_FOUND

    # --- changing the scenario while it runs
    def queue_xid(self, gpu: int, code: int) -> None:
        self.xids.setdefault(gpu, []).append(code)

    def lose(self, gpu: int) -> None:
        self.lost.add(gpu)

    # --- pynvml's API
    def _dev(self, fn: str, handle: Handle) -> dict:
        self.calls.append(fn)
        if not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if handle.index in self.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        if fn in self.unsupported:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return self.gpus[handle.index]

    def nvmlInit(self):  # noqa: N802
        if self.init_error is not None:
            raise NVMLError(self.init_error)
        self.initialized = True

    def nvmlShutdown(self):  # noqa: N802
        self.initialized = False

    def nvmlSystemGetDriverVersion(self):  # noqa: N802
        return "550.54.15"

    def nvmlDeviceGetCount(self):  # noqa: N802
        if not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index):  # noqa: N802
        if not self.initialized:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        if not 0 <= index < len(self.gpus):
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        if index in self.lost:
            raise NVMLError(NVML_ERROR_GPU_IS_LOST)
        return Handle(index)

    def nvmlDeviceGetName(self, h):  # noqa: N802
        return self._dev("nvmlDeviceGetName", h)["name"]

    def nvmlDeviceGetUUID(self, h):  # noqa: N802
        g = self._dev("nvmlDeviceGetUUID", h)
        return g["mig_instances"][h.mig][0] if h.mig is not None else g["uuid"]

    def nvmlDeviceGetPciInfo(self, h):  # noqa: N802
        return PciInfo(self._dev("nvmlDeviceGetPciInfo", h)["bus"].encode())

    def nvmlDeviceGetUtilizationRates(self, h):  # noqa: N802
        g = self._dev("nvmlDeviceGetUtilizationRates", h)
        return Utilization(g["util"], g["mem_util"])

    def nvmlDeviceGetMemoryInfo(self, h, version=None):  # noqa: N802
        g = self._dev("nvmlDeviceGetMemoryInfo", h)
        if h.mig is not None:
            _, total, used = g["mig_instances"][h.mig]
            return Memory(total, total - used, used)
        if version is not None:
            self._dev("nvmlDeviceGetMemoryInfo_v2", h)
            free = g["total"] - g["used"] - g["reserved"]
            return MemoryV2(g["total"], free, g["used"], g["reserved"])
        return Memory(g["total"], g["total"] - g["used"], g["used"])

    def nvmlDeviceGetFieldValues(self, h, field_ids):  # noqa: N802
        g = self._dev("nvmlDeviceGetFieldValues", h)
        known = {NVML_FI_DEV_MEMORY_TEMP: g["mem_temp"]}
        return [FieldValue(f, NVML_SUCCESS if f in known else NVML_ERROR_NOT_SUPPORTED,
                           NVML_VALUE_TYPE_UNSIGNED_INT, FieldValueNumber(known.get(f, 0)))
                for f in field_ids]

    def nvmlDeviceGetTotalEnergyConsumption(self, h):  # noqa: N802
        return self._dev("nvmlDeviceGetTotalEnergyConsumption", h)["energy_mj"]

    def nvmlDeviceGetPcieReplayCounter(self, h):  # noqa: N802
        return self._dev("nvmlDeviceGetPcieReplayCounter", h)["pcie_replay"]

    def nvmlDeviceGetEncoderUtilization(self, h):  # noqa: N802
        return [self._dev("nvmlDeviceGetEncoderUtilization", h)["enc"], 167000]

    def nvmlDeviceGetDecoderUtilization(self, h):  # noqa: N802
        return [self._dev("nvmlDeviceGetDecoderUtilization", h)["dec"], 167000]

    def nvmlDeviceGetPowerManagementLimit(self, h):  # noqa: N802
        return self._dev("nvmlDeviceGetPowerManagementLimit", h)["mgmt_limit_mw"]

    # --- GPU performance monitoring (Hopper and later)
    def nvmlGpmQueryDeviceSupport(self, h):  # noqa: N802
        return GpmSupport(int(self._dev("nvmlGpmQueryDeviceSupport", h)["gpm"]))

    def nvmlGpmSampleAlloc(self):  # noqa: N802
        self.calls.append("nvmlGpmSampleAlloc")
        return GpmSample()

    def nvmlGpmSampleFree(self, sample):  # noqa: N802
        self.calls.append("nvmlGpmSampleFree")

    def nvmlGpmSampleGet(self, h, sample):  # noqa: N802
        g = self._dev("nvmlGpmSampleGet", h)
        sample.taken = dict(g["gpm_pct"])

    def nvmlGpmMetricsGet(self, get):  # noqa: N802
        self.calls.append("nvmlGpmMetricsGet")
        if get.sample1 is None or get.sample2 is None or get.sample1.taken is None \
                or get.sample2.taken is None or get.sample1 is get.sample2:
            raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
        for m in get.metrics[:get.numMetrics]:
            m.value = get.sample2.taken.get(m.metricId, 0.0)
            m.nvmlReturn = NVML_SUCCESS if m.metricId in get.sample2.taken \
                else NVML_ERROR_NOT_SUPPORTED
        return get

    def nvmlDeviceGetTemperature(self, h, sensor):  # noqa: N802
        return self._dev("nvmlDeviceGetTemperature", h)["temp"]

    def nvmlDeviceGetPowerUsage(self, h):  # noqa: N802
        return self._dev("nvmlDeviceGetPowerUsage", h)["power_mw"]

    def nvmlDeviceGetEnforcedPowerLimit(self, h):  # noqa: N802
        return self._dev("nvmlDeviceGetEnforcedPowerLimit", h)["limit_mw"]

    def nvmlDeviceGetClockInfo(self, h, clock):  # noqa: N802
        g = self._dev("nvmlDeviceGetClockInfo", h)
        return g["mem_clock"] if clock == NVML_CLOCK_MEM else g["sm_clock"]

    def nvmlDeviceGetTotalEccErrors(self, h, error_type, counter_type):  # noqa: N802
        return self._dev("nvmlDeviceGetTotalEccErrors", h)["ecc"][(error_type, counter_type)]

    def nvmlDeviceGetRemappedRows(self, h):  # noqa: N802
        return self._dev("nvmlDeviceGetRemappedRows", h)["rows"]

    def nvmlDeviceGetMigMode(self, h):  # noqa: N802
        g = self._dev("nvmlDeviceGetMigMode", h)
        return [g["mig"], g["mig"]]

    def nvmlDeviceGetMaxMigDeviceCount(self, h):  # noqa: N802
        return 7 if self._dev("nvmlDeviceGetMaxMigDeviceCount", h)["mig"] else 0

    def nvmlDeviceGetMigDeviceHandleByIndex(self, h, index):  # noqa: N802
        g = self._dev("nvmlDeviceGetMigDeviceHandleByIndex", h)
        if index >= len(g["mig_instances"]):
            raise NVMLError(NVML_ERROR_NOT_FOUND)
        return Handle(h.index, mig=index)

    def nvmlDeviceGetComputeRunningProcesses(self, h):  # noqa: N802
        self._dev("nvmlDeviceGetComputeRunningProcesses", h)
        return list(self.processes.get(h.index, []))

    def nvmlDeviceGetGraphicsRunningProcesses(self, h):  # noqa: N802
        self._dev("nvmlDeviceGetGraphicsRunningProcesses", h)
        return []

    def nvmlDeviceGetSupportedEventTypes(self, h):  # noqa: N802
        self._dev("nvmlDeviceGetSupportedEventTypes", h)
        return nvmlEventTypeAll

    def nvmlEventSetCreate(self):  # noqa: N802
        return EventSet()

    def nvmlDeviceRegisterEvents(self, h, event_types, event_set):  # noqa: N802
        self._dev("nvmlDeviceRegisterEvents", h)
        event_set.devices[h.index] = event_types

    def nvmlEventSetWait_v2(self, event_set, timeout_ms):  # noqa: N802
        self.calls.append("nvmlEventSetWait_v2")
        if timeout_ms != 0:
            raise AssertionError("the agent must poll NVML events without blocking (timeout 0)")
        for index, mask in event_set.devices.items():
            if index in self.lost:
                raise NVMLError(NVML_ERROR_GPU_IS_LOST)
            if mask & nvmlEventTypeXidCriticalError and self.xids.get(index):
                return EventData(Handle(index), nvmlEventTypeXidCriticalError, self.xids[index].pop(0))
        raise NVMLError(NVML_ERROR_TIMEOUT)

    def nvmlEventSetWait(self, event_set, timeout_ms):  # noqa: N802
        return self.nvmlEventSetWait_v2(event_set, timeout_ms)

    def nvmlEventSetFree(self, event_set):  # noqa: N802
        event_set.devices.clear()


def scenario(name: str, gpus: int = 4) -> FakeNvml:
    return FakeNvml(name, gpus)
