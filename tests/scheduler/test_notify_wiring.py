"""Notifications wired to the daemon's state: job changes and node drains reach a local receiver."""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from scheduler import models as m
from scheduler.daemon.clock import Clock
from scheduler.daemon.notifications import Notifications
from scheduler.daemon.state import StateStore
from scheduler.models import Job, Node
from scheduler.settings import NotifySettings
from scheduler.store import init_schema, make_engine


@pytest.fixture
def receiver():
    got: list[dict] = []

    class Hook(BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers["Content-Length"]))
            got.append({"path": self.path, **json.loads(body)})
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Hook)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", got
    server.shutdown()


async def wait_until(pred, what: str, timeout: float = 10.0):
    for _ in range(int(timeout / 0.05)):
        if pred():
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture
def store(tmp_path):
    engine = make_engine(str(tmp_path / "t.db"))
    init_schema(engine)
    return StateStore(engine, Clock())


async def test_job_failure_and_node_drain_reach_the_cluster_webhook(store, receiver):
    url, got = receiver
    notes = Notifications(NotifySettings(webhooks=[f"{url}/hooks/ops"]), store, "lab")
    await notes.start()
    try:
        with store.tx() as s:
            job = Job(id=5, name="train", user="ann", queue="gpu", state=m.RUNNING)
            s.add(job)
            s.add(Node(name="n1", address="10.0.0.1"))
        with store.tx() as s:
            job = s.get(Job, 5)
            store.set_state(s, job, m.FAILED, "NonZeroExitCode")
        with store.tx() as s:
            store.record(s, "ops", "node.drain", "n1", {"state": m.DRAINING, "reason": "bad fan"})
        with store.tx() as s:  # the same drain completing is not told twice
            store.record(s, "trainyard", "node.state", "n1", {"state": m.DRAINED, "reason": "bad fan"})
        await wait_until(lambda: len(got) >= 2, "two notifications")
        await asyncio.sleep(0.3)
        texts = sorted(g["text"] for g in got)  # delivered concurrently: in any order
        assert texts == ["[lab] job 5 (train) FAILED: NonZeroExitCode (user ann, queue gpu)",
                         "[lab] node n1 DRAINING: bad fan"]
        assert {g["path"] for g in got} == {"/hooks/ops"}
    finally:
        await notes.stop()


async def test_a_hanging_webhook_never_holds_up_a_commit(store, receiver):
    url, got = receiver
    hang = asyncio.Event()

    async def handle(reader, writer):  # accepts, then never answers
        await hang.wait()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    notes = Notifications(NotifySettings(webhooks=[f"http://127.0.0.1:{port}/", url],
                                         webhook_types=["ALL"], timeout_s=0.5, retries=0, workers=1),
                          store, "lab")
    await notes.start()
    try:
        for jid in (1, 2):
            with store.tx() as s:
                s.add(Job(id=jid, user="ann", state=m.CONFIGURING))
            with store.tx() as s:  # the commit returns while the first receiver hangs
                store.set_state(s, s.get(Job, jid), m.RUNNING)
        await wait_until(lambda: len(got) == 2, "the working receiver's two notifications")
        assert notes.notifier.stats["failed"] >= 1  # the hanging one timed out
    finally:
        hang.set()
        server.close()
        await notes.stop()
