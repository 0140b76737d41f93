"""Notifications to a real local HTTP receiver and a real local SMTP server (aiosmtpd)."""

from __future__ import annotations

import asyncio
import json
import logging
import threading
from email import message_from_bytes
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest

from scheduler import models as m
from scheduler.notify import (
    Notifier,
    NotifyConfig,
    job_event_types,
    parse_mail_type,
)
from tests.conftest import free_port

aiosmtpd = pytest.importorskip("aiosmtpd", reason="aiosmtpd is a dev dependency (pip install aiosmtpd)")
from aiosmtpd.controller import Controller  # noqa: E402
from aiosmtpd.smtp import AuthResult  # noqa: E402

PASSWORD = "s3cret-smtp-pass"


class Receiver:
    """A local HTTP server: /ok answers 200, /flaky 500 then 200, /hang never in time, /gone 404."""

    def __init__(self):
        self.posts: list[tuple[str, dict]] = []
        self.hanging = threading.Event()
        self.release = threading.Event()
        self.flaky_left = 2
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):  # noqa: N802
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                receiver.posts.append((self.path, body))
                if self.path.startswith("/hang"):
                    receiver.hanging.set()
                    receiver.release.wait(5)
                    receiver.hanging.clear()
                    code = 200
                elif self.path.startswith("/flaky") and receiver.flaky_left > 0:
                    receiver.flaky_left -= 1
                    code = 500
                else:
                    code = 404 if self.path.startswith("/gone") else 200
                self.send_response(code)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def paths(self, prefix: str) -> list[str]:
        return [p for p, _ in self.posts if p.startswith(prefix)]

    def close(self):
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class Mailbox:
    async def handle_DATA(self, server, session, envelope):  # noqa: N802
        self.messages.append((envelope.rcpt_tos, message_from_bytes(envelope.content)))
        return "250 OK"

    def __init__(self):
        self.messages: list = []


def authenticator(server, session, envelope, mechanism, auth_data):
    ok = auth_data.login == b"trainyard" and auth_data.password == PASSWORD.encode()
    return AuthResult(success=ok)


@pytest.fixture
def receiver():
    r = Receiver()
    yield r
    r.close()


@pytest.fixture
def smtpd():
    box = Mailbox()
    port = free_port()
    c = Controller(box, hostname="127.0.0.1", port=port, authenticator=authenticator,
                   auth_require_tls=False)
    c.start()
    box.port = port
    yield box
    c.stop()


def job(**kw) -> SimpleNamespace:
    base = dict(id=12, name="train", user="alice", queue="default", state=m.RUNNING, reason="",
                mail_type="", mail_user="", notify_url="")
    return SimpleNamespace(**{**base, **kw})


async def until(pred, what: str, limit: int = 2000):
    """Let the loop run until pred() holds (bounded by iterations, not by a clock)."""
    for _ in range(limit):
        if pred():
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"never happened: {what}")


def test_mail_types_are_slurms():
    assert parse_mail_type("END,fail") == {"END", "FAIL"}
    assert parse_mail_type("ALL") == {"BEGIN", "END", "FAIL", "REQUEUE"}
    with pytest.raises(ValueError, match="unknown mail type 'FINISH'; use one or more of BEGIN"):
        parse_mail_type("FINISH")
    assert job_event_types(m.RUNNING, m.CONFIGURING) == {"BEGIN"}
    assert job_event_types(m.TIMEOUT, m.RUNNING) == {"END", "FAIL", "TIME_LIMIT"}
    assert job_event_types(m.COMPLETED, m.RUNNING) == {"END"}
    assert job_event_types(m.PENDING, m.RUNNING) == {"REQUEUE"}
    assert job_event_types(m.CONFIGURING, m.PENDING) == set()


async def test_job_and_node_events_reach_webhooks_and_mail(receiver, smtpd, caplog):
    caplog.set_level(logging.DEBUG, logger="trainyard.notify")
    cfg = NotifyConfig.from_dict({
        "webhooks": [f"{receiver.url}/ok/T000/B000/XXXX"], "webhook_types": "FAIL,DRAIN,DOWN",
        "mail_to": ["ops@example.org"], "mail_types": "DOWN",
        "smtp": {"host": "127.0.0.1", "port": smtpd.port, "sender": "trainyard@example.org",
                 "user": "trainyard", "password": PASSWORD},
        "timeout_s": 2.0, "retries": 2, "backoff_s": 0.05})
    n = Notifier(cfg, "gpu-prod")
    await n.start()
    try:
        n.on_job_state(job(state=m.FAILED, reason="NonZeroExitCode", mail_type="END,FAIL",
                           mail_user="alice@example.org", notify_url=f"{receiver.url}/ok/mine"), m.RUNNING)
        n.node_event("node-3", m.DOWN, "unreachable for 60s")
        n.node_event("node-4", m.UP)  # nothing to say
        await until(lambda: n.stats["sent"] == 5, "five deliveries")
    finally:
        await n.stop()
    texts = {path: body["text"] for path, body in receiver.posts}
    assert texts["/ok/mine"] == ("[gpu-prod] job 12 (train) FAILED: NonZeroExitCode "
                                 "(user alice, queue default)")
    assert sorted(receiver.paths("/ok/T000")) == ["/ok/T000/B000/XXXX"] * 2  # job FAIL, node DOWN
    mails = {tuple(to): msg for to, msg in smtpd.messages}
    assert mails[("alice@example.org",)]["Subject"] == "[gpu-prod] job 12 (train) FAILED"
    assert mails[("ops@example.org",)]["Subject"] == "[gpu-prod] node node-3 DOWN"
    assert "unreachable for 60s" in mails[("ops@example.org",)].get_payload()
    assert PASSWORD not in caplog.text and PASSWORD not in repr(cfg)


async def test_per_job_mail_only_for_the_types_asked(receiver, smtpd):
    cfg = NotifyConfig.from_dict({"smtp": {"host": "127.0.0.1", "port": smtpd.port}, "timeout_s": 2.0})
    n = Notifier(cfg)
    await n.start()
    try:
        j = job(mail_type="END", mail_user="bob@example.org")
        n.on_job_state(j, m.CONFIGURING)          # BEGIN: not asked for
        j.state = m.COMPLETED
        n.on_job_state(j, m.RUNNING)              # END: asked for
        await until(lambda: n.stats["sent"] == 1, "one mail")
    finally:
        await n.stop()
    assert [msg["Subject"] for _, msg in smtpd.messages] == ["[trainyard] job 12 (train) COMPLETED"]


async def test_a_failing_receiver_is_retried_with_backoff_and_a_refusal_is_not(receiver):
    cfg = NotifyConfig(timeout_s=2.0, retries=3, backoff_s=0.01)
    n = Notifier(cfg)
    await n.start()
    try:
        n.on_job_state(job(notify_url=f"{receiver.url}/flaky"), m.CONFIGURING)
        n.on_job_state(job(notify_url=f"{receiver.url}/gone/secret-token"), m.CONFIGURING)
        await until(lambda: n.stats["sent"] == 1 and n.stats["failed"] == 1, "flaky sent, gone failed")
    finally:
        await n.stop()
    assert len(receiver.paths("/flaky")) == 3          # 500, 500, then 200
    assert len(receiver.paths("/gone")) == 1           # 404: no retry
    assert n.stats["retried"] == 2


async def test_a_hanging_webhook_times_out_is_retried_and_never_stalls_the_loop(receiver, caplog):
    caplog.set_level(logging.DEBUG, logger="trainyard.notify")
    cfg = NotifyConfig(timeout_s=0.2, retries=2, backoff_s=0.01, workers=1)
    n = Notifier(cfg)
    await n.start()
    cycles = {"total": 0, "while_hanging": 0}
    stop = asyncio.Event()

    async def scheduling_loop():  # stands in for the daemon's cycle on the same event loop
        while not stop.is_set():
            cycles["total"] += 1
            if receiver.hanging.is_set():
                cycles["while_hanging"] += 1
            await asyncio.sleep(0.001)

    loop_task = asyncio.create_task(scheduling_loop())
    try:
        for _ in range(3):
            n.on_job_state(job(notify_url=f"{receiver.url}/hang/T0/B0/secret"), m.CONFIGURING)
        n.on_job_state(job(notify_url=f"{receiver.url}/ok/after"), m.CONFIGURING)
        await until(lambda: n.stats["failed"] == 3 and n.stats["sent"] == 1, "three failed, one sent",
                    limit=5000)
    finally:
        stop.set()
        await loop_task
        receiver.release.set()
        await n.stop()
    assert len(receiver.paths("/hang")) == 9  # 3 deliveries x (1 + 2 retries), each timed out
    assert receiver.paths("/ok") == ["/ok/after"]
    assert cycles["while_hanging"] > 0
    assert "failed after 3 attempts: TimeoutError" in caplog.text
    assert "secret" not in caplog.text  # the webhook's path is its secret


async def test_a_full_queue_drops_and_counts_without_blocking():
    n = Notifier(NotifyConfig(queue_max=2, workers=1, webhooks=("http://127.0.0.1:9/x",),
                              webhook_types=frozenset({"DOWN"})))
    await n.start()
    for t in n.tasks:  # no worker takes anything: the queue fills
        t.cancel()
    for i in range(5):
        n.node_event(f"node-{i}", m.DOWN)
    assert n.stats["dropped"] == 3 and n.queue.qsize() == 2
    await n.stop(drain_s=0)
