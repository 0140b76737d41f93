"""GPU health rules: which telemetry drains a node or takes one GPU out of allocation, and why.

Pure: no I/O and no clock reads. `evaluate(rules, node, history, now)` states the rules over a
node's recent telemetry; `HealthTracker` gives the same verdicts one sample at a time in
O(GPUs) per sample (the daemon's path: a 1,000-node cluster sends 500 samples a second, and
re-reading a 300-sample history for each costs O(history)). The daemon acts on each verdict
whose `key` it has not acted on yet (a verdict stays in the answer while its cause is still in
the history, so acting once per key is what "once per new cause" means; forget a key when the
rules stop returning it).

A telemetry sample is `{"time": epoch seconds, "gpus": [gpu dict, ...]}` with the agent's
GPU fields (docs/gpu.md): `xid_events` (XID codes that arrived since the previous sample),
`ecc_dbe_volatile`, `remap_failure`, `off_bus`, `temp_c`, ...
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

DRAIN_NODE = "drain_node"
EXCLUDE_GPU = "exclude_gpu"
OFF = "off"
ACTIONS = (DRAIN_NODE, EXCLUDE_GPU, OFF)

# What the XIDs mean (NVIDIA's XID catalogue, shortened). The fatal classes drain by default.
XID_MEANINGS = {
    13: "graphics engine exception",
    31: "GPU memory page fault",
    43: "GPU stopped processing",
    45: "preemptive cleanup after a previous error",
    48: "double-bit ECC error",
    61: "internal micro-controller breakpoint",
    62: "internal micro-controller halt",
    63: "ECC page retirement or row remapping recorded",
    64: "ECC page retirement or row remapping failed",
    68: "video processor exception",
    74: "NVLink error",
    79: "GPU has fallen off the bus",
    92: "high single-bit ECC error rate",
    94: "contained ECC error",
    95: "uncontained ECC error",
    119: "GSP RPC timeout",
    120: "GSP error",
}
FATAL_XIDS = frozenset({48, 63, 64, 74, 79, 92, 94, 95})


def xid_meaning(code: int) -> str:
    return XID_MEANINGS.get(code, "see NVIDIA's XID catalogue")


@dataclass(frozen=True)
class Verdict:
    gpu: int
    action: str          # "drain_node" or "exclude_gpu"
    reason: str          # names the cause, e.g. "GPU 3: XID 79 (GPU has fallen off the bus)"
    key: str = ""        # stable while the cause lasts; a new cause has a new key
    node: str = ""
    rule: str = ""       # "xid", "ecc_dbe", "remap_failure", "off_bus", "temp"


@dataclass
class HealthRules:
    """GPU health rules (trainyard.toml's [health], read by scheduler.settings). Each rule's
    action: drain_node, exclude_gpu or off."""

    xid: str = DRAIN_NODE
    fatal_xids: frozenset = field(default_factory=lambda: FATAL_XIDS)
    ecc_dbe: str = DRAIN_NODE
    remap_failure: str = DRAIN_NODE
    off_bus: str = DRAIN_NODE
    temp: str = DRAIN_NODE
    temp_c: float = 90.0
    temp_period_s: float = 60.0
    history_samples: int = 300

    def __post_init__(self):
        # values are validated where they are read (scheduler.settings); keep lookups O(1)
        self.fatal_xids = frozenset(self.fatal_xids)


def _gpus(sample: dict) -> list | tuple:
    gpus = sample.get("gpus") if isinstance(sample, dict) else None
    return gpus if isinstance(gpus, (list, tuple)) else []


def _num(v):
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) else None


def evaluate(rules: HealthRules, node_name: str, history: list, now: float) -> list[Verdict]:
    """The verdicts for one node from its recent telemetry (oldest first; samples after `now`
    are ignored). At most one verdict per rule and GPU; off-bus first, then XIDs, ECC, row
    remapping and temperature."""
    samples = [s for s in history if isinstance(s, dict) and (_num(s.get("time")) or 0) <= now]
    if not samples:
        return []
    latest = samples[-1]
    out: list[Verdict] = []
    by_gpu: dict[int, list] = {}
    for s in samples:
        for g in _gpus(s):
            if isinstance(g, dict) and isinstance(g.get("index"), int):
                by_gpu.setdefault(g["index"], []).append((s.get("time") or 0, g))
    current = {g["index"]: g for g in _gpus(latest) if isinstance(g, dict) and isinstance(g.get("index"), int)}

    for i in sorted(by_gpu):
        # XIDs are events: the newest fatal one in the history; its sample time keeps the key new
        fatal = [(t, code) for t, s in by_gpu[i] for code in (s.get("xid_events") or [])
                 if code in rules.fatal_xids]
        hot = _hot(rules, by_gpu[i], latest.get("time"))
        out += _gpu_verdicts(rules, node_name, i, current.get(i, {}), fatal[-1] if fatal else None,
                             hot[1:] if hot else None)
    return out


def _gpu_verdicts(rules: HealthRules, node: str, i: int, g: dict, xid, hot) -> list[Verdict]:
    """One GPU's verdicts, in order: off-bus, the newest fatal `xid` ((sample time, code) or
    None), ECC, row remapping, and temperature (`hot`: (seconds held, temp) or None)."""
    out: list[Verdict] = []

    def add(rule: str, reason: str, key: str):
        action = getattr(rules, rule)
        if action != OFF:
            out.append(Verdict(gpu=i, action=action, reason=f"GPU {i}: {reason}",
                               key=f"gpu{i}:{key}", node=node, rule=rule))

    if g.get("off_bus"):
        add("off_bus", "fell off the bus (NVML: GPU is lost)", "off_bus")
    if xid:
        t, code = xid
        add("xid", f"XID {code} ({xid_meaning(code)})", f"xid{code}@{t}")
    dbe = _num(g.get("ecc_dbe_volatile"))
    if dbe is None:
        dbe = _num(g.get("ecc_dbe"))
    if dbe:
        add("ecc_dbe", f"{dbe} double-bit ECC error{'s' if dbe != 1 else ''} (uncorrectable)",
            f"ecc_dbe:{dbe}")
    if g.get("remap_failure"):
        add("remap_failure", "row remapping failed (the GPU needs a reset or repair)", "remap_failure")
    if hot:
        held, temp = hot
        add("temp", f"temperature {temp:g} °C over {rules.temp_c:g} °C for {held:.0f} s", "temp")
    return out


def _hot(rules: HealthRules, series: list, latest_time):
    """(start, seconds held, current temp) when the GPU's temperature has stayed over the
    threshold in every sample for at least the period, up to the latest sample."""
    if not series or series[-1][0] != latest_time:
        return None
    start = None
    for t, g in reversed(series):
        temp = _num(g.get("temp_c"))
        if temp is None or temp <= rules.temp_c:
            break
        start = t
    if start is None:
        return None
    held = latest_time - start
    if held < rules.temp_period_s:
        return None
    return start, held, series[-1][1]["temp_c"]


# ---------------------------------------------------------------- incremental

class _NodeHealth:
    """What the rules need from one node's last `window` samples, kept up to date per sample."""

    __slots__ = ("seq", "xids", "hot", "current", "latest_time")

    def __init__(self) -> None:
        self.seq = 0
        self.xids: deque = deque()  # (seq, sample time, gpu, code) of fatal XIDs, oldest first
        self.hot: dict[int, deque] = {}  # gpu -> (seq, time) of its current over-threshold run
        self.current: dict[int, dict] = {}  # gpu -> its fields in the latest sample
        self.latest_time = None


class HealthTracker:
    """`evaluate` kept up to date one sample at a time, in O(GPUs) per sample and O(fatal XIDs +
    hot samples) of memory per node instead of the whole history.

    Samples count in the order they arrive (a node whose clock runs ahead of the daemon's is not
    ignored); for samples stamped no later than `now`, `observe` returns exactly what
    `evaluate(rules, node, last rules.history_samples samples, now)` would.
    """

    def __init__(self, rules: HealthRules):
        self.rules = rules
        self._nodes: dict[str, _NodeHealth] = {}

    def observe(self, node: str, sample: dict) -> list[Verdict]:
        if not isinstance(sample, dict):
            return self.verdicts(node)
        st = self._nodes.get(node)
        if st is None:
            st = self._nodes[node] = _NodeHealth()
        st.seq += 1
        first = st.seq - self.rules.history_samples + 1  # the oldest sample still in the window
        st.latest_time = _num(sample.get("time"))  # a malformed time: no temperature verdict
        t = st.latest_time or 0
        current = {}
        for g in _gpus(sample):
            if not isinstance(g, dict) or not isinstance(g.get("index"), int):
                continue
            i = g["index"]
            current[i] = g
            events = g.get("xid_events")
            if isinstance(events, (list, tuple)):
                for code in events:
                    if isinstance(code, int) and code in self.rules.fatal_xids:
                        st.xids.append((st.seq, t, i, code))
            temp = _num(g.get("temp_c"))
            if temp is not None and temp > self.rules.temp_c:
                st.hot.setdefault(i, deque()).append((st.seq, t))
            else:
                st.hot.pop(i, None)
        st.current = current
        while st.xids and st.xids[0][0] < first:
            st.xids.popleft()
        for run in st.hot.values():
            while run and run[0][0] < first:
                run.popleft()
        return self.verdicts(node)

    def verdicts(self, node: str) -> list[Verdict]:
        """The verdicts after the node's latest sample (none for a node never heard of)."""
        st = self._nodes.get(node)
        if st is None or not st.seq:
            return []
        rules = self.rules
        newest_xid: dict[int, tuple] = {}
        for _, t, i, code in st.xids:
            newest_xid[i] = (t, code)
        out: list[Verdict] = []
        for i in sorted(set(st.current) | set(newest_xid)):
            g = st.current.get(i, {})
            run = st.hot.get(i)
            hot = None
            if run and i in st.current and st.latest_time is not None:
                held = st.latest_time - run[0][1]
                hot = (held, g["temp_c"]) if held >= rules.temp_period_s else None
            out += _gpu_verdicts(rules, node, i, g, newest_xid.get(i), hot)
        return out

    def forget(self, node: str) -> None:
        self._nodes.pop(node, None)


# ---------------------------------------------------------------- the history

# the fields a history keeps per GPU: what the rules read and what the sparklines draw
HISTORY_FIELDS = ("index", "util_gpu", "util_mem", "mem_used_mb", "mem_total_mb", "temp_c",
                  "power_w", "sm_clock_mhz", "xid_events", "ecc_dbe_volatile", "ecc_dbe",
                  "remap_failure", "off_bus")


class TelemetryHistory:
    """Bounded telemetry history per node (and so per GPU): the last `maxlen` samples each.

    Only HISTORY_FIELDS are kept per GPU, so a 1,000-node cluster of 8 GPUs at 300 samples
    stays in the hundreds of megabytes; the latest full sample lives in the daemon.
    """

    def __init__(self, maxlen: int = 300):
        if maxlen < 1:
            raise ValueError(f"history length must be at least 1, not {maxlen}")
        self.maxlen = maxlen
        self._nodes: dict[str, deque] = {}

    def add(self, node: str, sample: dict) -> None:
        slim = {"time": sample.get("time"),
                "gpus": [{k: g.get(k) for k in HISTORY_FIELDS} for g in _gpus(sample) if isinstance(g, dict)]}
        self._nodes.setdefault(node, deque(maxlen=self.maxlen)).append(slim)

    def samples(self, node: str) -> list[dict]:
        """The node's samples, oldest first (empty for a node never heard of)."""
        return list(self._nodes.get(node, ()))

    def series(self, node: str, gpu: int, field: str, n: int | None = None) -> list:
        """The last n values (oldest first) of one GPU field, None where it was missing."""
        out = []
        for s in self._nodes.get(node, ()):
            value = None
            for g in s["gpus"]:
                if g.get("index") == gpu:
                    value = g.get(field)
                    break
            out.append(value)
        return out if n is None else out[len(out) - n:] if n > 0 else []

    def forget(self, node: str) -> None:
        self._nodes.pop(node, None)

    def nodes(self) -> list[str]:
        return sorted(self._nodes)
