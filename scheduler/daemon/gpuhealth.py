"""GPU health: apply the health rules to each telemetry sample; drain nodes, exclude GPUs."""

from __future__ import annotations

from collections.abc import Callable

from ..health import DRAIN_NODE, EXCLUDE_GPU, HealthRules, HealthTracker
from .clock import Clock


class HealthMonitor:
    """Acts once per cause: a verdict that persists is not acted on again; one that clears is forgotten."""

    def __init__(self, rules: HealthRules, clock: Clock, drain: Callable[[str, list[str]], None],
                 changed: Callable[[], None]):
        self.rules = rules
        self.clock = clock
        self._drain = drain
        self._changed = changed
        self.tracker = HealthTracker(rules)  # O(GPUs) per sample, not O(history)
        self.acted: dict[str, set[str]] = {}
        self.excluded: dict[str, dict[int, str]] = {}  # node -> GPU -> why it is out of allocation
        self.version = 0  # bumped whenever `excluded` changes

    def observe(self, node: str, sample: dict) -> None:
        verdicts = self.tracker.observe(node, sample)
        excluded = {g["index"]: "fell off the bus" for g in sample["gpus"] if g.get("off_bus")}
        for v in verdicts:
            if v.action == EXCLUDE_GPU:
                excluded[v.gpu] = v.reason
        if excluded != self.excluded.get(node, {}):
            self.excluded[node] = excluded
            self.version += 1
            self._changed()
        acted = self.acted.get(node, set())
        new = [v.reason for v in verdicts if v.key not in acted and v.action == DRAIN_NODE]
        self.acted[node] = {v.key for v in verdicts}
        if new:
            self._drain(node, new)

    def excluded_gpus(self, node: str) -> dict[int, str]:
        return self.excluded.get(node, {})

    def forget(self, node: str) -> None:
        self.tracker.forget(node)
        self.acted.pop(node, None)
        if self.excluded.pop(node, None) is not None:
            self.version += 1
