"""Notifications: webhooks (Slack-compatible JSON) and e-mail (SMTP) on job and node events.

Events use Slurm's mail types: BEGIN, END, FAIL, REQUEUE, TIME_LIMIT for jobs (`--mail-type`,
`--mail-user`, and `--notify URL` for a webhook), DRAIN and DOWN for nodes. The daemon calls
`on_job_state` / `node_event`, which only put deliveries on a bounded queue (synchronous, O(1),
never blocking the scheduling loop); workers send them with a timeout per attempt and retry
failures with exponential backoff. A full queue drops the newest delivery and counts it. The
SMTP password and webhook paths (Slack puts its secret there) are never logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import smtplib
import ssl
from collections.abc import Iterable
from dataclasses import dataclass, field
from email.message import EmailMessage
from urllib.parse import urlsplit

import httpx

from . import models as m

log = logging.getLogger("trainyard.notify")

JOB_TYPES = ("BEGIN", "END", "FAIL", "REQUEUE", "TIME_LIMIT")
NODE_TYPES = ("DRAIN", "DOWN")
# Slurm's ALL: every job event but TIME_LIMIT, which is asked for by name
ALIASES = {"ALL": ("BEGIN", "END", "FAIL", "REQUEUE"), "NONE": ()}
FAILED_STATES = frozenset({m.FAILED, m.NODE_FAIL, m.TIMEOUT, m.OUT_OF_MEMORY})


def parse_mail_type(text: str | Iterable[str]) -> frozenset[str]:
    """`--mail-type END,FAIL` -> {"END", "FAIL"}; an unknown type names the known ones."""
    items = text.split(",") if isinstance(text, str) else list(text)
    out: set[str] = set()
    for raw in items:
        t = raw.strip().upper()
        if not t:
            continue
        if t in ALIASES:
            out.update(ALIASES[t])
        elif t in JOB_TYPES or t in NODE_TYPES:
            out.add(t)
        else:
            raise ValueError(f"unknown mail type {raw.strip()!r}; use one or more of "
                             f"{', '.join((*JOB_TYPES, *NODE_TYPES, *ALIASES))}")
    return frozenset(out)


def job_event_types(state: str, old: str | None) -> frozenset[str]:
    """The mail types one job-state change is: RUNNING -> BEGIN; an end -> END, plus FAIL when
    it failed and TIME_LIMIT when it ran out of time; back to PENDING from a run -> REQUEUE."""
    if state == old:
        return frozenset()
    if state == m.RUNNING:
        return frozenset({"BEGIN"})
    if state in m.FINAL_STATES:
        kinds = {"END"}
        if state in FAILED_STATES:
            kinds.add("FAIL")
        if state == m.TIMEOUT:
            kinds.add("TIME_LIMIT")
        return frozenset(kinds)
    if state == m.PREEMPTED or (state == m.PENDING and old in m.ACTIVE_STATES | {m.PREEMPTED}):
        return frozenset({"REQUEUE"})
    return frozenset()


class Secret(str):
    """A string that never shows itself in repr, logs or tracebacks' locals."""

    def __repr__(self) -> str:
        return "Secret('********')"

    def __str__(self) -> str:
        return "********"

    def reveal(self) -> str:
        return str.__str__(self)


@dataclass(frozen=True)
class SmtpConfig:
    host: str
    port: int = 25
    sender: str = "trainyard@localhost"
    user: str = ""
    password: Secret = field(default_factory=lambda: Secret(""))
    starttls: bool = False
    ssl: bool = False  # SMTPS (port 465)


@dataclass(frozen=True)
class NotifyConfig:
    """The `[notify]` table: cluster-wide receivers, and how deliveries are tried."""

    webhooks: tuple[str, ...] = ()
    webhook_types: frozenset[str] = frozenset((*JOB_TYPES[2:], *NODE_TYPES))  # FAIL, REQUEUE, ...
    mail_to: tuple[str, ...] = ()
    mail_types: frozenset[str] = frozenset(NODE_TYPES)
    smtp: SmtpConfig | None = None
    timeout_s: float = 5.0
    retries: int = 3
    backoff_s: float = 1.0
    max_backoff_s: float = 60.0
    queue_max: int = 1000
    workers: int = 4

    @classmethod
    def from_dict(cls, d: dict) -> NotifyConfig:
        smtp = d.get("smtp")
        if smtp is not None:
            smtp = SmtpConfig(**{**smtp, "password": Secret(smtp.get("password", ""))})
        kw = {k: v for k, v in d.items() if k != "smtp"}
        for k in ("webhooks", "mail_to"):
            if k in kw:
                kw[k] = tuple(kw[k])
        for k in ("webhook_types", "mail_types"):
            if k in kw:
                kw[k] = parse_mail_type(kw[k])
        return cls(smtp=smtp, **kw)


@dataclass(frozen=True)
class Message:
    kinds: frozenset[str]
    subject: str
    text: str


@dataclass
class Delivery:
    channel: str  # "webhook" | "mail"
    to: str       # URL or address
    message: Message
    attempt: int = 0


def redact_url(url: str) -> str:
    """scheme://host only: a webhook's path and query often are its secret."""
    u = urlsplit(url)
    return f"{u.scheme}://{u.hostname or ''}{f':{u.port}' if u.port else ''}/…"


class PermanentFailure(Exception):
    """The receiver refused for good (a 4xx other than 429): no retry."""


class Notifier:
    """A bounded queue and its workers; start() inside the daemon's event loop."""

    def __init__(self, config: NotifyConfig, cluster_name: str = "trainyard"):
        self.config = config
        self.cluster = cluster_name
        self.queue: asyncio.Queue[Delivery] | None = None
        self.tasks: list[asyncio.Task] = []
        self.timers: set[asyncio.TimerHandle] = set()
        self.http: httpx.AsyncClient | None = None
        self.stats = {"sent": 0, "failed": 0, "retried": 0, "dropped": 0}

    # ---------------------------------------------------------------- lifecycle
    async def start(self) -> None:
        self.queue = asyncio.Queue(self.config.queue_max)
        self.http = httpx.AsyncClient(timeout=self.config.timeout_s, follow_redirects=False)
        self.tasks = [asyncio.create_task(self._worker(), name=f"notify-{i}")
                      for i in range(self.config.workers)]

    async def stop(self, drain_s: float = 5.0) -> None:
        """Send what is queued for up to drain_s, then stop; retries not yet due are dropped."""
        for t in self.timers:
            t.cancel()
        if self.queue is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.queue.join(), drain_s)
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        if self.http is not None:
            await self.http.aclose()

    # ---------------------------------------------------------------- what the daemon calls
    def enqueue(self, delivery: Delivery) -> bool:
        """Queue one delivery without waiting; False (and counted) when the queue is full."""
        if self.queue is None:
            return False
        try:
            self.queue.put_nowait(delivery)
            return True
        except asyncio.QueueFull:
            self.stats["dropped"] += 1
            log.warning("notification queue full (%d): dropped a %s to %s", self.config.queue_max,
                        delivery.channel, self._shown(delivery))
            return False

    def on_job_state(self, job, old: str | None) -> None:
        """A job-state hook (after commit). Job fields read: id, name, user, state, reason,
        queue, mail_type, mail_user, notify_url (the last three may be absent)."""
        kinds = job_event_types(job.state, old)
        if not kinds:
            return
        msg = self.job_message(job, kinds)
        wanted = parse_mail_type(getattr(job, "mail_type", "") or "")
        mail_user = getattr(job, "mail_user", "") or ""
        if mail_user and kinds & wanted:
            self.enqueue(Delivery("mail", mail_user, msg))
        url = getattr(job, "notify_url", "") or ""
        if url and (kinds & wanted or not wanted):  # --notify alone: every event of the job
            self.enqueue(Delivery("webhook", url, msg))
        self._cluster_wide(msg)

    def node_event(self, node: str, state: str, reason: str = "") -> None:
        kind = {m.DRAINING: "DRAIN", m.DRAINED: "DRAIN", m.DOWN: "DOWN"}.get(state)
        if kind is None:
            return
        subject = f"[{self.cluster}] node {node} {state}"
        self._cluster_wide(Message(frozenset({kind}), subject,
                                   subject + (f": {reason}" if reason else "")))

    def job_message(self, job, kinds: frozenset[str]) -> Message:
        name = f" ({job.name})" if getattr(job, "name", "") else ""
        reason = f": {job.reason}" if getattr(job, "reason", "") else ""
        subject = f"[{self.cluster}] job {job.id}{name} {job.state}"
        text = f"{subject}{reason} (user {job.user}, queue {job.queue})"
        return Message(kinds, subject, text)

    def _cluster_wide(self, msg: Message) -> None:
        if msg.kinds & self.config.webhook_types:
            for url in self.config.webhooks:
                self.enqueue(Delivery("webhook", url, msg))
        if msg.kinds & self.config.mail_types:
            for to in self.config.mail_to:
                self.enqueue(Delivery("mail", to, msg))

    # ---------------------------------------------------------------- delivery
    async def _worker(self) -> None:
        assert self.queue is not None
        while True:
            d = await self.queue.get()
            try:
                await self._attempt(d)
            finally:
                self.queue.task_done()

    async def _attempt(self, d: Delivery) -> None:
        try:
            await asyncio.wait_for(self._send(d), self.config.timeout_s)
        except PermanentFailure as e:
            self.stats["failed"] += 1
            log.warning("%s to %s refused, not retried: %s", d.channel, self._shown(d), e)
            return
        except Exception as e:  # timeouts, refused connections, 5xx, SMTP errors
            why = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
            if d.attempt >= self.config.retries:
                self.stats["failed"] += 1
                log.warning("%s to %s failed after %d attempts: %s", d.channel, self._shown(d),
                            d.attempt + 1, why)
                return
            delay = min(self.config.max_backoff_s, self.config.backoff_s * 2 ** d.attempt)
            d.attempt += 1
            self.stats["retried"] += 1
            log.info("%s to %s failed (%s); attempt %d in %.1fs", d.channel, self._shown(d), why,
                     d.attempt + 1, delay)
            self._retry_later(d, delay)
            return
        self.stats["sent"] += 1

    def _retry_later(self, d: Delivery, delay: float) -> None:
        loop = asyncio.get_running_loop()

        def due():
            self.timers.discard(handle)
            self.enqueue(d)

        handle = loop.call_later(delay, due)
        self.timers.add(handle)

    async def _send(self, d: Delivery) -> None:
        if d.channel == "webhook":
            await self._post(d.to, d.message)
        else:
            await asyncio.to_thread(self._mail, d.to, d.message)

    async def _post(self, url: str, msg: Message) -> None:
        assert self.http is not None
        r = await self.http.post(url, json={"text": msg.text})
        if r.status_code == 429 or r.status_code >= 500:
            raise RuntimeError(f"HTTP {r.status_code}")
        if r.status_code >= 400:
            raise PermanentFailure(f"HTTP {r.status_code}")

    def _mail(self, to: str, msg: Message) -> None:
        cfg = self.config.smtp
        if cfg is None:
            raise PermanentFailure("no [notify.smtp] server is configured")
        em = EmailMessage()
        em["From"], em["To"], em["Subject"] = cfg.sender, to, msg.subject
        em.set_content(msg.text + "\n")
        smtp_cls = smtplib.SMTP_SSL if cfg.ssl else smtplib.SMTP
        with smtp_cls(cfg.host, cfg.port, timeout=self.config.timeout_s) as s:
            if cfg.starttls:
                s.starttls(context=ssl.create_default_context())
            if cfg.user:
                s.login(cfg.user, cfg.password.reveal())
            s.send_message(em)

    def _shown(self, d: Delivery) -> str:
        return redact_url(d.to) if d.channel == "webhook" else d.to
