"""Central logs: jobs' output streamed by the agents, kept by the daemon, read after the node left."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from sqlmodel import select

from scheduler.daemon.clock import Clock
from scheduler.daemon.logstore import JobLogs, LogStore, whole_utf8
from scheduler.daemon.state import StateStore
from scheduler.models import Event, Job
from scheduler.store import init_schema, make_engine
from tests.conftest import wait_for, wait_job

TICKS = "for i in $(seq 1 {n}); do echo out $i; echo err $i >&2; sleep {pause}; done"


def stored(d, job_id: int, attempt: int = 0, rank: int = 0) -> Path:
    return d.state / "logs" / str(job_id) / str(attempt) / f"{rank}.out"


def lines_of(text: str) -> list[str]:
    return [x for x in text.splitlines() if x.startswith(("out ", "err "))]


def test_output_is_stored_while_the_job_runs_and_read_after_its_node_is_gone(cluster):
    d, nodes = cluster
    c = d.client()
    job = c.submit({"command": ["sh", "-c", TICKS.format(n=8, pause=0.3)]})
    wait_job(c, job["id"], "RUNNING")
    # the daemon holds output while the job is still writing it
    wait_for(lambda: stored(d, job["id"]).exists() and "out 2" in stored(d, job["id"]).read_text(),
             10, what="output stored while the job runs")
    assert c.job(job["id"])["state"] == "RUNNING"
    follow = d.cli("logs", str(job["id"]), "--follow", check=True)
    assert lines_of(follow.stdout) == [f"{s} {i}" for i in range(1, 9) for s in ("out", "err")]
    node = c.job(job["id"])["allocation"][0]["node"]
    d.cli("node", "remove", node, "--force", check=True)
    next(n for n in nodes if n.name == node).stop()
    after = d.cli("logs", str(job["id"]), check=True)
    assert after.stdout == follow.stdout
    as_json = d.cli("logs", str(job["id"]), "--json", check=True)
    assert '"complete": true' in as_json.stdout and '"source": "store"' in as_json.stdout


def test_nothing_is_lost_when_the_daemon_is_killed_mid_job(cluster):
    d, _ = cluster
    c = d.client()
    job = c.submit({"command": ["sh", "-c", TICKS.format(n=30, pause=0.1)]})
    wait_for(lambda: stored(d, job["id"]).exists() and "out 3" in stored(d, job["id"]).read_text(),
             15, what="first output stored")
    d.kill9()
    d.start()
    c = d.client()
    wait_job(c, job["id"], "COMPLETED", timeout=40)
    wait_for(lambda: stored(d, job["id"]).with_suffix(".done").exists(), 20, what="the whole output")
    out = d.cli("logs", str(job["id"]), check=True).stdout
    assert lines_of(out) == [f"{s} {i}" for i in range(1, 31) for s in ("out", "err")]


def test_each_attempt_of_a_requeued_job_keeps_its_own_output(cluster):
    d, _ = cluster
    c = d.client()
    job = c.submit({"command": ["sh", "-c", "echo run $TRAINYARD_JOB_ID; sleep 30"]})
    wait_for(lambda: stored(d, job["id"]).exists() and "run" in stored(d, job["id"]).read_text(),
             15, what="attempt 0's output")
    c.requeue(job["id"])
    wait_for(lambda: c.job(job["id"])["state"] == "RUNNING" and stored(d, job["id"], 1).exists(), 45,
             what="attempt 1 running")
    first = d.cli("logs", str(job["id"]), "--attempt", "0", check=True).stdout
    assert first.startswith("run ")
    refused = d.cli("logs", str(job["id"]), "--attempt", "7")
    assert refused.returncode == 1 and "attempt" in refused.stderr
    c.cancel(job["id"])


# ------------------------------------------------------------------ the store on its own
class Sent:
    """The node links' side as the store sees it: what it sent to which node."""

    def __init__(self):
        self.sent: list[tuple[str, dict]] = []

    def send(self, name: str, msg: dict) -> bool:
        self.sent.append((name, msg))
        return True

    def names(self) -> list[str]:
        return []


@pytest.fixture
def store(tmp_path):
    engine = make_engine(str(tmp_path / "t.db"))
    init_schema(engine)
    st = StateStore(engine, Clock())
    with st.tx() as s:
        s.add(Job(id=7, user="ann", state="RUNNING", attempt=0,
                  allocation=[{"node": "n1", "gpus": [0]}, {"node": "n2", "gpus": [0]}]))
    return st


def chunk(key: str, offset: int, data: bytes, eof: bool = False) -> dict:
    return {"ev": "output", "key": key, "offset": offset, "data": base64.b64encode(data).decode(), "eof": eof}


def events(st: StateStore, action: str) -> list[Event]:
    with st.read() as s:
        return s.exec(select(Event).where(Event.action == action)).all()


def test_output_resent_after_a_restart_is_stored_once(tmp_path, store):
    links = Sent()
    logs = LogStore(tmp_path / "logs", store, links, Clock())
    logs.on_output("n2", chunk("7.0", 0, b"hello "))
    logs.on_output("n2", chunk("7.0", 0, b"hello world\n"))  # resent from 0 by a new agent
    logs.on_output("n2", chunk("7.0", 12, b"", eof=True))
    assert (tmp_path / "logs/7/0/1.out").read_bytes() == b"hello world\n"
    assert links.sent[-1] == ("n2", {"op": "output_ack", "key": "7.0", "offset": 12, "done": True})


def test_a_gap_is_asked_for_again_not_stored(tmp_path, store):
    links = Sent()
    logs = LogStore(tmp_path / "logs", store, links, Clock())
    logs.on_output("n1", chunk("7.0", 0, b"abc"))
    logs.on_output("n1", chunk("7.0", 10, b"later"))
    assert (tmp_path / "logs/7/0/0.out").read_bytes() == b"abc"
    assert links.sent[-1][1]["offset"] == 3 and not links.sent[-1][1]["done"]


def test_output_from_a_node_that_does_not_run_the_job_is_dropped_and_audited(tmp_path, store):
    links = Sent()
    logs = LogStore(tmp_path / "logs", store, links, Clock())
    logs.on_output("n9", chunk("7.0", 0, b"not yours"))
    logs.on_output("n9", chunk("8.0", 0, b"no such job"))
    assert not (tmp_path / "logs/7").exists() and not (tmp_path / "logs/8").exists()
    refused = events(store, "log.refused")
    assert [(e.target, e.detail["node"]) for e in refused] == [("7.0", "n9"), ("8.0", "n9")]
    assert all(msg["done"] for _, msg in links.sent)  # the agent stops sending it


def test_output_beyond_the_size_cap_is_cut_with_a_note(tmp_path, store):
    links = Sent()
    logs = LogStore(tmp_path / "logs", store, links, Clock(), max_bytes_per_job=4096)
    logs.on_output("n1", chunk("7.0", 0, b"x" * 3000))
    logs.on_output("n2", chunk("7.0", 0, b"y" * 3000))  # the cap covers every rank of the attempt
    assert (tmp_path / "logs/7/0/0.out").read_bytes() == b"x" * 3000
    rank1 = (tmp_path / "logs/7/0/1.out").read_bytes()
    assert rank1.startswith(b"y" * 1096) and b"max_bytes_per_job" in rank1
    assert links.sent[-1][1]["done"]


def test_the_cap_counts_a_rank_that_ended_before_another_began(tmp_path, store):
    """The attempt's bytes are read from its files again when a rank begins after the others
    ended (nothing is kept in memory for an attempt whose streams all ended)."""
    links = Sent()
    logs = LogStore(tmp_path / "logs", store, links, Clock(), max_bytes_per_job=4096)
    logs.on_output("n1", chunk("7.0", 0, b"x" * 3000, eof=True))
    assert links.sent[-1] == ("n1", {"op": "output_ack", "key": "7.0", "offset": 3000, "done": True})
    logs.on_output("n2", chunk("7.0", 0, b"y" * 3000))
    rank1 = (tmp_path / "logs/7/0/1.out").read_bytes()
    assert rank1.startswith(b"y" * 1096 + b"\ntrainyard: output cut at 4096 bytes") and b"y" * 1097 not in rank1
    assert links.sent[-1][1]["done"]
    logs.on_output("n1", chunk("7.0", 0, b"x" * 3000, eof=True))  # a late duplicate of an ended stream
    assert (tmp_path / "logs/7/0/0.out").read_bytes() == b"x" * 3000
    assert links.sent[-1] == ("n1", {"op": "output_ack", "key": "7.0", "offset": 3000, "done": True})


def test_the_store_keeps_nothing_for_the_jobs_whose_output_ended(tmp_path, store):
    """A daemon that has run many jobs holds no per-job state for the ended ones (it grew by an
    entry per job attempt until the retention period removed its files)."""
    links = Sent()
    logs = LogStore(tmp_path / "logs", store, links, Clock())
    for job in range(100, 1100):
        logs.record_ranks(job, 0, ["n1"])
        if job % 2:
            logs.on_output("n1", chunk(f"{job}.0", 0, f"job {job}\n".encode()))
        logs.on_output("n1", chunk(f"{job}.0", (len(f"job {job}\n") if job % 2 else 0), b"", eof=True))
    assert [m["done"] for _, m in links.sent].count(True) == 1000
    assert (tmp_path / "logs/1099/0/0.out").read_text() == "job 1099\n"
    assert not (tmp_path / "logs/1098").exists()  # a job that printed nothing leaves no file
    assert (logs._streams, logs._totals, logs._open, logs._owner, logs._unwritten) == ({}, {}, {}, {}, {})


async def test_a_job_that_prints_nothing_costs_no_file_and_reads_as_empty(tmp_path, store):
    """The attempt's directory and nodes.json come with its first byte of output: a job with
    none is acknowledged at its end without a file written, and its ranks are still known (in
    memory) while it runs; a job with output gets both, on disk, as before."""
    links = Sent()
    logs = LogStore(tmp_path / "logs", store, links, Clock())
    logs.record_ranks(41, 0, ["n1", "n2"])
    logs.record_ranks(42, 0, ["n1"])
    assert logs.ranks(41, 0) == ["n1", "n2"] and not (tmp_path / "logs/41").exists()
    logs.on_output("n1", chunk("41.0", 0, b"", eof=True))
    assert links.sent[-1] == ("n1", {"op": "output_ack", "key": "41.0", "offset": 0, "done": True})
    assert logs.ranks(41, 0) == ["n1", "n2"]  # rank 1 has not ended: still known
    logs.on_output("n2", chunk("41.0", 0, b"rank one\n"))
    logs.on_output("n2", chunk("41.0", 9, b"", eof=True))
    logs.on_output("n1", chunk("42.0", 0, b"", eof=True))
    for _ in range(200):
        if len(links.sent) == 4 and (tmp_path / "logs/41/0/1.done").exists():
            break
        await asyncio.sleep(0.01)
    await logs.stop()
    assert [m["done"] for _, m in links.sent] == [True, False, True, True]
    assert json.loads((tmp_path / "logs/41/0/nodes.json").read_text()) == ["n1", "n2"]
    assert sorted(p.name for p in (tmp_path / "logs/41/0").iterdir()) == ["1.done", "1.out", "nodes.json"]
    assert not (tmp_path / "logs/42").exists()
    assert logs.read(42, 0, 0, 0, 100) is None  # nothing stored: the reader asks the node
    assert logs.read(41, 0, 1, 0, 100)["data"] == "rank one\n"
    assert logs._unwritten == {}


async def test_files_written_off_the_loop_are_all_written_in_order_and_a_failure_is_reported(tmp_path, store):
    """In the daemon the per-job files (nodes.json with the first output, .done at a stream's end) are
    written on a file thread, those of one turn of the loop together: each job's end is still
    acknowledged once its .done is on disk, in the order the ends came, and a job whose file
    cannot be written is reported and not acknowledged as done (its node sends the end again)."""
    links = Sent()
    logs = LogStore(tmp_path / "logs", store, links, Clock())
    (tmp_path / "logs" / "150").write_text("in the way")  # job 150's directory cannot be made
    jobs = list(range(100, 200))
    for job in jobs:
        logs.record_ranks(job, 0, ["n1"])
    await asyncio.sleep(0.2)
    for job in jobs:
        logs.on_output("n1", chunk(f"{job}.0", 0, b"done\n", eof=True))
    for _ in range(200):
        if len(links.sent) == len(jobs) - 1:
            break
        await asyncio.sleep(0.01)
    await logs.stop()
    acks = [m for _, m in links.sent]
    # 150's output could not be stored: not acknowledged at all, so its node keeps it
    assert [m["key"] for m in acks] == [f"{j}.0" for j in jobs if j != 150]
    assert all(m["done"] for m in acks)
    written = [j for j in jobs if (tmp_path / f"logs/{j}/0/nodes.json").exists()]
    assert written == [j for j in jobs if j != 150]
    assert all((tmp_path / f"logs/{j}/0/0.done").read_text() == "eof" for j in written)
    # recorded once, and recorded as gone when the next job's output was stored
    problems = events(store, "logs.problem")
    assert "cannot store jobs' output" in problems[0].detail["problem"] and problems[0].detail["node"] == "n1"
    assert [e.detail["problem"] for e in problems[1:]] == [""]


def test_expired_output_is_removed(tmp_path, store):
    links = Sent()
    logs = LogStore(tmp_path / "logs", store, links, Clock(), retention_days=1)
    logs.on_output("n1", chunk("7.0", 0, b"old\n"))
    assert logs.expire(now=Clock().time() + 2 * 86400) == 1
    assert not (tmp_path / "logs/7").exists()


def test_a_character_cut_by_a_chunk_is_served_whole_next_time():
    text = "é→🙂".encode()
    assert whole_utf8(text[:-1]) == len("é→".encode())
    assert whole_utf8(text) == len(text)


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("mount"), reason="mounting a tmpfs needs root")
def test_a_full_disk_holds_output_back_and_says_so_until_there_is_room(tmp_path, store):
    root = tmp_path / "small"
    root.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(root)]).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        links = Sent()
        logs = LogStore(root / "logs", store, links, Clock())
        big = os.urandom(200_000)
        logs.on_output("n1", chunk("7.0", 0, big))
        assert links.sent == []  # not acknowledged: the node keeps it and sends it again
        assert "cannot store" in logs.problem
        assert [e.detail["node"] for e in events(store, "logs.problem")] == ["n1"]
        subprocess.run(["mount", "-o", "remount,size=1m", str(root)], check=True)
        logs.on_output("n1", chunk("7.0", 0, big))
        assert (root / "logs/7/0/0.out").read_bytes() == big
        assert logs.problem == ""
        assert [e.detail["problem"] != "" for e in events(store, "logs.problem")] == [True, False]
    finally:
        subprocess.run(["umount", str(root)])


async def test_the_api_refuses_a_rank_the_attempt_does_not_have(tmp_path, store):
    from scheduler.daemon import Caller, NotFound

    logs = LogStore(tmp_path / "logs", store, Sent(), Clock())
    reader = JobLogs(logs, store, Sent())
    with pytest.raises(NotFound, match="ranks 0..1, not 5"):
        await reader.read(Caller("ann", "user"), 7, 0, 5, 100)
