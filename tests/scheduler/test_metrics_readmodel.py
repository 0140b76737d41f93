"""The daemon's read model for the metrics: one node's scrape (`/metrics/nodes/<node>`, which
Prometheus asks of every node each interval) reads that node and the jobs on it, and says the
same as the whole cluster's read does, on the leader (its in-memory index) and on a standby; the
GPU-seconds per team, summed by the database, are what every active job's sum gives. On SQLite
and on PostgreSQL."""

from __future__ import annotations

import pytest

from scheduler import models as m
from scheduler.config import DaemonConfig
from scheduler.daemon import Daemon, ManualClock
from scheduler.daemon.caller import Caller
from scheduler.daemon.jobs import JobFilter, JobRequest
from scheduler.daemon.lifecycle import RankExit
from scheduler.models import Node
from scheduler.simgpu import SimulatedGpus
from tests.conftest import fresh_pg_db

ADMIN = Caller("root", "admin")


@pytest.fixture(params=["sqlite", "postgresql"])
def daemon(request, tmp_path):
    db = ""  # SQLite in the daemon's home
    if request.param == "postgresql":  # the sums and the reads are SQL: both engines
        db = fresh_pg_db(request.getfixturevalue("postgres_url"), f"readmodel_{request.node.name}")
    d = Daemon(DaemonConfig(db=db), tmp_path / "home", clock=ManualClock())
    d.prepare()
    d.leadership.role = "leader"
    if db:  # on SQLite prepare() loaded the leader's state; here, as taking office would
        d._load_state()
    d.links.connected = lambda name: True  # nodes without agents: nothing is sent to them
    d.dispatcher.dispatch = lambda job: None
    with d.store.tx() as s:
        for i in range(4):
            s.add(Node(name=f"n{i}", address="127.0.0.1", state=m.UP, gpus_total=4,
                       gpu_indices=[0, 1, 2, 3], cpus=32, mem_mb=64000,
                       agent_info={"host": f"host-{i}", "driver_version": "550.54.15"}))
    d.store.load_index()
    yield d
    d.engine.dispose()


def per_node(d: Daemon) -> dict[str, dict[int, object]]:
    whole = d.readmodel.gpu_jobs()
    return {f"n{i}": {g: j for (n, g), j in whole.items() if n == f"n{i}"} for i in range(4)}


def test_one_nodes_jobs_and_facts_match_the_whole_clusters_read(daemon):
    d = daemon
    for req in (JobRequest(command=["true"], gpus=3), JobRequest(command=["true"], gpus=1),
                JobRequest(command=["true"], gpus=4, nodes=2), JobRequest(command=["true"], gpus=2)):
        d.jobs.submit(ADMIN, req)
    d.schedule_once()
    expected = per_node(d)
    assert sum(len(v) for v in expected.values()) == 3 + 1 + 8 + 2  # every GPU of every job
    assert len({j for v in expected.values() for j in v.values()}) == 4
    for name, gpus in expected.items():
        assert d.readmodel.gpu_jobs_on(name) == gpus, name
    assert d.readmodel.node("n2") == next(n for n in d.readmodel.nodes() if n.name == "n2")
    assert (d.readmodel.node("n2").hostname, d.readmodel.node("n2").driver_version) == ("host-2", "550.54.15")
    assert d.readmodel.node("nope") is None and d.readmodel.gpu_jobs_on("nope") == {}
    with d.store.tx() as s:  # the agent came back with a new driver: the next scrape says so
        node = s.get(Node, "n2")
        node.agent_info = {**node.agent_info, "driver_version": "570.86.10"}
    assert d.readmodel.node("n2").driver_version == "570.86.10"
    # a scrape of one node names the job on each GPU it holds there, and no other node's GPUs
    d.on_agent_message("n0", {"ev": "telemetry", "time": 5.0, "source": "simulated",
                              "gpus": SimulatedGpus(4).telemetry({}, {})})
    text = d.metrics.render_node("n0").decode()
    labelled = {line.split('gpu="')[1].split('"')[0]: line.split('hpc_job="')[1].split('"')[0]
                for line in text.splitlines() if line.startswith("DCGM_FI_DEV_GPU_UTIL{") and "hpc_job" in line}
    assert labelled == {str(g): str(j) for g, j in expected["n0"].items()}
    # a job that ends leaves its GPUs unlabelled at once; a standby (no index) reads the same
    first = next(iter(expected["n0"].values()))
    d.reconciler.on_started("n0", f"{first}.0")
    d.reconciler.on_exited("n0", f"{first}.0", RankExit(0), None)
    assert d.jobs.get(ADMIN, first)["state"] == m.COMPLETED
    expected = per_node(d)
    assert first not in {j for v in expected.values() for j in v.values()}
    for name, gpus in expected.items():
        assert d.readmodel.gpu_jobs_on(name) == gpus, name
    d.leadership.role = "standby"
    for name, gpus in expected.items():
        assert d.readmodel.gpu_jobs_on(name) == gpus, name
    assert len(d.jobs.list(ADMIN, JobFilter(all=False, states=frozenset(), user=None, queue=None,
                                            limit=100))) == 3


def reference_team_gpu_seconds(d: Daemon, finished: dict[str, float]) -> dict[str, float]:
    """Every active job read and summed in Python: what a scrape said before it summed in SQL."""
    from sqlmodel import col, select

    from scheduler.models import Job

    out, now = dict(finished), d.clock.time()
    with d.store.read() as s:
        for job in s.exec(select(Job).where(col(Job.state).in_(m.ACTIVE_STATES))).all():
            if job.start_time:
                team = job.account or d.readmodel.team_of(job.user)
                out[team] = out.get(team, 0.0) + job.gpus * len(job.allocation) * max(0.0, now - job.start_time)
    return out


def test_gpu_seconds_per_team_sum_every_running_job_and_every_ended_run(daemon):
    d = daemon
    ana = Caller("ana", "user")
    for who, req in ((ADMIN, JobRequest(command=["true"], gpus=3)), (ana, JobRequest(command=["true"], gpus=1)),
                     (ana, JobRequest(command=["true"], gpus=4, nodes=2)),
                     (ADMIN, JobRequest(command=["true"], gpus=2, hold=True))):  # held: never started
        d.jobs.submit(who, req)
    d.schedule_once()
    d.clock.advance(100)
    got = d.readmodel.team_gpu_seconds()
    assert got == pytest.approx(reference_team_gpu_seconds(d, {}))
    assert sum(got.values()) == pytest.approx((3 + 1 + 4 * 2) * 100)
    # the 2-node job ends after 100 s: its 800 GPU-seconds stay, counted once, as it stops growing
    d.reconciler.on_started("n0", "3.0")
    for node in ("n1", "n2", "n3"):
        d.reconciler.on_exited(node, "3.0", RankExit(0), None)
    d.reconciler.on_exited("n0", "3.0", RankExit(0), None)
    d.clock.advance(50)
    got = d.readmodel.team_gpu_seconds()
    assert got == pytest.approx(reference_team_gpu_seconds(d, d.readmodel.finished_team_gpu_s))
    assert sum(got.values()) == pytest.approx((3 + 1) * 150 + 8 * 100)


def test_a_daemon_that_leads_again_reads_the_nodes_another_leader_wrote(daemon):
    """What the leader keeps of the node table (listings, scrapes, the submissions' size check,
    the planner's rows) follows its own commits; another daemon's, made while this one stood by,
    are read again when it takes office."""
    import asyncio

    from sqlalchemy import update

    from scheduler.daemon.errors import Conflict

    d = daemon
    view = lambda: next(n for n in d.node_views() if n["name"] == "n1")  # noqa: E731
    assert d.readmodel.node("n1").driver_version == "550.54.15" and view()["gpus_total"] == 4
    with pytest.raises(Conflict, match=r"largest: 4 on n3"):
        d.jobs.submit(ADMIN, JobRequest(command=["true"], gpus=8))
    d.schedule_once()
    # meanwhile another daemon led: n1 came back with 8 GPUs and a new driver, and was drained
    with d.engine.begin() as conn:
        conn.execute(update(Node.__table__).where(Node.__table__.c.name == "n1").values(
            gpus_total=8, gpu_indices=list(range(8)), state=m.DRAINING,
            agent_info={"host": "host-1", "driver_version": "570.86.10"}))

    async def lead_again():
        d.links.start = lambda node: None  # nodes without agents
        await d._start_office()
        await d._leave_office()

    asyncio.run(lead_again())
    assert d.readmodel.node("n1").driver_version == "570.86.10"
    assert (view()["gpus_total"], view()["state"]) == (8, m.DRAINING)
    job = d.jobs.submit(ADMIN, JobRequest(command=["true"], gpus=8))  # fits the largest node now
    d.schedule_once()  # but n1 drains: the planner's rows say so, and the job waits
    assert d.jobs.get(ADMIN, job["id"])["state"] == m.PENDING
