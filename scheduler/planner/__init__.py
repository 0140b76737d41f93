"""Pure scheduling policies: plan(snapshot, now, policy) -> decisions, with no I/O and no clock reads."""

from .arrays import parse_array
from .core import DEFAULT_POLICY, plan
from .dependencies import depends_on, parse_dependency
from .fairshare import UsageLedger
from .policy import PRESETS, PolicyConfig, PriorityWeights, QueuePolicy, TeamQuota
from .types import (
    ARRAY_TASK_LIMIT,
    BAD_CONSTRAINT,
    DEPENDENCY,
    DEPENDENCY_NEVER_SATISFIED,
    HELD,
    PRIORITY,
    QUEUE_STOPPED,
    QUOTA_LIMIT,
    REQ_NODE_NOT_AVAIL,
    RESOURCES,
    Decisions,
    JobView,
    NodeView,
    Preempt,
    QueueView,
    Snapshot,
    Start,
    Wait,
)

__all__ = [
    "ARRAY_TASK_LIMIT", "BAD_CONSTRAINT", "DEPENDENCY", "DEPENDENCY_NEVER_SATISFIED", "HELD",
    "PRIORITY", "QUEUE_STOPPED", "QUOTA_LIMIT", "REQ_NODE_NOT_AVAIL", "RESOURCES",
    "DEFAULT_POLICY", "PRESETS", "Decisions", "JobView", "NodeView", "PolicyConfig", "Preempt",
    "PriorityWeights", "QueuePolicy", "QueueView", "Snapshot", "Start", "TeamQuota",
    "UsageLedger", "Wait",
    "depends_on", "parse_array", "parse_dependency", "plan",
]
