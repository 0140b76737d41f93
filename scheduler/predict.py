"""Run-time prediction from history: per-key quantiles backing off to coarser keys (Helios' QSSF).

Learned online: `observe()` a job when it ends, `predict()` a job when it is submitted; the
predictor never sees the future. Keys, finest first: the user's jobs of the same name, the
user's jobs, the queue's jobs of the same size, all jobs. The first key with at least
`min_samples` past runs answers, with the `quantile` of its last `window` run times, and says
which key that was and how many runs it saw, so a person can judge the number.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from scheduler.planner.types import JobView


@dataclass(frozen=True, slots=True)
class JobFeatures:
    """What a cluster knows about a job when it is submitted."""

    user: str
    name: str
    queue: str
    gpus: int  # all GPUs of the gang

    @classmethod
    def of(cls, job: JobView) -> JobFeatures:
        return cls(job.user, job.name, job.account or job.queue, job.gpus * job.nodes)


@dataclass(frozen=True, slots=True)
class Prediction:
    seconds: float
    basis: str  # the key that answered, e.g. "user alice, name 'train'"
    samples: int  # how many past runs that key has seen (up to the window)
    confident: bool  # a key finer than "all jobs" with enough history answered
    fallback: str = ""  # the finer keys that had too little history, in words

    def explain(self) -> str:
        """A sentence for `trainyard job ID`."""
        text = f"{_duration(self.seconds)} ({self.samples} past runs of {self.basis})"
        if self.fallback:
            text += f"; {self.fallback}"
        return text


class Predictor:
    """Per-key run-time history; `observe` finished jobs in time order, `predict` new ones."""

    def __init__(self, quantile: float = 0.5, window: int = 32, min_samples: int = 3):
        if not 0.0 < quantile < 1.0:
            raise ValueError(f"quantile: must be between 0 and 1, got {quantile!r}")
        if window < 1 or min_samples < 1 or min_samples > window:
            raise ValueError(f"need 1 <= min_samples <= window, got min_samples={min_samples!r}, "
                             f"window={window!r}")
        self.quantile = quantile
        self.window = window
        self.min_samples = min_samples
        self._runs: dict[tuple, deque[float]] = {}
        self._seen: dict[tuple, int] = {}

    @staticmethod
    def keys(f: JobFeatures) -> list[tuple[tuple, str]]:
        """(key, words) from the finest to the coarsest."""
        out = []
        if f.name:
            out.append((("user+name", f.user, f.name), f"user {f.user}'s jobs named {f.name!r}"))
        out.append((("user", f.user), f"user {f.user}'s jobs"))
        out.append((("queue+gpus", f.queue, f.gpus), f"{f.gpus}-GPU jobs in {f.queue}"))
        out.append((("global",), "all jobs"))
        return out

    def observe(self, features: JobFeatures, runtime_s: float) -> None:
        """Learn from a job that ended after running `runtime_s` seconds in all."""
        if runtime_s < 0:
            raise ValueError(f"runtime_s: must be >= 0, got {runtime_s!r}")
        for key, _ in self.keys(features):
            runs = self._runs.get(key)
            if runs is None:
                runs = self._runs[key] = deque(maxlen=self.window)
            runs.append(runtime_s)
            self._seen[key] = self._seen.get(key, 0) + 1

    def predict(self, features: JobFeatures) -> Prediction | None:
        """The likely run time, from the finest key with enough history; None before any."""
        short = []
        for key, words in self.keys(features):
            runs = self._runs.get(key)
            n = len(runs) if runs else 0
            if n >= self.min_samples or (key[0] == "global" and n):
                xs = sorted(runs)
                seconds = xs[min(n - 1, int(self.quantile * n))]
                fallback = (f"too little history for {', '.join(short)}" if short else "")
                return Prediction(seconds, words, n, key[0] != "global", fallback)
            short.append(f"{words} ({n})")
        return None


def _duration(seconds: float) -> str:
    s = int(round(seconds))
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    return (f"{d}-" if d else "") + f"{h:02d}:{s // 60:02d}:{s % 60:02d}"
