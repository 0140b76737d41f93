"""Run-time prediction in the daemon: learn from the jobs that end, predict each job at submit.

What counts as a past run, and why:

- COMPLETED, FAILED, OUT_OF_MEMORY, TIMEOUT and CANCELLED jobs that ran count. The prediction
  is used for how long a job will hold its GPUs (backfill, estimated starts, QSSF's order), and
  a job that fails, hits its limit or is cancelled held them for exactly that long.
- NODE_FAIL does not count: the node's fault says nothing about the job. A job that never ran
  (cancelled while pending) has no run time. An attempt that fails and is retried is not a run
  of its own: the job is counted once, when it ends for good.
- A requeued job (preempted, retried, requeued by hand) counts in total, over all its attempts:
  the planner subtracts the service a job has already had from its prediction, so the
  prediction must be for the whole job.

The history is the database: a starting daemon learns from the last `WARM_UP_JOBS` finished jobs
in the order they ended, so a prediction survives a restart.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from sqlalchemy import select as sa_select

from .. import models as m
from ..models import Job
from ..predict import JobFeatures, Prediction, Predictor
from .state import StateStore, state_among

log = logging.getLogger("trainyard.daemon")

OBSERVED_STATES = frozenset({m.COMPLETED, m.FAILED, m.OUT_OF_MEMORY, m.TIMEOUT, m.CANCELLED})
WARM_UP_JOBS = 50_000  # finished jobs read at start: at 32 runs a key, more changes little
NO_HISTORY = "no finished jobs yet: planned with its time limit"

_T = Job.__table__.c
_HISTORY_COLUMNS = (_T.id, _T.user, _T.name, _T.queue, _T.account, _T.gpus, _T.nodes, _T.state,
                    _T.attained_gpu_s, _T.start_time, _T.end_time)


def job_features(user: str, name: str, queue: str, account: str, gpus: int, nodes: int) -> JobFeatures:
    """What a job is known by at submit: its user, name, team (else queue) and GPUs in all."""
    return JobFeatures(user, name or "", account or queue, gpus * nodes)


def total_runtime(gpus: int, nodes: int, attained_gpu_s: float, start: float | None,
                  end: float | None) -> float | None:
    """Seconds the job ran over all its attempts; None if it never ran."""
    if gpus * nodes > 0 and attained_gpu_s > 0:
        return attained_gpu_s / (gpus * nodes)
    if start is not None and end is not None:  # a CPU-only job: its last attempt
        return max(0.0, end - start)
    return None


def planning_runtime(predicted_s: float | None, confident: bool, limit_s: float | None) -> float | None:
    """The run time the planner may use: a confident prediction, never past the time limit
    (which is still enforced)."""
    if predicted_s is None or not confident:
        return None
    return min(predicted_s, limit_s) if limit_s else predicted_s


def estimate_basis(uses_predictions: bool) -> str:
    """What a pending job's estimated start is computed from under the daemon's policy."""
    if uses_predictions:
        return "predicted run times of running jobs where confident, else their time limits"
    return "time limits of running jobs"


def warm_up_query(n: int):
    """The last `n` finished jobs whose run time counts, newest first: the end_time index read
    backwards until n of them are found; the states never lead (`state_among`: their index
    would read every finished job ever run and sort them, 1.5 s at 500,000, when a new leader
    takes office)."""
    return (sa_select(*_HISTORY_COLUMNS)
            .where(state_among(OBSERVED_STATES), _T.end_time.is_not(None))
            .order_by(_T.end_time.desc(), _T.id.desc()).limit(n))


class RunTimePrediction:
    """Owns the daemon's Predictor: warmed from the database, fed by job ends, asked at submit."""

    def __init__(self, store: StateStore, predictor: Predictor | None = None,
                 warm_up_jobs: int = WARM_UP_JOBS):
        self.store = store
        self.predictor = predictor or Predictor()
        self.warm_up_jobs = warm_up_jobs
        self._ended: dict[int, object] = {}  # job id -> its snapshot, ended since the last prediction

    def warm_up(self) -> int:
        """Learn from the last `warm_up_jobs` finished jobs, oldest first; how many ran."""
        t0 = time.perf_counter()
        with self.store.engine.connect() as conn:
            rows = conn.execute(warm_up_query(self.warm_up_jobs)).all()
        # learned into a new model that replaces the old one at the end: a PostgreSQL daemon warms
        # up in a thread when it takes office, while its API may already be predicting
        old = self.predictor
        model = Predictor(old.quantile, old.window, old.min_samples)
        learned = 0
        features: dict[tuple, JobFeatures] = {}  # a history repeats few (user, name, size)s
        observe = model.observe
        for _id, user, name, queue, account, gpus, nodes, _state, attained, start, end in reversed(rows):
            runtime = total_runtime(gpus, nodes, attained, start, end)
            if runtime is None:
                continue
            key = (user, name, queue, account, gpus, nodes)
            f = features.get(key)
            if f is None:
                f = features[key] = job_features(*key)
            observe(f, runtime)
            learned += 1
        self.predictor = model
        read = {r[0] for r in rows}  # ended before the read: already learned above
        self._ended = {k: v for k, v in self._ended.items() if k not in read}
        log.info("run-time prediction: learned from %d finished jobs in %.0f ms", learned,
                 1000 * (time.perf_counter() - t0))
        return learned

    def on_job_state(self, seen, old: str) -> None:
        """StateStore hook (after the commit, with the job's snapshot): a job that ended is
        learned from at the next prediction, unless a later change of the same transaction put
        it back to PENDING (a failed attempt that is retried is not the end of the job). No
        database read: a burst of 1,000 job ends costs 1,000 dict writes."""
        if seen.state in OBSERVED_STATES:
            self._ended[seen.id] = seen
        elif seen.state == m.PENDING:
            self._ended.pop(seen.id, None)

    def _learn(self) -> None:
        ended, self._ended = self._ended, {}
        for seen in ended.values():
            runtime = total_runtime(seen.gpus, seen.nodes, seen.attained_gpu_s, seen.start_time,
                                    seen.end_time)
            if runtime is not None:
                self.predictor.observe(job_features(seen.user, seen.name, seen.queue, seen.account,
                                                    seen.gpus, seen.nodes), runtime)

    def predict(self, features: JobFeatures) -> Prediction | None:
        if self._ended:
            self._learn()
        return self.predictor.predict(features)

    def columns(self, values: dict[str, Any]) -> dict[str, Any]:
        """The prediction columns of a job about to be inserted (its submit values)."""
        p = self.predict(job_features(values["user"], values["name"], values["queue"],
                                      values.get("account") or "", values["gpus"], values["nodes"]))
        if p is None:
            return {"predicted_runtime_s": None, "prediction_basis": NO_HISTORY,
                    "prediction_confident": False}
        return {"predicted_runtime_s": p.seconds, "prediction_basis": p.explain(),
                "prediction_confident": p.confident}


def prediction_json(j, uses_predictions: bool) -> dict[str, Any]:
    """A job's prediction fields as the API shows them."""
    return {
        "predicted_runtime_s": getattr(j, "predicted_runtime_s", None),
        "prediction_basis": getattr(j, "prediction_basis", "") or None,
        "prediction_confident": bool(getattr(j, "prediction_confident", False)),
        "estimated_start_basis": estimate_basis(uses_predictions) if j.estimated_start else None,
    }
