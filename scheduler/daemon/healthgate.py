"""The health gate: active checks a node passes before it takes work (NVML sanity, DCGM, a GPU test job).

A node entering service (registered, resumed, bootstrapped, back after being DOWN or drained for
health) is held DRAINED with a reason that starts with GATE_REASON while its checks run; it goes
UP only when every check passed, and stays DRAINED with the failing check as its reason
otherwise. The checks that need the node run there as short jobs of the agent under keys that
start with GATE_KEY (the ordinary `launch` op: no extra agent op, and the process is fenced and
reported like any job). The outcome is kept on the node (`Node.health_checks`).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from sqlmodel import select

from .. import models as m
from ..models import Node
from .clock import Clock
from .errors import DomainError
from .links import NodeLinks
from .state import StateStore

log = logging.getLogger("trainyard.daemon")

GATE_REASON = "health gate: "
GATE_KEY = "gate-"
PASS, FAIL, SKIP = "pass", "fail", "skip"
PENDING, RUNNING, PASSED, FAILED = "pending", "running", "passed", "failed"
DCGM_ABSENT = "trainyard-gate: dcgmi is not installed"
ABSENT_RC = 127


@dataclass(frozen=True)
class GateConfig:
    """[gate] as the gate uses it (scheduler/settings.py validates the table)."""

    nvml: bool = True
    dcgm: str = "auto"  # "auto": run `dcgmi diag` where dcgmi is installed; "off"
    dcgm_level: int = 1
    test_command: tuple[str, ...] = ()  # a GPU test job; its exit code decides
    check_timeout_s: float = 600.0
    telemetry_timeout_s: float = 30.0
    period_s: float = 0.0  # re-check idle UP nodes this often; 0: never
    user: str = "nobody"  # the account checks run as where the agent starts jobs as owners
    resume_wait_s: float = 8.0  # how long `node resume` waits for the outcome before answering
    max_temp_c: float = 90.0


    @classmethod
    def from_settings(cls, gate, max_temp_c: float = 90.0) -> GateConfig:
        """From the validated [gate] table (scheduler/settings.py GateSettings)."""
        return cls(nvml=gate.nvml, dcgm=gate.dcgm, dcgm_level=gate.dcgm_level,
                   test_command=tuple(gate.test_command), check_timeout_s=gate.check_timeout,
                   telemetry_timeout_s=gate.telemetry_timeout, period_s=gate.period, user=gate.user,
                   resume_wait_s=gate.resume_wait, max_temp_c=max_temp_c)


@dataclass(frozen=True)
class CheckResult:
    check: str
    result: str  # pass, fail or skip
    detail: str = ""
    duration_s: float = 0.0


# ------------------------------------------------------------------------------ NVML sanity
def nvml_sanity(sample: dict | None, expected_gpus: int, max_temp_c: float = 90.0) -> CheckResult:
    """Judge one telemetry sample: every expected GPU present, no pending row remap or uncorrected
    ECC, clocks and power plausible. Pure: the sample is what the agent read from NVML."""
    if not sample or sample.get("source") in (None, "none", "declared"):
        source = (sample or {}).get("source") or "none"
        return CheckResult("nvml", SKIP, f"the node reports no NVML telemetry (source {source})")
    gpus = [g for g in sample.get("gpus", []) if isinstance(g, dict)]
    present = [g for g in gpus if not g.get("off_bus")]
    problems = []
    if expected_gpus and len(present) < expected_gpus:
        gone = sorted(g.get("index") for g in gpus if g.get("off_bus"))
        problems.append(f"{len(present)} of {expected_gpus} expected GPUs present"
                        + (f" (off the bus: {', '.join(map(str, gone))})" if gone else ""))
    for g in present:
        i = g.get("index")
        if g.get("remap_pending"):
            problems.append(f"GPU {i}: row remap pending (reset the GPU)")
        if g.get("remap_failure"):
            problems.append(f"GPU {i}: row remapping failed")
        dbe = g.get("ecc_dbe_volatile") if g.get("ecc_dbe_volatile") is not None else g.get("ecc_dbe")
        if dbe:
            problems.append(f"GPU {i}: {dbe} uncorrected ECC error{'s' if dbe != 1 else ''}")
        clock = g.get("sm_clock_mhz")
        if clock is not None and clock <= 0:
            problems.append(f"GPU {i}: SM clock {clock} MHz")
        power, limit = g.get("power_w"), g.get("power_limit_w")
        if power is not None and (power <= 0 or (limit and power > 1.1 * limit)):
            problems.append(f"GPU {i}: power {power:g} W" + (f" against a {limit:g} W limit" if limit else ""))
        temp = g.get("temp_c")
        if temp is not None and temp >= max_temp_c:
            problems.append(f"GPU {i}: {temp:g} °C at idle (limit {max_temp_c:g} °C)")
    if problems:
        return CheckResult("nvml", FAIL, "; ".join(problems))
    return CheckResult("nvml", PASS, f"{len(present)} GPUs sane")


def dcgm_argv(level: int) -> list[str]:
    """`dcgmi diag -r LEVEL` where dcgmi is installed; otherwise exit ABSENT_RC saying so."""
    return ["/bin/sh", "-c", f'command -v dcgmi >/dev/null 2>&1 || {{ echo "{DCGM_ABSENT}"; '
            f'exit {ABSENT_RC}; }}; exec dcgmi diag -r {int(level)}']


def last_line(text: str, limit: int = 300) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return (lines[-1] if lines else "")[:limit]


# ------------------------------------------------------------------------------ the gate
class HealthGate:
    """Runs each node's checks, one run per node at a time, and moves the node UP or keeps it out."""

    def __init__(self, store: StateStore, links: NodeLinks, clock: Clock, config: GateConfig,
                 wake: Callable[[], None]):
        self.store = store
        self.links = links
        self.clock = clock
        self.config = config
        self.wake = wake
        self.runs: dict[str, asyncio.Task] = {}
        self._samples: dict[str, asyncio.Event] = {}
        self._exits: dict[str, asyncio.Future] = {}
        self._seq = itertools.count(1)

    # ------------------------------------------------------------------ agent events
    def observe(self, node: str, sample: dict) -> None:
        """A telemetry sample arrived: wake a run that waits for one."""
        ev = self._samples.get(node)
        if ev is not None:
            ev.set()

    @staticmethod
    def owns(key: Any) -> bool:
        return isinstance(key, str) and key.startswith(GATE_KEY)

    def on_agent_event(self, node: str, msg: dict) -> None:
        """`started`, `exited` or `launch_failed` of a check job."""
        fut = self._exits.get(msg.get("key", ""))
        if msg.get("ev") == "started" or fut is None or fut.done():
            if msg.get("ev") == "exited" and fut is None:  # a check nobody waits for (daemon restarted)
                self.links.send(node, {"op": "forget", "keys": [msg.get("key")]})
            return
        fut.set_result(msg)

    def on_hello(self, node: Node | None) -> None:
        """After the agent's hello recorded the node (`node` as committed, None if removed): a
        node that is UP but not yet checked (added, back from DOWN or bootstrap), or whose
        checks were cut short, is held and checked."""
        if node is None or node.name in self.runs:
            return
        status = (node.health_checks or {}).get("status", PENDING)
        held = node.state == m.DRAINED and node.reason.startswith(GATE_REASON + "checking")
        if status == PASSED or not (node.state == m.UP or held):
            return
        self.start(node.name, (node.health_checks or {}).get("trigger") or "node entering service")

    # ------------------------------------------------------------------ runs
    def running(self, name: str) -> bool:
        return name in self.runs

    def cancel(self, name: str) -> None:
        """Stop a run whose outcome no longer matters (node removed, DOWN, resumed by force)."""
        task = self.runs.pop(name, None)
        if task is not None:
            task.cancel()

    def invalidate(self, node: Node) -> None:
        """The node left service (DOWN, bootstrap, health drain): it must pass the gate again."""
        checks = dict(node.health_checks or {})
        if checks.get("status") != PENDING:
            checks["status"] = PENDING
            node.health_checks = checks

    def hold(self, s, node: Node, trigger: str) -> None:
        """Take the node out of scheduling while its checks run (in the caller's transaction)."""
        node.state, node.reason = m.DRAINED, f"{GATE_REASON}checking ({trigger})"
        node.health_checks = {**(node.health_checks or {}), "status": RUNNING, "trigger": trigger,
                              "started": self.clock.time()}
        s.add(node)
        self.store.record(s, "trainyard", "node.gate.start", node.name, {"trigger": trigger})

    def start(self, name: str, trigger: str, held: bool = False) -> asyncio.Task:
        """Hold the node (unless the caller did) and run its checks in the background."""
        if name in self.runs:
            return self.runs[name]
        if not held:
            with self.store.tx() as s:
                node = s.get(Node, name)
                if node is None:
                    raise DomainError(f"node {name!r} does not exist")
                self.hold(s, node, trigger)
        task = asyncio.get_running_loop().create_task(self._run(name, trigger), name=f"gate-{name}")
        self.runs[name] = task
        task.add_done_callback(lambda t: self.runs.pop(name) if self.runs.get(name) is t else None)
        return task

    async def _run(self, name: str, trigger: str) -> dict:
        results: list[CheckResult] = []
        try:
            results.append(await self._nvml(name))
            if not any(r.result == FAIL for r in results) and self.config.dcgm != "off":
                results.append(await self._dcgm(name))
            if not any(r.result == FAIL for r in results) and self.config.test_command:
                results.append(await self._test_job(name))
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug or a lost link must not leave the node held for ever
            log.exception("node %s: health gate failed", name)
            results.append(CheckResult("gate", FAIL, f"{type(e).__name__}: {e}"))
        return self._conclude(name, trigger, results)

    def _conclude(self, name: str, trigger: str, results: list[CheckResult]) -> dict:
        failed = next((r for r in results if r.result == FAIL), None)
        outcome = {"status": FAILED if failed else PASSED, "trigger": trigger, "time": self.clock.time(),
                   "checks": [asdict(r) for r in results]}
        with self.store.tx() as s:
            node = s.get(Node, name)
            if node is None:
                return outcome
            node.health_checks = outcome
            still_held = node.state == m.DRAINED and node.reason.startswith(GATE_REASON + "checking")
            if failed:
                if still_held or node.state == m.UP:
                    node.state = m.DRAINED
                    node.reason = f"{GATE_REASON}{failed.check} failed: {failed.detail}"[:500]
            elif still_held:
                up = self.links.connected(name)
                node.state, node.reason = (m.UP, "") if up else (m.DOWN, "connecting")
            s.add(node)
            self.store.record(s, "trainyard", "node.gate", name,
                              {"status": outcome["status"], "trigger": trigger, "state": node.state,
                               "checks": outcome["checks"]})
        self.wake()
        return outcome

    async def _nvml(self, name: str) -> CheckResult:
        if not self.config.nvml:
            return CheckResult("nvml", SKIP, "turned off ([gate] nvml = false)")
        t0 = self.clock.monotonic()
        ev = self._samples.setdefault(name, asyncio.Event())
        ev.clear()
        try:  # a fresh sample, read after the node entered the gate
            await asyncio.wait_for(ev.wait(), self.config.telemetry_timeout_s)
        except TimeoutError:
            return CheckResult("nvml", FAIL, f"no telemetry within {self.config.telemetry_timeout_s:g} s")
        finally:
            self._samples.pop(name, None)
        with self.store.read() as s:
            node = s.get(Node, name)
            expected = max(node.gpus_expected, node.gpus_total) if node is not None else 0
        r = nvml_sanity(self.links.telemetry.get(name), expected, self.config.max_temp_c)
        return CheckResult(r.check, r.result, r.detail, round(self.clock.monotonic() - t0, 3))

    async def _dcgm(self, name: str) -> CheckResult:
        rc, out, took = await self._check_job(name, "dcgm", dcgm_argv(self.config.dcgm_level))
        if rc == ABSENT_RC and DCGM_ABSENT in out:
            return CheckResult("dcgm", SKIP, "dcgmi is not installed on the node", took)
        return self._judge("dcgm", rc, out, took, f"dcgmi diag -r {self.config.dcgm_level}")

    async def _test_job(self, name: str) -> CheckResult:
        rc, out, took = await self._check_job(name, "test", list(self.config.test_command))
        return self._judge("test job", rc, out, took, " ".join(self.config.test_command)[:80])

    @staticmethod
    def _judge(check: str, rc: Any, out: str, took: float, what: str) -> CheckResult:
        if isinstance(rc, str):  # the job never ran, or ran out of time
            return CheckResult(check, FAIL, rc, took)
        if rc == 0:
            return CheckResult(check, PASS, f"{what}: exit 0", took)
        tail = last_line(out)
        return CheckResult(check, FAIL, f"{what}: exit {rc}" + (f": {tail}" if tail else ""), took)

    async def _check_job(self, name: str, check: str, argv: list[str]) -> tuple[Any, str, float]:
        """Run argv on the node as a check job; (exit code or why it did not end, output, seconds)."""
        key = f"{GATE_KEY}{check}-{int(self.clock.time())}-{next(self._seq)}"
        with self.store.read() as s:
            node = s.get(Node, name)
            gpus = list(node.gpu_indices) if node is not None else []
            as_owners = bool(node is not None and (node.agent_info or {}).get("jobs_as_owners"))
        t0 = self.clock.monotonic()
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        self._exits[key] = fut
        launch = {"op": "launch", "key": key, "argv": argv, "gpus": gpus, "env": {},
                  "user": self.config.user if as_owners else None}
        try:
            if not self.links.send(name, launch):
                return f"cannot start the {check} check: node {name} is not connected", "", 0.0
            try:
                msg = await asyncio.wait_for(fut, self.config.check_timeout_s)
            except TimeoutError:
                self.links.send(name, {"op": "signal", "key": key, "sig": "KILL"})
                return "check timed out", "", round(self.clock.monotonic() - t0, 3)
        finally:
            self._exits.pop(key, None)
        took = round(self.clock.monotonic() - t0, 3)
        if msg.get("ev") == "launch_failed":
            self.links.send(name, {"op": "forget", "keys": [key]})
            return f"the {check} check could not start: {msg.get('reason', '')}", "", took
        out = ""
        with contextlib.suppress(DomainError):
            reply = await self.links.request(name, {"op": "log", "key": key, "offset": 0, "limit": 65536},
                                             timeout=10)
            out = str(reply.get("data", ""))
        self.links.send(name, {"op": "forget", "keys": [key]})
        rc = msg.get("rc")
        return (rc if rc is not None else f"the {check} check ended without an exit status"), out, took

    # ------------------------------------------------------------------ periodic re-checks
    def recheck_idle(self, now: float) -> list[str]:
        """Start a re-check on every UP node without jobs whose last check is older than the period."""
        if self.config.period_s <= 0:
            return []
        due = []
        with self.store.read() as s:
            for node in s.exec(select(Node).where(Node.state == m.UP)).all():
                checks = node.health_checks or {}
                if node.name in self.runs or self.store.active.on(node.name):
                    continue
                if checks.get("status") == PASSED and now - float(checks.get("time") or 0) < self.config.period_s:
                    continue
                due.append(node.name)
        for name in due:
            self.start(name, "periodic re-check")
        return due

    async def stop(self) -> None:
        for task in list(self.runs.values()):
            task.cancel()
        for task in list(self.runs.values()):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
