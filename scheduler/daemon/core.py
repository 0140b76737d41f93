"""The daemon: a small facade that wires its collaborators and runs their loops."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import logging
import os
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from types import SimpleNamespace
from typing import Any, TypeVar

import asyncssh
from sqlalchemy import select as sa_select
from sqlmodel import Session, col, select

from .. import models as m
from ..config import DaemonConfig, client_config_path, write_private
from ..metrics import Metrics
from ..models import Job, Node, Queue
from ..nodes import SshSettings
from ..planner import PolicyConfig, UsageLedger
from ..store import init_schema, make_engine, row_objects
from .accounting import Accounting, Sacct, sacct_jobs
from .autoscale import Autoscaler, ansible_bootstrap
from .caller import Caller
from .clock import Clock
from .diag import Diag
from .dispatch import Dispatcher
from .errors import Forbidden
from .gpuhealth import HealthMonitor
from .healthgate import GateConfig, HealthGate
from .idle import IdlePolicy, IdleReclaimer
from .inventory import Inventory
from .jobs import JobFilter, JobService
from .leadership import Leadership
from .lifecycle import JobLifecycle, RankExit
from .links import NodeLinks, settled
from .logbucket import LogBucket
from .logstore import JobLogs, LogStore, log_root
from .notifications import Notifications
from .overview import Overview
from .prediction import RunTimePrediction
from .ptys import PtyRelay
from .readbudget import ReadBudget
from .readers import READER_FROM, READERS_WORTH_S, ReaderProcesses, event_page, job_page, sacct_page
from .readmodel import MetricsReadModel
from .reconcile import Reconciler
from .registries import Registries, load_credentials
from .retention import Retention
from .scheduling import SchedulingCycle
from .state import StateStore, TableCache
from .steps import EVENTS as STEP_EVENTS
from .steps import StepRelay
from .tokens import Tokens
from .views import deflate_piece, encoded, gzip_bytes, gzip_joined, json_bytes, node_json

T = TypeVar("T")
log = logging.getLogger("trainyard.daemon")


class _NodePart:
    """One node's part of GET /v1/nodes: what it was rendered from, its JSON, and (once a
    compressed listing asked for it) that JSON after a comma as a deflate piece."""

    __slots__ = ("inputs", "json", "_deflated")

    def __init__(self, inputs: tuple, json: bytes):
        self.inputs, self.json, self._deflated = inputs, json, None

    def deflated(self) -> bytes:
        if self._deflated is None:
            self._deflated = deflate_piece(b"," + self.json)
        return self._deflated


_OPEN, _CLOSE = deflate_piece(b"["), deflate_piece(b"]")


def _same_inputs(was: tuple, now: tuple) -> bool:
    """A node's telemetry sample is compared by identity (each sample is a new object); its row
    by identity, else by value (a write to one node reads every row again), the rest by value."""
    return was[1] is now[1] and (was[0] is now[0] or was[0] == now[0]) and was[2:] == now[2:]


class Daemon:
    """Holds the collaborators; each has one concern (see "How the code is organised" in the README)."""

    def __init__(self, config: DaemonConfig, home: Path, clock: Clock | None = None):
        self.config = config
        self.home = home
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.clock = clock or Clock()
        self.db_url = config.db or str(home / "trainyard.db")
        self.engine = make_engine(self.db_url)
        self.known_hosts = home / "known_hosts"
        self.key_path = home / "ssh" / "id_ed25519"
        self.url = ""
        self.policy: PolicyConfig = config.policy_config
        self.ledger = UsageLedger(self.policy.fairshare_half_life_s)
        self.users: dict[str, str] = dict(config.users)
        self.store = StateStore(self.engine, self.clock)
        settings = SshSettings(
            known_hosts=str(self.known_hosts), connect_timeout_s=config.connect_timeout_s,
            keepalive_interval_s=config.keepalive_interval_s, keepalive_count_max=config.keepalive_count_max,
            reconnect_max_backoff_s=config.reconnect_max_backoff_s, connect_concurrency=config.connect_concurrency,
            hello_timeout_s=config.hello_timeout_s, telemetry_interval_s=config.telemetry_interval_s,
            pull_timeout_s=config.nodes.pull_timeout, image_cache_gb=config.nodes.image_cache_gb,
            job_dir_retention_s=config.nodes.job_dir_retention,
        )
        self.links = NodeLinks(settings, str(self.key_path), self.clock, self.on_agent_message,
                               self._on_link_problem, config.nodes.agent_dir, config.nodes.min_uid)
        self.readmodel = MetricsReadModel(self.store, self.links, self.clock,
                                          lambda user: self.policy.user_team.get(user, "default"))
        self.metrics = Metrics(self.readmodel)
        self.diag = Diag(self.clock.time, self.metrics.loop_lag)  # the daemon's own load (sdiag)
        self._diag_base: dict[str, int] = {}  # the job counters at the last reset
        # after-commit hooks: the read model first (job.allocation is still set on a requeue)
        self.store.on_job_state += [self.readmodel.on_job_state, self.metrics.on_job_state]
        self.prediction = RunTimePrediction(self.store)  # learns run times from jobs that end
        self.store.on_job_state.append(self.prediction.on_job_state)
        self.lifecycle = JobLifecycle(self.store, self.links, self.clock, self.policy, self.ledger,
                                      config.kill_grace_s, self.wake)
        self.dispatcher = Dispatcher(self.links, self.unix_user, config.cluster_name)
        self.dispatcher.registry_auth = Registries(
            load_credentials(config.settings.nodes.registry_credentials)).auth_for
        self.health = HealthMonitor(config.health_rules, self.clock, self._drain_for_health, self.wake)
        self.cycle = SchedulingCycle(self.store, self.links, self.health, self.lifecycle, self.dispatcher,
                                     self.clock, self.policy, self.ledger, config.schedule_interval_s,
                                     self.metrics)
        self.reconciler = Reconciler(self.store, self.links, self.lifecycle, self.dispatcher, self.clock,
                                     self.wake, self._observe_started)
        self.jobs = JobService(self.store, self.lifecycle, self.links, self.clock, self.policy, self.wake,
                               self.metrics.job_submitted, config.queue_aliases,
                               predict=self.prediction.columns)
        self.gate = HealthGate(self.store, self.links, self.clock,
                               GateConfig.from_settings(config.settings.gate, config.health_rules.temp_c),
                               self.wake)
        self.idle = IdleReclaimer(self.store, self.lifecycle, self.clock,
                                  IdlePolicy.from_queues(config.settings.queues))
        self.inventory = Inventory(self.store, self.links, self.lifecycle, self.clock, self.known_hosts,
                                   self.key_path, config.connect_timeout_s, self.wake, self.health.forget,
                                   self.gate)
        self.tokens = Tokens(self.store, self.clock)
        self.overview = Overview(self.store, self.clock, self.policy, self.ledger, config.cluster_name,
                                 config.queue_aliases)
        tables = config.settings
        self.logstore = LogStore(log_root(home, tables.logs.dir), self.store, self.links, self.clock,
                                 tables.logs.retention_days, tables.logs.max_bytes_per_job,
                                 self.gate.owns, LogBucket.from_settings(tables.logs))
        self.logs = JobLogs(self.logstore, self.store, self.links)
        self.ptys = PtyRelay(self.store, self.links)  # terminals in jobs (srun --pty)
        self.steps = StepRelay(self.store, self.links)  # srun across a batch job's nodes
        self.dispatcher.on_dispatch = lambda job: self.logstore.record_ranks(
            job.id, job.attempt, [a["node"] for a in job.allocation])
        self.notifications = Notifications(tables.notify, self.store, config.cluster_name)
        self.accounting = Accounting(self.store, tables.accounting, home, self.clock,
                                     lambda: self.policy.user_team)
        self.autoscaler = Autoscaler(self.store, self.inventory, self.clock, tables.infra, tables.autoscale,
                                     ansible_bootstrap(self.key_path.parent / "id_ed25519.pub"),
                                     self._queue_selector)
        self.autoscaler.check()  # a pool that is not AWS in the stack: refused at start
        self.cycle.refine_reason = self.autoscaler.pending_reason
        self.cycle.on_cycle = self.diag.cycle
        self._logs_expire_at = 0.0
        # long reads of committed state (a page of thousands of jobs, a day's sacct) run here
        self._reads = ThreadPoolExecutor(max_workers=2, thread_name_prefix="reads")
        self.read_budget = ReadBudget(config.read_share, config.read_burst_s, self._read_refused)
        self.readers = ReaderProcesses(self.db_url, config.read_processes)
        self.retention = Retention(self.store, tables.accounting.purge_jobs_after_days,
                                   tables.accounting.purge_events_after_days,
                                   10 * self.policy.fairshare_half_life_s)
        self._purge_at = 0.0
        self.leadership = Leadership(self.engine, self.db_url, lambda: self.url)
        self.store.fence = self.leadership.fence
        # the leader keeps allocated GPUs per node in memory; a standby reads them (None)
        live = lambda: self.store.active.gpus_used() if self.leadership.leading else None  # noqa: E731
        self.overview.live_usage = self.readmodel.live_usage = live
        self.readmodel.leading = lambda: self.leadership.leading
        # the same for the final states' job counts: kept in memory by the leader alone
        self.store.keeps_counts = lambda: self.leadership.leading
        self._tasks: list[asyncio.Task] = []
        self._office: list[asyncio.Task] = []  # what only the leader runs
        self._node_parts: dict[str, _NodePart] = {}  # node -> its rendered part: nodes_listing
        self._node_rows_seen: TableCache[list] = TableCache(self.store, "node")  # every node's row
        self._running = False

    # ---------------------------------------------------------------- lifecycle
    def prepare(self) -> None:
        """Everything that needs no event loop: the database (and, on SQLite, its one-daemon
        lock), the SSH key; with SQLite this daemon leads, so its state is loaded at once."""
        if not self.leadership.postgres:
            self.leadership.claim_sqlite(Path(self.engine.url.database or self.db_url))
        init_schema(self.engine)
        self.ensure_ssh_key()
        self.known_hosts.touch(mode=0o600, exist_ok=True)
        if self.leadership.leading:
            self._load_state()

    def _load_state(self) -> None:
        """What a leader needs before it acts: configured queues, fair-share usage, active jobs."""
        with self.store.tx() as s:
            wanted = {"default": None, **self.policy.queues}
            for name, qp in wanted.items():
                q = s.get(Queue, name) or Queue(name=name)
                if qp is not None:  # the config file decides a queue's shape; `open` is runtime state
                    q.priority = qp.priority
                    q.default_time_limit_s = int(qp.default_time_limit_s) if qp.default_time_limit_s else None
                    q.max_time_limit_s = int(qp.max_time_limit_s) if qp.max_time_limit_s else None
                    if not qp.open:
                        q.open = False
                s.add(q)
            self._load_usage(s)
        self.store.load_index()
        self.accounting.load()
        self.prediction.warm_up()

    def _load_usage(self, s: Session) -> None:
        """Rebuild the fair-share ledger from the runs of the last ten half-lives."""
        since = self.clock.time() - 10 * self.policy.fairshare_half_life_s
        rows = s.exec(select(Job).where(col(Job.end_time) > since, col(Job.start_time).is_not(None))
                      .order_by(col(Job.end_time))).all()
        for job in rows:
            self.ledger.charge_run(job.user, self.policy.team_of(job), job.gpus * job.nodes, job.start_time,
                                   job.end_time)

    def ensure_ssh_key(self) -> None:
        if self.key_path.exists():
            return
        self.key_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = asyncssh.generate_private_key("ssh-ed25519", comment="trainyard-daemon")
        write_private(self.key_path, key.export_private_key().decode())
        (self.key_path.parent / "id_ed25519.pub").write_text(key.export_public_key().decode())

    def create_token(self, user: str, role: str, created_by: str, address: str = "") -> str:
        return self.tokens.create(user, role, created_by, address)

    def bootstrap_admin(self, url: str) -> str | None:
        """On the first start, create an admin token for the local user and write client.toml."""
        if not self.leadership.leading or self.tokens.any():
            return None
        token = self.tokens.create(getpass.getuser(), "admin", "first-start")
        write_private(client_config_path(), f'url = "{url}"\ntoken = "{token}"\n')
        return token

    async def start(self) -> None:
        self._running = True
        self._tasks = [asyncio.create_task(self.diag.probe(lambda: self._running), name="loop-lag")]
        if self.leadership.postgres:  # stand by until elected (DESIGN.md boundary 7)
            self._tasks.append(asyncio.create_task(
                self.leadership.campaign(self._take_office, self._step_down, lambda: self._running),
                name="campaign"))
        else:
            await self._start_office()

    async def _take_office(self) -> None:
        await asyncio.to_thread(self._load_state)
        if self.url and self.bootstrap_admin(self.url):  # the first start of a PostgreSQL cluster
            log.warning("first start: admin token for this user written to %s", client_config_path())
        await self._start_office()

    async def _start_office(self) -> None:
        """The leader's work: node links, notifications, the scheduling and housekeeping loops."""
        self.cycle.forget_light_rows()  # another daemon may have led meanwhile: read everything
        self.lifecycle.forget_cached()
        self.store.forget_cached()  # node and queue caches, the final states' counts
        with self.store.read() as s:
            self.links.start_all(s.exec(select(Node)).all(), lambda name: len(self.store.active.on(name)))
        await self.notifications.start()
        self.logstore.start()
        self._office = [
            asyncio.create_task(self.cycle.loop(lambda: self._running and self.leadership.leading),
                                name="schedule"),
            asyncio.create_task(self._housekeeping_loop(), name="housekeeping"),
        ]
        if self.autoscaler.enabled:
            self._office.append(asyncio.create_task(
                self.autoscaler.loop(lambda: self._running and self.leadership.leading), name="autoscale"))

    async def _step_down(self, why: str) -> None:
        """A leader that lost its lock stops acting on nodes at once; a standby again."""
        await self._leave_office()
        log.warning("standing by: %s", why)

    async def _leave_office(self) -> None:
        for t in self._office:
            t.cancel()
        for t in self._office:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._office = []
        await self.autoscaler.stop()
        await self.logstore.stop()
        await self.links.stop_all()

    async def read_off_loop(self, fn: Callable[[], T], who: Caller | None = None) -> T:
        """`fn()` on the read threads, not on the event loop: a read of committed state that
        touches nothing the loop changes. A page of 2,000 jobs takes about 0.15 s to read and
        encode; on the loop, every submission, agent message and other request waited that out
        (a script polling that page on a busy demo took a submitter's p99 to 265-460 ms;
        tests/bench/bench_tui_busy.py). Off it, the loop keeps its turns: SQLite and PostgreSQL
        read without the interpreter's lock, and the interpreter switches threads every 5 ms.

        With `who`, the read is charged to that user's share of the reads (its CPU time), and
        refused (Throttled) before it starts when the user has spent it."""
        with self._charging(who) as cost:
            return await self._on_read_thread(fn, cost)

    @contextlib.contextmanager
    def _charging(self, who: Caller | None) -> Iterator[list[float]]:
        """Admit `who`'s read (Throttled when their share is spent), then charge them the CPU
        seconds the block adds to the yielded list, even when it raises. No `who`: no charge."""
        if who is not None:
            self.read_budget.admit(who.user)
        cost = [0.0]
        try:
            yield cost
        finally:
            if who is not None:
                self.read_budget.charge(who.user, cost[0])
                self.diag.read(who.user, cost[0])

    async def _on_read_thread(self, fn: Callable[[], T], cost: list[float]) -> T:
        """`fn()` on a read thread, adding the CPU seconds it took to `cost[0]`."""

        def timed() -> T:
            t0 = time.thread_time()
            try:
                return fn()
            finally:
                cost[0] += time.thread_time() - t0

        return await asyncio.get_running_loop().run_in_executor(self._reads, timed)

    async def _page(self, who: Caller, long: bool, in_reader: tuple,
                    on_thread: Callable[[], tuple[bytes, bool]]) -> tuple[bytes, bool]:
        """A listing's encoded body (views.encoded) that can be long, charged to `who`'s share:
        `in_reader` (a function of scheduler.daemon.readers and its arguments) in a reader
        process when `long` and the readers are up; else, and when a reader dies under it,
        `on_thread()` on a read thread. A long one that costs a thread READERS_WORTH_S starts
        the readers."""
        with self._charging(who) as cost:
            if long and self.readers.ready:
                try:
                    body, gzipped, cost[0] = await self.readers.run(*in_reader)
                    return body, gzipped
                except BrokenProcessPool:
                    pass  # a reader died under it (killed, out of memory): this one on a thread
            page = await self._on_read_thread(on_thread, cost)
        if long and cost[0] >= READERS_WORTH_S:
            self.readers.start()  # listings this long cost enough to hand to processes
        return page

    async def job_page(self, who: Caller, f: JobFilter, accept_encoding: str | None) -> tuple[bytes, bool]:
        """A page of `GET /v1/jobs` as `who` sees it, encoded (views.encoded): a long one (`limit`
        of READER_FROM or more) in a reader process once they are up, a short one on the read
        threads (`_page`)."""
        uses = self.policy.backfill_on_prediction
        return await self._page(who, f.limit >= READER_FROM, (job_page, f, who, uses, accept_encoding),
                                lambda: encoded(self.jobs.list(who, f), accept_encoding))

    async def event_page(self, who: Caller, since: int | None, limit: int,
                         accept_encoding: str | None) -> tuple[bytes, bool]:
        """A page of `GET /v1/events`, encoded: a long one (`limit` of READER_FROM or more, up
        to 10,000 events) in a reader process once they are up, as a job page (`_page`)."""
        return await self._page(who, limit >= READER_FROM, (event_page, since, limit, accept_encoding),
                                lambda: encoded(self.overview.events(since, limit), accept_encoding))

    async def sacct_page(self, who: Caller, q: Sacct, accept_encoding: str | None) -> tuple[bytes, bool]:
        """`GET /v1/accounting/jobs` for a checked request (Accounting.sacct), encoded: a window
        in a reader process once they are up (a day's is ~0.16 s on a busy cluster), jobs named
        by id (sacct -j) on the read threads (`_page`)."""
        return await self._page(who, not q.ids, (sacct_page, q, accept_encoding),
                                lambda: encoded(sacct_jobs(self.engine, q), accept_encoding))

    async def stop(self) -> None:
        self._running = False
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await self._leave_office()
        self.leadership.close()
        await self.gate.stop()
        await self.links.stop_all()
        await self.notifications.stop()
        self.accounting.idle.flush(self.clock.time())
        self.store.close_streams()
        await asyncio.to_thread(self._reads.shutdown)  # the reads in flight end first
        await asyncio.to_thread(self.readers.stop)
        self.engine.dispose()

    def close_streams(self) -> None:
        self.store.close_streams()

    def wake(self) -> None:
        self.cycle.wake()

    def unix_user(self, user: str) -> str:
        """The Unix account a user's jobs run as: `[users]` in trainyard.toml, its "*" entry, else the same name."""
        return self.users.get(user) or self.users.get("*") or user

    def schedule_once(self) -> int:
        return self.cycle.run_once()

    # ---------------------------------------------------------------- agents
    def on_agent_message(self, name: str, msg: dict) -> None:
        self.diag.agent_messages += 1
        ev = msg.get("ev")
        try:
            if ev == "telemetry":
                sample = {"time": msg.get("time"), "gpus": settled(msg.get("gpus", ())), "source": msg.get("source")}
                self.links.telemetry[name] = sample
                self.health.observe(name, sample)
                self.gate.observe(name, sample)
                self.idle.observe(name, sample)
                self.accounting.observe(name, sample)
            elif ev == "output":
                self.logstore.on_output(name, msg)
            elif ev in ("pty_data", "pty_close"):
                self.ptys.on_event(name, msg)
            elif ev in STEP_EVENTS:
                self.steps.on_event(name, msg)
            elif ev == "hello":
                self.gate.on_hello(self.reconciler.on_hello(name, msg))
                self.ptys.node_restarted(name)
                self.steps.node_restarted(name)
            elif self.gate.owns(msg.get("key")):  # a health check's job, not a user's
                self.gate.on_agent_event(name, msg)
            elif ev == "started":
                self.reconciler.on_started(name, msg["key"], msg.get("image_digest"))
            elif ev == "exited":
                end = RankExit(msg.get("rc"), lost=bool(msg.get("lost")), oom=bool(msg.get("oom")))
                self.reconciler.on_exited(name, msg["key"], end, msg.get("end_time"))
            elif ev == "pulled":
                if msg.get("key"):
                    self.store.audit("trainyard", "job.pulled", str(msg["key"]).partition(".")[0],
                                     {"node": name, "image": msg.get("image"), "digest": msg.get("digest"),
                                      "cached": bool(msg.get("cached")), "error": msg.get("error") or None})
                failed = self.dispatcher.on_pulled(name, msg)
                if failed is not None:
                    self.reconciler.on_launch_failed(name, f"{failed[0].id}.{failed[0].attempt}", failed[1])
            elif ev == "pull_progress":
                self.reconciler.on_pull_progress(name, msg)
            elif ev == "launch_failed":
                self.reconciler.on_launch_failed(name, msg["key"], str(msg.get("reason", "")))
            elif ev == "error":
                log.warning("node %s: agent error: %s", name, msg.get("error"))
        except (KeyError, TypeError, ValueError) as e:  # a malformed message never stops the link
            log.warning("node %s: dropped malformed %s message: %s", name, ev, e)

    def _on_link_problem(self, name: str, error: str) -> None:
        self.store.audit("trainyard", "node.unreachable", name, {"error": error})

    def _queue_selector(self, queue: str) -> dict[str, str]:
        qp = self.policy.queues.get(queue)
        return dict(qp.node_selector) if qp is not None else {}

    def _drain_for_health(self, name: str, verdicts: list[str]) -> None:
        self.inventory.drain_for_health(name, verdicts)

    def _observe_started(self, job: Job) -> None:
        t0 = self.cycle.starting_since.pop(job.id, None)
        if t0 is not None:
            self.metrics.dispatch_latency.observe(self.clock.monotonic() - t0)
        self.metrics.submit_to_running.observe(max(0.0, self.clock.time() - job.submit_time))

    # ---------------------------------------------------------------- housekeeping
    async def _housekeeping_loop(self) -> None:
        while self._running:
            await asyncio.sleep(0.5)
            try:
                self.housekeeping(self.clock.time())
            except Exception:
                log.exception("housekeeping failed")

    def housekeeping(self, now: float) -> None:
        if now >= self._logs_expire_at:  # hourly: jobs' output past [logs] retention_days
            self._logs_expire_at = now + 3600
            self.logstore.expire(now)
            self.accounting.idle.trim(now)
        if self.retention.active and now >= self._purge_at:  # a batch a tick until none is left, then hourly
            done = self.retention.step(now)
            self._purge_at = now + (0.0 if done.jobs or done.events else 3600)
        self.gate.recheck_idle(now)
        with self.store.tx() as s:
            self.lifecycle.enforce_limits(s, now)
            self.idle.enforce(s, now)
            for name, since in list(self.links.unreachable_since.items()):
                if now - since < self.config.node_grace_s:
                    continue
                node = s.get(Node, name)
                if node is not None:
                    self.inventory.mark_down(s, node, since, now)

    # ---------------------------------------------------------------- node views
    def nodes_listing(self, compressed: bool = False) -> bytes:
        """GET /v1/nodes as JSON, never stale. On the leader each node's part is kept, rendered,
        with what it was made from (its row, its link's state, its last telemetry sample, the
        GPUs jobs hold on it, its excluded GPUs) and made again only when one of those changed:
        at 1,000 nodes sending telemetry every 2 s (a ~6 MB listing) a request costs what the
        nodes that changed since the last one cost. `compressed`: the same JSON as one gzip
        member, each node's part compressed once per change too (when first asked for; about a
        quarter of its size), so a compressed listing also costs what changed. A standby renders
        (and compresses) every node each time."""
        if not self.leadership.leading:
            self._node_parts = {}
            body = json_bytes(self.node_views())
            return gzip_bytes(body) if compressed else body
        with self.store.read() as s:
            used = self.overview.usage(s)
            rows = self._node_rows(s)
        kept, parts = self._node_parts, {}
        links, telemetry = self.links, self.links.telemetry
        for n in rows:
            name = n.name
            inputs = (n, telemetry.get(name), links.connected(name), links.problem(name),
                      used.get(name, 0), self.health.excluded_gpus(name))
            was = kept.get(name)
            if was is None or not _same_inputs(was.inputs, inputs):
                was = _NodePart(inputs, json_bytes(self._node_view(n, used)))
            parts[name] = was
        self._node_parts = parts
        if not compressed:
            return b"[" + b",".join(part.json for part in parts.values()) + b"]"
        # the first node's part goes without the comma the others' compressed parts begin with
        crc, size, pieces = zlib.crc32(b"["), 1, [_OPEN]
        for i, part in enumerate(parts.values()):
            if i == 0:
                pieces.append(deflate_piece(part.json))
            else:
                pieces.append(part.deflated())
                crc, size = zlib.crc32(b",", crc), size + 1
            crc, size = zlib.crc32(part.json, crc), size + len(part.json)
        pieces.append(_CLOSE)
        return gzip_joined(pieces, zlib.crc32(b"]", crc), size + 1)

    def _node_rows(self, s: Session) -> list[SimpleNamespace]:
        """Every node's row, decoded once per change of the node table on the leader (whose
        writes are the only ones; a standby reads them each time)."""
        t = Node.__table__
        return self._node_rows_seen.get(lambda: row_objects(s.connection().execute(sa_select(t).order_by(t.c.name))),
                                        fresh=not self.leadership.leading)

    def node_views(self, name: str | None = None) -> list[dict[str, Any]]:
        with self.store.read() as s:
            # the leader keeps allocated GPUs per node in memory; a standby reads them
            used = self.overview.usage(s)
            # rows, not ORM objects, for the list: it answers every TUI refresh on 1,000 nodes
            nodes = [Inventory.get(s, name)] if name is not None else self._node_rows(s)
            return [self._node_view(n, used) for n in nodes]

    def _node_view(self, n, used: dict[str, int]) -> dict[str, Any]:
        return {**node_json(n, connected=self.links.connected(n.name), problem=self.links.problem(n.name),
                            gpus_used=used.get(n.name, 0), telemetry=self.links.telemetry.get(n.name),
                            excluded=self.health.excluded_gpus(n.name)),
                "health_checks": n.health_checks or {}}

    # ---------------------------------------------------------------- for metrics (read-only)
    @property
    def telemetry(self) -> dict[str, dict]:
        return self.links.telemetry

    def gpu_usage(self, s: Session) -> dict[str, int]:
        return Overview.gpu_usage(s)

    # ---------------------------------------------------------------- its own load (sdiag)
    def _read_refused(self, user: str) -> None:
        self.metrics.read_throttled(user)
        self.diag.refused(user)

    def _job_totals(self) -> dict[str, int]:
        """The job counters since the daemon started: submitted, started, and ended by state."""
        totals = {"submitted": _counter_total(self.metrics.submitted),
                  "started": _counter_total(self.metrics.started)}
        for metric in self.metrics.finished.collect():
            for sample in metric.samples:
                if sample.name.endswith("_total"):
                    key = sample.labels["state"].lower()
                    totals[key] = totals.get(key, 0) + int(sample.value)
        return totals

    def diag_report(self, who: Caller) -> dict[str, Any]:
        """GET /v1/diag: the daemon's load since its start or the last reset. Every caller sees
        the figures; the requests of each user only an operator."""
        now = self.clock.time()
        out: dict[str, Any] = {"time": now, "role": self.leadership.role,
                               "reason": self.leadership.reason or None,
                               "epoch": self.leadership.epoch or None, "url": self.url,
                               "database": "postgresql" if self.leadership.postgres else "sqlite",
                               "pid": os.getpid(), **self.diag.summary(now)}
        totals = self._job_totals()
        since = {k: v - self._diag_base.get(k, 0) for k, v in totals.items()}
        jobs = {"submitted": since.pop("submitted"), "started": since.pop("started")}
        for state in (m.COMPLETED, m.FAILED, m.CANCELLED, m.TIMEOUT):
            jobs[state.lower()] = since.pop(state.lower(), 0)
        jobs.update(sorted(since.items()))
        with self.store.read() as s:
            live: dict[str, int] = {}
            for state, _queue, n in self.store.job_counts(s, final=False):
                live[state.lower()] = live.get(state.lower(), 0) + n
        jobs["now"] = {"pending": live.pop("pending", 0), "running": live.pop("running", 0), **live}
        out["jobs"] = jobs
        window = max(out["window_s"], 1e-9)
        messages = self.diag.agent_messages
        out["agents"] = {"nodes": len(self.links.names()), "connected": self.links.connected_count(),
                         "messages": messages, "messages_per_s": round(messages / window, 1)}
        requests, reads = self.diag.requests, self.diag.reads
        api: dict[str, Any] = {"requests": sum(requests.values()),
                               "requests_per_s": round(sum(requests.values()) / window, 1),
                               "reads": sum(r[0] for r in reads.values()),
                               "read_cpu_s": round(sum(r[1] for r in reads.values()), 3),
                               "reads_throttled": sum(r[2] for r in reads.values()), "users": len(requests)}
        if who.at_least("operator"):  # who loads the daemon, by name: the requests, and what reads cost
            none = (0, 0.0, 0)
            api["by_user"] = [{"user": u, "requests": n, "reads": reads.get(u, none)[0],
                               "read_cpu_s": round(reads.get(u, none)[1], 3),
                               "reads_throttled": reads.get(u, none)[2]}
                              for u, n in sorted(requests.items(), key=lambda kv: (-kv[1], kv[0]))]
        out["api"] = api
        return out

    def diag_reset(self, who: Caller) -> dict[str, Any]:
        """`sdiag --reset`: the counts and worst cases start again from now (operators)."""
        if not who.at_least("operator"):
            raise Forbidden(f"resetting the daemon's statistics needs the operator role; {who.user} is "
                            f"{who.role}")
        self._diag_base = self._job_totals()
        self.diag.reset()
        self.store.audit(who.user, "diag.reset", "daemon", {}, who.address)
        return self.diag_report(who)

    def job_counts(self, s: Session) -> list[tuple[str, str, int]]:
        return self.store.job_counts(s)

    def caller(self, user: str, role: str, address: str = "") -> Caller:
        return Caller(user, role, address)


def _counter_total(counter) -> int:
    """The sum of a prometheus_client counter over its labels."""
    return int(sum(sample.value for metric in counter.collect() for sample in metric.samples
                   if sample.name.endswith("_total")))


__all__ = ["Daemon", "m"]
