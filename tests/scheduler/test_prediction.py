"""Run-time prediction in the daemon: learned from jobs that end, shown at submit, planned with."""

import io
import time

import pytest
from rich.console import Console
from sqlalchemy import insert
from textual.css.query import NoMatches
from textual.widgets import Static

from scheduler import models as m
from scheduler.daemon.clock import ManualClock
from scheduler.daemon.lifecycle import JobLifecycle, RankExit
from scheduler.daemon.links import NodeLinks
from scheduler.daemon.prediction import RunTimePrediction, planning_runtime
from scheduler.daemon.state import StateStore
from scheduler.models import Job
from scheduler.nodes import SshSettings
from scheduler.planner import PolicyConfig, UsageLedger
from scheduler.predict import Predictor
from scheduler.store import init_schema, make_engine
from tests.conftest import (
    SSHD,
    DaemonProc,
    SshdNode,
    add_sshd_node,
    require_or_skip,
    wait_for,
    wait_job,
)
from tui.app import TrainyardApp
from tui.backend import HttpBackend


# ----------------------------------------------------------------------------- the service
class World:
    """A real store and job lifecycle on SQLite, with the prediction hook wired as the daemon does."""

    def __init__(self, tmp_path, predictor: Predictor | None = None):
        self.engine = make_engine(str(tmp_path / "trainyard.db"))
        init_schema(self.engine)
        self.clock = ManualClock()
        self.store = StateStore(self.engine, self.clock)
        self.prediction = RunTimePrediction(self.store, predictor)
        self.store.on_job_state.append(self.prediction.on_job_state)
        links = NodeLinks(SshSettings(known_hosts=str(tmp_path / "known_hosts")), str(tmp_path / "key"),
                          self.clock, lambda *a: None, lambda *a: None)
        policy = PolicyConfig()
        self.lifecycle = JobLifecycle(self.store, links, self.clock, policy,
                                      UsageLedger(policy.fairshare_half_life_s), 1.0, lambda: None)

    def submit(self, name="train", user="alice", gpus=1, **kw) -> int:
        with self.store.tx() as s:
            job = Job(name=name, user=user, gpus=gpus, submit_time=self.clock.time(), **kw)
            s.add(job)
            s.flush()
            return job.id

    def run(self, job_id: int, seconds: float, rc: int | None = 0, kill_reason: str = "") -> str:
        """One attempt: start, run `seconds`, end with `rc` (or as `kill_reason` decides)."""
        with self.store.tx() as s:
            job = s.get(Job, job_id)
            job.allocation = [{"node": "n1", "gpus": list(range(job.gpus))}]
            job.start_time = self.clock.time()
            self.store.set_state(s, job, m.RUNNING)
        self.clock.advance(seconds)
        with self.store.tx() as s:
            job = s.get(Job, job_id)
            job.kill_reason = kill_reason
            self.lifecycle.finish(s, job, {"n1": RankExit(rc)})
            return job.state

    def predict(self, name="train", user="alice", gpus=1) -> dict:
        return self.prediction.columns({"user": user, "name": name, "queue": "default", "account": "",
                                        "gpus": gpus, "nodes": 1})


def test_a_job_that_ends_teaches_the_next_submit_its_run_time(tmp_path):
    w = World(tmp_path)
    for seconds in (100, 300, 200):
        w.run(w.submit(), seconds)
    guess = w.predict()
    assert guess == {"predicted_runtime_s": 200.0, "prediction_confident": True,
                     "prediction_basis": "3m20s (3 past runs of user alice's jobs named 'train')"}


def test_nothing_is_predicted_before_any_job_ended(tmp_path):
    guess = World(tmp_path).predict()
    assert guess["predicted_runtime_s"] is None and not guess["prediction_confident"]
    assert guess["prediction_basis"] == "no finished jobs yet: planned with its time limit"


def test_a_retried_failure_is_one_run_of_all_its_attempts(tmp_path):
    w = World(tmp_path, Predictor(min_samples=1))
    job = w.submit(retries=1)
    assert w.run(job, 100, rc=1) == m.PENDING  # failed, retried: not the end of the job
    assert w.predict()["predicted_runtime_s"] is None
    assert w.run(job, 50) == m.COMPLETED
    assert w.predict()["predicted_runtime_s"] == 150.0


def test_timeouts_and_cancelled_runs_count_but_node_failures_and_unrun_jobs_do_not(tmp_path):
    w = World(tmp_path, Predictor(min_samples=1))
    assert w.run(w.submit(), 30, kill_reason="node_fail") == m.NODE_FAIL
    never = w.submit()
    with w.store.tx() as s:  # cancelled while pending: it never ran
        job = s.get(Job, never)
        job.end_time = w.clock.time()
        w.store.set_state(s, job, m.CANCELLED, "cancelled by alice")
    assert w.predict()["predicted_runtime_s"] is None
    assert w.run(w.submit(time_limit_s=60), 61, kill_reason="timeout") == m.TIMEOUT
    assert w.run(w.submit(), 10, kill_reason="cancel") == m.CANCELLED
    assert w.predict()["prediction_basis"].startswith("1m01s (2 past runs of user alice's jobs named")


def _history(w: World, rows: list[dict]) -> None:
    base = dict(queue="default", state=m.COMPLETED, gpus=1, nodes=1, account="", allocation=[],
                constraint={}, env={}, nodelist=[], exclude=[], mail_type=[], container_mounts=[],
                recorded={}, submit_time=0.0, eligible_time=0.0)
    with w.engine.begin() as conn:
        conn.execute(insert(Job.__table__), [{**base, **r} for r in rows])


def test_warm_up_learns_the_history_in_the_order_jobs_ended(tmp_path):
    w = World(tmp_path, Predictor(window=4))
    # inserted newest first: only the end times say that the 10-second runs are the recent ones
    runs = [10.0] * 4 + [1000.0] * 8
    _history(w, [{"user": "alice", "name": "train", "start_time": 5000.0 - i * 2000,
                  "end_time": 5000.0 - i * 2000 + r, "attained_gpu_s": r} for i, r in enumerate(runs)])
    assert w.prediction.warm_up() == 12
    assert w.predict()["predicted_runtime_s"] == 10.0


def test_warm_up_reads_only_the_most_recent_jobs(tmp_path):
    w = World(tmp_path)
    w.prediction.warm_up_jobs = 5
    _history(w, [{"user": "alice", "name": "train", "start_time": float(i), "end_time": i + 60.0,
                  "attained_gpu_s": 60.0} for i in range(20)])
    assert w.prediction.warm_up() == 5
    assert w.predict()["prediction_basis"] == "1m00s (5 past runs of user alice's jobs named 'train')"


def test_warm_up_on_50000_finished_jobs(tmp_path):
    """Prints how long a starting daemon spends learning from a full history (no assertion on it)."""
    w = World(tmp_path)
    _history(w, [{"user": f"u{i % 300}", "name": f"job{i % 40}", "gpus": 1 << (i % 4),
                  "start_time": float(i), "end_time": i + 60.0 + i % 977,
                  "attained_gpu_s": (60.0 + i % 977) * (1 << (i % 4))} for i in range(50_000)])
    t0 = time.perf_counter()
    learned = w.prediction.warm_up()
    print(f"\nwarm-up: {learned} finished jobs learned in {time.perf_counter() - t0:.3f} s")
    assert learned == 50_000
    assert w.predict(user="u7", name="job7", gpus=8)["prediction_confident"]


def test_the_planner_gets_only_confident_predictions_and_never_past_the_time_limit():
    assert planning_runtime(120.0, False, 3600) is None
    assert planning_runtime(None, True, 3600) is None
    assert planning_runtime(120.0, True, 3600) == 120.0
    assert planning_runtime(7200.0, True, 3600) == 3600
    assert planning_runtime(7200.0, True, None) == 7200.0


# ----------------------------------------------------------------------------- a real daemon
def runtime(j: dict) -> float:
    return j["end_time"] - j["start_time"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A daemon on two sshd nodes whose admin has run three short jobs named `train`."""
    require_or_skip(SSHD is not None, "OpenSSH sshd is not installed (apt-get install openssh-server)")
    base = tmp_path_factory.mktemp("predict")
    d = DaemonProc(base).start()
    nodes = [SshdNode(base, f"n{i}", d.public_key).start() for i in (1, 2)]
    try:
        for n in nodes:
            add_sshd_node(d, n)
        c = d.client()
        ids = [c.submit({"command": ["sleep", s], "name": "train", "gpus": 1})["id"] for s in ("1", "2", "3")]
        runs = [wait_job(c, i, "COMPLETED", timeout=30) for i in ids]
        yield d, sorted(runtime(j) for j in runs)
    finally:
        d.stop()
        for n in nodes:
            n.stop()


def test_a_submitted_job_is_predicted_from_the_users_runs_of_that_name(trained):
    d, runs = trained
    c = d.client()
    job = c.submit({"command": ["sleep", "1"], "name": "train", "gpus": 1, "hold": True})
    assert runs[0] <= job["predicted_runtime_s"] <= runs[-1]
    assert job["prediction_confident"] is True
    user = job["user"]
    assert job["prediction_basis"].endswith(f"(3 past runs of user {user}'s jobs named 'train')")
    shown = d.cli("job", str(job["id"]), check=True).stdout
    line = next(ln.strip() for ln in shown.splitlines() if "PredictedRunTime" in ln)
    assert line == f"PredictedRunTime: {job['prediction_basis']}"
    as_json = c.job(job["id"])
    assert {k: as_json[k] for k in ("predicted_runtime_s", "prediction_basis", "prediction_confident")} == \
        {k: job[k] for k in ("predicted_runtime_s", "prediction_basis", "prediction_confident")}


def test_a_user_without_history_falls_back_and_says_so(trained):
    d, _ = trained
    admin = d.client()
    token = admin.create_token("bob", "user")["token"]
    job = d.client(token).submit({"command": ["sleep", "1"], "name": "train", "gpus": 1, "hold": True})
    basis = job["prediction_basis"]
    assert "(3 past runs of 1-GPU jobs in default)" in basis
    assert basis.endswith("too little history for user bob's jobs named 'train' (0), user bob's jobs (0)")
    shown = d.cli("job", str(job["id"]), token=token, check=True).stdout
    assert "too little history for user bob's jobs named 'train' (0)" in shown


async def test_the_tui_job_screen_shows_the_prediction_line(trained):
    d, _ = trained
    job = d.client().submit({"command": ["true"], "name": "train", "gpus": 1, "hold": True})
    app = TrainyardApp(HttpBackend(d.url, d.token), refresh=1.0, stream=False)
    async with app.run_test(size=(200, 40)) as pilot:
        app.open_job(job["id"])
        for _ in range(500):  # until the job screen has drawn the job (bounded; asserted below)
            if "predicted run time" in _spec_text(app):
                break
            await pilot.pause(0.02)
        lines = [ln.strip() for ln in _spec_text(app).splitlines() if ln.startswith("predicted run time")]
        assert len(lines) == 1 and lines[0].endswith(job["prediction_basis"])


def _spec_text(app) -> str:
    try:
        spec = app.screen.query_one("#job-spec", Static).content
    except NoMatches:
        return ""
    console = Console(width=200, file=io.StringIO(), record=True)
    console.print(spec)
    return console.export_text()


def test_the_history_survives_a_daemon_restart(trained):
    d, runs = trained
    before = d.client().submit({"command": ["true"], "name": "train", "gpus": 1, "hold": True})
    d.stop()
    d.start()
    c = d.client()
    after = c.submit({"command": ["true"], "name": "train", "gpus": 1, "hold": True})
    assert after["prediction_basis"] == before["prediction_basis"]
    assert runs[0] <= after["predicted_runtime_s"] <= runs[-1]
    assert c.job(before["id"])["prediction_basis"] == before["prediction_basis"]


# ----------------------------------------------------------------------------- backfill
QSSF_FIFO = """
[scheduler]
policy = "qssf"
order = "fifo"
"""


def test_a_job_predicted_short_is_backfilled_despite_a_huge_time_limit(daemon_factory, sshd_factory):
    """Two 4-GPU nodes; a running 4-GPU job (10 min limit) blocks a 2-node job, whose reservation
    starts when that limit runs out. Behind it, a job with a 10-hour limit but a 1-second run
    history is backfilled onto the free node; one with the same limit and no history is not."""
    d = daemon_factory(extra_config=QSSF_FIFO)
    for i in (1, 2):
        add_sshd_node(d, sshd_factory(f"n{i}", d.public_key))
    admin = d.client()
    bob = d.client(admin.create_token("bob", "user")["token"])
    carl = d.client(admin.create_token("carl", "user")["token"])
    try:
        _backfill_scenario(d, admin, bob, carl)
    finally:  # jobs run detached on the nodes: end them rather than leave them behind
        for j in admin.jobs():
            admin.cancel(j["id"])


def _backfill_scenario(d, admin, bob, carl) -> None:
    quick = [admin.submit({"command": ["sleep", "1"], "name": "quick", "gpus": 2}) for _ in range(3)]
    for j in quick:
        wait_job(admin, j["id"], "COMPLETED", timeout=30)
    hog = bob.submit({"command": ["sleep", "300"], "name": "hog", "gpus": 4, "time_limit": "10:00"})
    assert not hog["prediction_confident"]  # bob's 4-GPU jobs have no history: its limit counts
    wait_job(admin, hog["id"], "RUNNING")
    big = bob.submit({"command": ["sleep", "1"], "name": "big", "gpus": 4, "nodes": 2, "time_limit": "10:00"})
    wait_for(lambda: admin.job(big["id"])["reason"] == "Resources", 15, what="big job waits for Resources")
    unknown = carl.submit({"command": ["sleep", "30"], "name": "sweep", "gpus": 3, "time_limit": "10:00:00"})
    short = admin.submit({"command": ["sleep", "30"], "name": "quick", "gpus": 2, "time_limit": "10:00:00"})
    assert short["prediction_confident"] and short["predicted_runtime_s"] < 60
    wait_job(admin, short["id"], "RUNNING", timeout=20)
    assert admin.job(unknown["id"])["state"] == "PENDING"
    assert admin.job(big["id"])["state"] == "PENDING"
    started = [e for e in admin.events(limit=1000)
               if e["action"] == "job.state" and e["target"] == str(short["id"])
               and e["detail"]["state"] == "CONFIGURING"]
    assert started and "backfill" in started[0]["detail"]["reason"]
    pending = admin.job(big["id"])
    assert pending["estimated_start_basis"].startswith("predicted run times")
    assert "(from predicted run times" in d.cli("job", str(big["id"]), check=True).stdout


def test_qssf_in_the_daemon_starts_the_job_predicted_shortest_first(daemon_factory, sshd_factory):
    """`policy = "qssf"`: when one node frees up, a job with a 1-second history goes before an
    older job that has no history and the same 10-hour limit."""
    d = daemon_factory(extra_config='\n[scheduler]\npolicy = "qssf"\n')
    for i in (1, 2):
        add_sshd_node(d, sshd_factory(f"n{i}", d.public_key))
    admin = d.client()
    bob = d.client(admin.create_token("bob", "user")["token"])
    try:
        quick = [admin.submit({"command": ["sleep", "1"], "name": "quick", "gpus": 4}) for _ in range(3)]
        for j in quick:
            wait_job(admin, j["id"], "COMPLETED", timeout=30)
        hogs = [bob.submit({"command": ["sleep", "300"], "name": "hog", "gpus": 4}) for _ in range(2)]
        for j in hogs:
            wait_job(admin, j["id"], "RUNNING")
        older = bob.submit({"command": ["sleep", "30"], "name": "sweep", "gpus": 3, "time_limit": "10:00:00"})
        short = admin.submit({"command": ["sleep", "30"], "name": "quick", "gpus": 4, "time_limit": "10:00:00"})
        assert not older["prediction_confident"]  # no 3-GPU job has run: all jobs answered
        bob.cancel(hogs[0]["id"])
        wait_job(admin, short["id"], "RUNNING", timeout=20)
        assert admin.job(older["id"])["state"] == "PENDING"
    finally:
        for j in admin.jobs():
            admin.cancel(j["id"])
