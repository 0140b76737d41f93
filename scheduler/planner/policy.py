"""Scheduling policy configuration: typed settings parsed from trainyard.toml, with presets."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from .types import JobView, QueueView

ORDERS = ("fifo", "multifactor", "las", "srsf")
QUEUEINGS = ("strict", "best_effort")
PRESETS = ("fifo", "backfill", "fairshare", "las", "qssf")
# needs every job's true run time: only a replay of a trace has it
SIMULATION_PRESETS = (*PRESETS, "oracle")
DEFAULT_TEAM = "default"
QSSF_AGING = 8.0  # GPU-seconds of remaining service forgiven per second waited
QSSF_PREEMPT_RATIO = 16.0

_SLURM_TIME = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")


def parse_duration(value, key: str = "time") -> float:
    """Seconds from a number of seconds or a Slurm time string: MM, MM:SS, HH:MM:SS, D-HH[:MM[:SS]]."""
    if isinstance(value, bool):
        raise ValueError(f"{key}: expected seconds or a time like 1:00:00, got {value!r}")
    if isinstance(value, int | float):
        if value < 0 or math.isnan(value):
            raise ValueError(f"{key}: must be >= 0 seconds, got {value!r}")
        return float(value)
    if not isinstance(value, str):
        raise ValueError(f"{key}: expected seconds or a time like 1:00:00, got {value!r}")
    text = value.strip()
    m = _SLURM_TIME.match(text)
    if not m:
        raise ValueError(
            f"{key}: cannot read {value!r} as a time limit; use seconds or MM, MM:SS, "
            "HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS"
        )
    days, a, b, c = m.groups()
    parts = [int(x) for x in (a, b, c) if x is not None]
    if days is not None:  # D-HH[:MM[:SS]]
        parts += [0] * (3 - len(parts))
        h, mi, s = parts
        return float(int(days) * 86400 + h * 3600 + mi * 60 + s)
    if len(parts) == 1:  # MM
        return float(parts[0] * 60)
    if len(parts) == 2:  # MM:SS
        return float(parts[0] * 60 + parts[1])
    h, mi, s = parts
    return float(h * 3600 + mi * 60 + s)


@dataclass(frozen=True, slots=True)
class PriorityWeights:
    """Slurm's PriorityWeight* knobs for the multifactor order. Factors are in [0, 1]."""

    age: float = 1000.0
    fairshare: float = 0.0
    job_size: float = 0.0
    queue: float = 10000.0  # Slurm's PriorityWeightPartition
    max_age_s: float = 7 * 86400.0  # PriorityMaxAge: age factor is 1.0 from here on
    favor_small: bool = False  # PriorityFavorSmall: size factor grows as jobs shrink


@dataclass(frozen=True, slots=True)
class QueuePolicy:
    """How one queue (Slurm partition + QOS) is scheduled."""

    name: str
    priority: int = 0
    open: bool = True
    default_time_limit_s: float | None = None
    max_time_limit_s: float | None = None
    preempts: tuple[str, ...] = ()  # queues whose running jobs this queue's jobs may preempt
    grace_period_s: float | None = None  # for this queue's jobs when preempted; None: scheduler's
    node_selector: Mapping[str, str] = field(default_factory=dict)  # labels a node needs to serve this queue

    def view(self) -> QueueView:
        return QueueView(
            self.name, self.priority, self.open, self.default_time_limit_s, self.max_time_limit_s
        )


@dataclass(frozen=True, slots=True)
class TeamQuota:
    """A team's GPU quota, Kueue-style: nominal, how much it may borrow and lend in its cohort."""

    name: str
    nominal_gpus: int | None = None  # None: no quota
    borrowing_limit_gpus: int | None = None  # None: may borrow all the cohort lends
    lending_limit_gpus: int | None = None  # None: lends all of its unused nominal quota
    cohort: str | None = None
    fairshare: float = 1.0  # shares (Slurm's Fairshare= on the account)
    users: tuple[str, ...] = ()


@dataclass(frozen=True)
class PolicyConfig:
    """Everything the planner needs to know about how to schedule; built once from config."""

    name: str = "backfill"
    order: str = "multifactor"  # fifo | multifactor | las
    backfill: bool = True  # EASY backfill; needs time limits
    # without backfill: "strict" (a blocked head holds its queue, Kueue's StrictFIFO) or
    # "best_effort" (later jobs start whenever they fit, Kueue's BestEffortFIFO)
    queueing: str = "strict"
    preemption: bool = True
    # bounded work per pass, like Kueue's one head per queue per cycle: at most this many
    # blocked jobs look for victims in one pass; the rest try again next pass
    max_preemptors_per_pass: int = 16
    grace_period_s: float = 60.0
    default_time_limit_s: float | None = None
    fairshare_half_life_s: float = 7 * 86400.0
    weights: PriorityWeights = field(default_factory=PriorityWeights)
    las_thresholds_gpu_s: tuple[float, ...] = (3600.0, 36000.0)
    topology_keys: tuple[str, ...] = ("switch", "rack")
    queues: Mapping[str, QueuePolicy] = field(default_factory=dict)
    teams: Mapping[str, TeamQuota] = field(default_factory=dict)
    # once a queue's top job is blocked, at most this many jobs behind it are tried in one
    # pass (Slurm's default_queue_depth / bf_max_job_test); the rest wait with Priority
    queue_depth: int = 100
    # srsf: GPU-seconds of remaining service forgiven per second a job has waited (aging,
    # so long jobs are not starved); 0 is pure shortest-remaining-service-first
    srsf_aging: float = 0.0
    # srsf: preempt a running job only if its remaining service exceeds the waiting job's
    # this many times (plus the GPU-time its grace period costs); 1.0: whenever shorter
    srsf_preempt_ratio: float = 1.0
    # backfill: a job's predicted run time, where given and below its time limit, is its
    # expected end (the limit is still enforced)
    backfill_on_prediction: bool = False

    def __post_init__(self):
        if self.order not in ORDERS:
            raise ValueError(f"order: unknown order {self.order!r}; choose one of {', '.join(ORDERS)}")
        if self.queue_depth < 1:
            raise ValueError(f"queue_depth: must be >= 1, got {self.queue_depth!r}")
        if self.srsf_preempt_ratio < 1.0:
            raise ValueError(f"srsf_preempt_ratio: must be >= 1.0, got {self.srsf_preempt_ratio!r}")
        if self.queueing not in QUEUEINGS:
            raise ValueError(
                f"queueing: unknown strategy {self.queueing!r}; choose one of {', '.join(QUEUEINGS)}"
            )
        # user -> team, for jobs submitted without an account
        members = {u: t.name for t in self.teams.values() for u in t.users}
        object.__setattr__(self, "user_team", MappingProxyType(members))

    def team_of(self, job: JobView) -> str:
        return job.account or self.user_team.get(job.user, DEFAULT_TEAM)

    def queue(self, name: str) -> QueuePolicy:
        return self.queues.get(name) or QueuePolicy(name)

    def queue_views(self) -> dict[str, QueueView]:
        """The QueueViews a Snapshot should carry for the configured queues."""
        return {name: q.view() for name, q in self.queues.items()}

    def grace_for(self, job: JobView) -> float:
        g = self.queue(job.queue).grace_period_s
        return self.grace_period_s if g is None else g

    @classmethod
    def preset(cls, name: str, **overrides) -> PolicyConfig:
        """One of the named policies: fifo, backfill, fairshare, las, qssf (and oracle, which
        needs true run times as predictions: simulation only)."""
        if name == "fifo":
            base = cls(name="fifo", order="fifo", backfill=False)
        elif name == "backfill":
            base = cls(name="backfill")
        elif name == "fairshare":
            base = cls(
                name="fairshare",
                weights=PriorityWeights(age=1000.0, fairshare=10000.0, queue=100000.0),
            )
        elif name == "las":
            base = cls(name="las", order="las", backfill=False, queueing="best_effort")
        elif name == "qssf":
            # Helios' quasi-shortest-service-first on predicted run times, with aging and EASY
            # backfill on predictions. No preemption by default: on Philly it preempted more
            # than once per job for little gain (docs/simulation.md); `preemption = true`
            # turns it on, for a job with 16x less service left only
            base = cls(name="qssf", order="srsf", srsf_aging=QSSF_AGING, preemption=False,
                       srsf_preempt_ratio=QSSF_PREEMPT_RATIO, backfill_on_prediction=True)
        elif name == "oracle":
            base = cls(name="oracle", order="srsf", backfill=False, queueing="best_effort")
        else:
            raise ValueError(f"policy: unknown policy {name!r}; choose one of "
                             f"{', '.join(SIMULATION_PRESETS)}")
        return replace(base, **overrides) if overrides else base

    @classmethod
    def from_dict(cls, d: Mapping) -> PolicyConfig:
        """Parse a trainyard.toml document: [scheduler], [queues.NAME], [teams.NAME]."""
        return _parse(d)


_SCHEDULER_KEYS = {
    "queue_depth", "policy", "order", "backfill", "queueing", "preemption", "max_preemptors_per_pass", "grace_period", "default_time",
    "fairshare_half_life", "las_thresholds_gpu_hours", "topology_keys", "priority_weights",
}
_WEIGHT_KEYS = {"age", "fairshare", "job_size", "queue", "max_age", "favor_small"}
_QUEUE_KEYS = {
    "priority", "state", "default_time", "max_time", "preempts", "grace_period", "nodes",
}
_TEAM_KEYS = {"nominal_gpus", "borrowing_limit_gpus", "lending_limit_gpus", "cohort", "fairshare",
              "users"}


def _table(d, key: str) -> Mapping:
    value = d.get(key, {}) if isinstance(d, Mapping) else None
    if not isinstance(value, Mapping):
        raise ValueError(f"{key}: expected a table, got {value!r}")
    return value


def _check_keys(section: Mapping, allowed: set[str], where: str) -> None:
    for key in section:
        if key not in allowed:
            raise ValueError(
                f"{where}.{key}: unknown setting (value {section[key]!r}); "
                f"known settings: {', '.join(sorted(allowed))}"
            )


def _bool(value, key: str) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{key}: expected true or false, got {value!r}")
    return value


def _number(value, key: str, minimum: float = 0.0) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < minimum:
        raise ValueError(f"{key}: expected a number >= {minimum:g}, got {value!r}")
    return float(value)


def _gpus(value, key: str) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{key}: expected a whole number of GPUs >= 0, got {value!r}")
    return value


def _names(value, key: str) -> tuple[str, ...]:
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list | tuple) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"{key}: expected a list of names, got {value!r}")
    return tuple(value)


def _labels(value, key: str) -> Mapping[str, str]:
    if not isinstance(value, Mapping) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise ValueError(f"{key}: expected a table of label = \"value\", got {value!r}")
    return MappingProxyType(dict(value))


def _parse(d: Mapping) -> PolicyConfig:
    if not isinstance(d, Mapping):
        raise ValueError(f"config: expected a table, got {d!r}")
    sched = _table(d, "scheduler")
    _check_keys(sched, _SCHEDULER_KEYS, "scheduler")
    name = sched.get("policy", "backfill")
    if name == "oracle":
        raise ValueError("scheduler.policy: 'oracle' knows every job's true run time and exists "
                         "only in `trainyard simulate`; use \"qssf\" (predicted run times)")
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"scheduler.policy: unknown policy {name!r}; choose one of {', '.join(PRESETS)}")
    base = PolicyConfig.preset(name)
    kw: dict = {}
    if "order" in sched:
        if sched["order"] not in ORDERS:
            raise ValueError(
                f"scheduler.order: unknown order {sched['order']!r}; choose one of {', '.join(ORDERS)}"
            )
        kw["order"] = sched["order"]
    if "queueing" in sched:
        if sched["queueing"] not in QUEUEINGS:
            raise ValueError(
                f"scheduler.queueing: unknown strategy {sched['queueing']!r}; "
                f"choose one of {', '.join(QUEUEINGS)}"
            )
        kw["queueing"] = sched["queueing"]
    for key in ("backfill", "preemption"):
        if key in sched:
            kw[key] = _bool(sched[key], f"scheduler.{key}")
    if "max_preemptors_per_pass" in sched:
        v = sched["max_preemptors_per_pass"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise ValueError(f"scheduler.max_preemptors_per_pass: expected a whole number >= 0, got {v!r}")
        kw["max_preemptors_per_pass"] = v
    if "queue_depth" in sched:
        v = sched["queue_depth"]
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"scheduler.queue_depth: expected a whole number >= 1, got {v!r}")
        kw["queue_depth"] = v
    if "grace_period" in sched:
        kw["grace_period_s"] = parse_duration(sched["grace_period"], "scheduler.grace_period")
    if "default_time" in sched:
        kw["default_time_limit_s"] = parse_duration(sched["default_time"], "scheduler.default_time")
    if "fairshare_half_life" in sched:
        hl = parse_duration(sched["fairshare_half_life"], "scheduler.fairshare_half_life")
        if hl <= 0:
            raise ValueError(f"scheduler.fairshare_half_life: must be > 0, got {sched['fairshare_half_life']!r}")
        kw["fairshare_half_life_s"] = hl
    if "las_thresholds_gpu_hours" in sched:
        raw = sched["las_thresholds_gpu_hours"]
        key = "scheduler.las_thresholds_gpu_hours"
        if not isinstance(raw, list | tuple):
            raise ValueError(f"{key}: expected a list of GPU-hours, got {raw!r}")
        hours = [_number(v, key) for v in raw]
        if hours != sorted(hours) or len(set(hours)) != len(hours):
            raise ValueError(f"{key}: thresholds must be strictly increasing, got {raw!r}")
        kw["las_thresholds_gpu_s"] = tuple(h * 3600.0 for h in hours)
    if "topology_keys" in sched:
        kw["topology_keys"] = _names(sched["topology_keys"], "scheduler.topology_keys")
    if "priority_weights" in sched:
        w = _table(sched, "priority_weights")
        _check_keys(w, _WEIGHT_KEYS, "scheduler.priority_weights")
        wk: dict = {}
        for key in ("age", "fairshare", "job_size", "queue"):
            if key in w:
                wk[key] = _number(w[key], f"scheduler.priority_weights.{key}")
        if "max_age" in w:
            ma = parse_duration(w["max_age"], "scheduler.priority_weights.max_age")
            if ma <= 0:
                raise ValueError(f"scheduler.priority_weights.max_age: must be > 0, got {w['max_age']!r}")
            wk["max_age_s"] = ma
        if "favor_small" in w:
            wk["favor_small"] = _bool(w["favor_small"], "scheduler.priority_weights.favor_small")
        kw["weights"] = replace(base.weights, **wk)

    queues: dict[str, QueuePolicy] = {}
    for qname, q in _table(d, "queues").items():
        where = f"queues.{qname}"
        if not isinstance(q, Mapping):
            raise ValueError(f"{where}: expected a table, got {q!r}")
        _check_keys(q, _QUEUE_KEYS, where)
        prio = q.get("priority", 0)
        if isinstance(prio, bool) or not isinstance(prio, int):
            raise ValueError(f"{where}.priority: expected a whole number, got {prio!r}")
        state = q.get("state", "open")
        if state not in ("open", "stopped"):
            raise ValueError(f"{where}.state: expected \"open\" or \"stopped\", got {state!r}")
        dt = parse_duration(q["default_time"], f"{where}.default_time") if "default_time" in q else None
        mt = parse_duration(q["max_time"], f"{where}.max_time") if "max_time" in q else None
        if dt is not None and mt is not None and dt > mt:
            raise ValueError(f"{where}.default_time: {q['default_time']!r} exceeds max_time {q['max_time']!r}")
        grace = parse_duration(q["grace_period"], f"{where}.grace_period") if "grace_period" in q else None
        queues[qname] = QueuePolicy(
            name=qname,
            priority=prio,
            open=state == "open",
            default_time_limit_s=dt,
            max_time_limit_s=mt,
            preempts=_names(q.get("preempts", []), f"{where}.preempts"),
            grace_period_s=grace,
            node_selector=_labels(q.get("nodes", {}), f"{where}.nodes"),
        )
    for q in queues.values():
        for victim in q.preempts:
            if victim not in queues:
                raise ValueError(f"queues.{q.name}.preempts: no queue named {victim!r} is configured")
            if victim == q.name:
                raise ValueError(f"queues.{q.name}.preempts: a queue cannot preempt itself ({victim!r})")

    teams: dict[str, TeamQuota] = {}
    seen_users: dict[str, str] = {}
    for tname, t in _table(d, "teams").items():
        where = f"teams.{tname}"
        if not isinstance(t, Mapping):
            raise ValueError(f"{where}: expected a table, got {t!r}")
        _check_keys(t, _TEAM_KEYS, where)
        nominal = _gpus(t.get("nominal_gpus"), f"{where}.nominal_gpus")
        borrow = _gpus(t.get("borrowing_limit_gpus"), f"{where}.borrowing_limit_gpus")
        lend = _gpus(t.get("lending_limit_gpus"), f"{where}.lending_limit_gpus")
        if nominal is None and (borrow is not None or lend is not None):
            raise ValueError(f"{where}: borrowing/lending limits need nominal_gpus")
        if lend is not None and nominal is not None and lend > nominal:
            raise ValueError(f"{where}.lending_limit_gpus: {lend} exceeds nominal_gpus {nominal}")
        cohort = t.get("cohort")
        if cohort is not None and (not isinstance(cohort, str) or not cohort):
            raise ValueError(f"{where}.cohort: expected a cohort name, got {cohort!r}")
        users = _names(t.get("users", []), f"{where}.users")
        for u in users:
            if u in seen_users:
                raise ValueError(f"{where}.users: user {u!r} is already in team {seen_users[u]!r}")
            seen_users[u] = tname
        share = _number(t.get("fairshare", 1.0), f"{where}.fairshare")
        if share <= 0:
            raise ValueError(f"{where}.fairshare: must be > 0, got {t.get('fairshare')!r}")
        teams[tname] = TeamQuota(tname, nominal, borrow, lend, cohort, share, users)

    return replace(
        base, **kw, queues=MappingProxyType(queues), teams=MappingProxyType(teams)
    )
