"""The planner's boundary: immutable snapshots in, decisions out (DESIGN.md boundary 1)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

EMPTY: Mapping = MappingProxyType({})

# Pending reasons, in Slurm's words.
PRIORITY = "Priority"
RESOURCES = "Resources"
QUOTA_LIMIT = "AssocGrpGRES"  # the team (account) is at its GPU quota
DEPENDENCY = "Dependency"
HELD = "Held"
QUEUE_STOPPED = "PartitionInactive"
DEPENDENCY_NEVER_SATISFIED = "DependencyNeverSatisfied"
BAD_CONSTRAINT = "BadConstraints"
# the nodes a job asked for (-w) cannot take it now
REQ_NODE_NOT_AVAIL = "ReqNodeNotAvail"
# an array task waits because its array already runs `%N` tasks (Slurm's word)
ARRAY_TASK_LIMIT = "JobArrayTaskLimit"


@dataclass(frozen=True, slots=True)
class NodeView:
    """A schedulable node as the planner sees it: what is free right now."""

    name: str
    gpus_total: int
    free_gpus: tuple[int, ...]  # GPU indices not allocated (and healthy)
    cpus_total: int = 0
    cpus_free: int = 0
    mem_total_mb: int = 0
    mem_free_mb: int = 0
    gpu_model: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    schedulable: bool = True  # False for DRAINING/DRAINED/DOWN nodes


@dataclass(frozen=True, slots=True)
class JobView:
    """A job as the planner sees it. `gpus` is per node; `nodes` is the gang size."""

    id: int
    user: str
    queue: str
    name: str = ""
    gpus: int = 0
    nodes: int = 1
    cpus: int = 1
    mem_mb: int = 0
    gpu_type: str | None = None
    priority: int = 0
    submit_time: float = 0.0
    held: bool = False
    # seconds; None means the queue's default limit applies
    time_limit_s: float | None = None
    # running jobs: when they started and where they run
    start_time: float | None = None
    allocation: tuple[tuple[str, tuple[int, ...]], ...] = ()
    # dependency expression, e.g. "afterok:12:13" or "singleton"; "" for none
    dependency: str = ""
    # extension points used by policies (issue 3); defaults keep issue-2 behaviour
    constraint: Mapping[str, str] = field(default_factory=dict)
    exclusive: bool = False
    nice: int = 0
    account: str = ""  # team; "" means the user's default team
    array_parent: int | None = None
    array_limit: int | None = None
    attained_gpu_s: float = 0.0  # GPU-seconds of service already received (LAS)
    preemptible: bool = True
    # Slurm's node selection: a feature expression (-C a100&ib, [a|b]; node labels are features),
    # nodes the job must use (-w) and nodes it must not (-x); "" and () for none
    features: str = ""
    nodelist: tuple[str, ...] = ()
    exclude: tuple[str, ...] = ()
    # running jobs only: when SIGTERM was sent for a preemption (None: not being preempted).
    # The planner treats the job's GPUs as freed at preempted_at + grace period.
    preempted_at: float | None = None
    # the run time the cluster expects from history (scheduler/predict.py), when it is
    # confident; None: unknown. SRSF orders by it; backfill uses it where it is below the limit
    predicted_runtime_s: float | None = None
    # how many times the scheduling order (LAS, SRSF) has preempted the job so far; a policy's
    # max_preemptions_per_job stops there
    preemptions: int = 0


@dataclass(frozen=True, slots=True)
class QueueView:
    name: str
    priority: int = 0
    open: bool = True  # False: QueueStopped
    default_time_limit_s: float | None = None
    max_time_limit_s: float | None = None


@dataclass(frozen=True, slots=True)
class Snapshot:
    nodes: tuple[NodeView, ...]
    pending: tuple[JobView, ...]  # both in any order: a pass orders them itself
    running: tuple[JobView, ...]
    queues: Mapping[str, QueueView] = field(default_factory=dict)
    # final state of jobs that pending jobs depend on (id -> "COMPLETED", "FAILED", ...)
    finished: Mapping[int, str] = field(default_factory=dict)
    # decayed usage in GPU-seconds, keyed "user:NAME" and "team:NAME" (fair share)
    usage: Mapping[str, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Start:
    job_id: int
    allocation: tuple[tuple[str, tuple[int, ...]], ...]  # ((node, (gpu, ...)), ...) rank order
    reason: str = ""  # why it starts now: "priority" or "backfill"
    detail: str = ""


@dataclass(frozen=True, slots=True)
class Preempt:
    job_id: int
    reason: str  # names the job it makes room for, e.g. "preempted for job 17 (queue high)"
    grace_period_s: float = 60.0  # SIGTERM, wait this long, then SIGKILL
    for_job: int | None = None  # the pending job the GPUs go to


@dataclass(frozen=True, slots=True)
class Wait:
    job_id: int
    reason: str  # one of the pending reasons above
    estimated_start: float | None = None
    detail: str = ""  # a sentence for people, e.g. "team vision uses 64 of its 64 nominal GPUs"


class Decisions:
    """What one pass decided. `waits` covers every pending job that neither starts nor is
    cancelled; under a long backlog most of them are built only when `waits` is first read
    (a replay that never reads them does not pay for them)."""

    __slots__ = ("starts", "preempts", "_waits", "cancels", "_deferred")

    def __init__(self, starts: list[Start] | None = None, preempts: list[Preempt] | None = None,
                 waits: list[Wait] | None = None, cancels: list[Wait] | None = None):
        self.starts = [] if starts is None else starts
        self.preempts = [] if preempts is None else preempts
        self._waits = [] if waits is None else waits
        # jobs the planner has found can never run (e.g. dependency failed): cancel with reason
        self.cancels = [] if cancels is None else cancels
        self._deferred: list[Callable[[], Iterable[Wait]]] = []

    def defer_waits(self, make: Callable[[], Iterable[Wait]]) -> None:
        """Add waits that are built the first time `waits` is read."""
        self._deferred.append(make)

    @property
    def waits(self) -> list[Wait]:
        if self._deferred:
            deferred, self._deferred = self._deferred, []
            for make in deferred:
                self._waits.extend(make())
        return self._waits

    @waits.setter
    def waits(self, value: list[Wait]) -> None:
        self._deferred = []
        self._waits = value

    def __eq__(self, other) -> bool:
        if not isinstance(other, Decisions):
            return NotImplemented
        return (self.starts, self.preempts, self.waits, self.cancels) == (
            other.starts, other.preempts, other.waits, other.cancels)

    def __repr__(self) -> str:
        return (f"Decisions(starts={self.starts!r}, preempts={self.preempts!r}, "
                f"waits={self.waits!r}, cancels={self.cancels!r})")
