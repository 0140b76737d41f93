"""Scheduling policy configuration: typed settings parsed from trainyard.toml, with presets."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType

from .types import JobView, QueueView

ORDERS = ("fifo", "multifactor", "las", "srsf")
QUEUEINGS = ("strict", "best_effort")
PRESETS = ("fifo", "backfill", "fairshare", "las", "las-budget", "qssf")
# needs every job's true run time: only a replay of a trace has it
SIMULATION_PRESETS = (*PRESETS, "oracle")
DEFAULT_TEAM = "default"
QSSF_AGING = 8.0  # GPU-seconds of remaining service forgiven per second waited
QSSF_PREEMPT_RATIO = 16.0
# las-budget's levels: 4, 8, 16, ... 8,192 GPU-hours of service
LAS_DOUBLING_GPU_S = tuple(4 * 3600.0 * 2**k for k in range(12))

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
    # las/srsf: a running job that the order has already preempted this many times is not
    # preempted by it again (it runs to its end); None: no cap. Queue tiers (`preempts`) and
    # quota reclaim are not capped
    max_preemptions_per_job: int | None = None
    # las: a running job may be preempted by the order once per level it has reached (once
    # past the first threshold, again past the second, ...): a preemption budget that grows
    # with the service a job has had, so short jobs are never preempted and long ones rarely
    las_preempt_once_per_level: bool = False

    def __post_init__(self):
        if self.order not in ORDERS:
            raise ValueError(f"order: unknown order {self.order!r}; choose one of {', '.join(ORDERS)}")
        if self.queue_depth < 1:
            raise ValueError(f"queue_depth: must be >= 1, got {self.queue_depth!r}")
        if self.max_preemptions_per_job is not None and self.max_preemptions_per_job < 0:
            raise ValueError("max_preemptions_per_job: must be >= 0 (or unset for no cap), got "
                             f"{self.max_preemptions_per_job!r}")
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
        """One of the named policies: fifo, backfill, fairshare, las, las-budget, qssf (and
        oracle, which needs true run times as predictions: simulation only)."""
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
        elif name == "las-budget":
            # LAS with a preemption budget: levels that double from 4 GPU-hours, and a job is
            # preempted at most once per level it reaches, so jobs under 4 GPU-hours are never
            # preempted and a job's preemptions grow with the log of its service
            base = cls(name="las-budget", order="las", backfill=False, queueing="best_effort",
                       las_thresholds_gpu_s=LAS_DOUBLING_GPU_S, las_preempt_once_per_level=True)
        elif name == "qssf":
            # Helios' quasi-shortest-service-first on predicted run times, with aging and EASY
            # backfill on predictions. No preemption by default: on Philly it preempted more
            # than once per job for little gain (docs/simulation.md); `preemption = true`
            # turns it on, for a job with 16x less service left only, once per job
            base = cls(name="qssf", order="srsf", srsf_aging=QSSF_AGING, preemption=False,
                       srsf_preempt_ratio=QSSF_PREEMPT_RATIO, backfill_on_prediction=True,
                       max_preemptions_per_job=1)
        elif name == "oracle":
            base = cls(name="oracle", order="srsf", backfill=False, queueing="best_effort")
        else:
            raise ValueError(f"policy: unknown policy {name!r}; choose one of "
                             f"{', '.join(SIMULATION_PRESETS)}")
        return replace(base, **overrides) if overrides else base
