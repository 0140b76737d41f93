"""The daemon's loop: reconcile with the nodes, plan, commit, then dispatch (write-ahead)."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import logging
import time
from collections.abc import Iterator
from pathlib import Path

import asyncssh
from sqlalchemy import bindparam, insert, literal_column, update
from sqlalchemy import select as sa_select
from sqlmodel import Session, col, func, select

from . import models as m
from .auth import hash_token, new_token
from .config import DaemonConfig, client_config_path, write_private
from .health import DRAIN_NODE, EXCLUDE_GPU, HealthRules, TelemetryHistory, evaluate
from .metrics import Metrics
from .models import Event, Job, Node, Queue, Token
from .nodes import NodeLink, SshSettings, SshTarget
from .planner import (
    JobView,
    NodeView,
    PolicyConfig,
    QueueView,
    Snapshot,
    UsageLedger,
    depends_on,
    plan,
)
from .store import init_schema, make_engine

log = logging.getLogger("trainyard.daemon")


class Refused(Exception):
    """The daemon refuses a request; status is the HTTP code, the message is for people."""

    def __init__(self, message: str, status: int = 409):
        super().__init__(message)
        self.status = status


def job_key(job: Job) -> str:
    return f"{job.id}.{job.attempt}"


def parse_key(key: str) -> tuple[int, int]:
    a, _, b = key.partition(".")
    return int(a), int(b or 0)


class Daemon:
    def __init__(self, config: DaemonConfig, home: Path):
        self.config = config
        self.home = home
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.db_url = config.db or str(home / "trainyard.db")
        self.engine = make_engine(self.db_url)
        self.known_hosts = home / "known_hosts"
        self.key_path = home / "ssh" / "id_ed25519"
        self.links: dict[str, NodeLink] = {}
        self.telemetry: dict[str, dict] = {}
        self.link_error: dict[str, str] = {}
        self.unreachable_since: dict[str, float] = {}
        self.rank_exits: dict[int, dict[str, tuple[int | None, bool]]] = {}
        self.starting_since: dict[int, float] = {}
        self.subscribers: set[asyncio.Queue] = set()
        self.metrics = Metrics(self)
        # raises ValueError naming the key for a bad [scheduler]/[queues]/[teams] table
        self.policy = PolicyConfig.from_dict(config.policy)
        self.ledger = UsageLedger(self.policy.fairshare_half_life_s)
        self.health = HealthRules.from_dict(config.health)
        self.history = TelemetryHistory(self.health.history_samples)
        self.health_acted: dict[str, set[str]] = {}  # verdict keys already acted on, per node
        self.excluded_gpus: dict[str, dict[int, str]] = {}  # node -> GPU -> why it is out of allocation
        self.last_cycle_s = 0.0
        self._pending_cache: dict[int, tuple[tuple, JobView]] = {}
        self.url = ""
        self._wake: asyncio.Event | None = None
        self._tasks: list[asyncio.Task] = []
        self._running = False
        self.ssh_settings = SshSettings(
            known_hosts=str(self.known_hosts),
            connect_timeout_s=config.connect_timeout_s,
            keepalive_interval_s=config.keepalive_interval_s,
            keepalive_count_max=config.keepalive_count_max,
            reconnect_max_backoff_s=config.reconnect_max_backoff_s,
            telemetry_interval_s=config.telemetry_interval_s,
        )

    # ------------------------------------------------------------------ lifecycle
    def prepare(self) -> None:
        """Everything that needs no event loop: schema, the SSH key, the default queue."""
        init_schema(self.engine)
        self.ensure_ssh_key()
        self.known_hosts.touch(mode=0o600, exist_ok=True)
        with self.tx() as s:
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
            self.load_usage(s)

    def load_usage(self, s: Session) -> None:
        """Rebuild the fair-share ledger from the runs of the last ten half-lives."""
        since = time.time() - 10 * self.policy.fairshare_half_life_s
        rows = s.exec(select(Job.user, Job.account, Job.gpus, Job.nodes, Job.start_time, Job.end_time)
                      .where(col(Job.end_time) > since, col(Job.start_time).is_not(None))
                      .order_by(col(Job.end_time))).all()
        for user, account, gpus, nodes, start, end in rows:
            team = account or self.policy.user_team.get(user, "default")
            self.ledger.charge_run(user, team, gpus * nodes, start, end)

    def ensure_ssh_key(self) -> None:
        if self.key_path.exists():
            return
        self.key_path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        key = asyncssh.generate_private_key("ssh-ed25519", comment="trainyard-daemon")
        write_private(self.key_path, key.export_private_key().decode())
        (self.key_path.parent / "id_ed25519.pub").write_text(key.export_public_key().decode())

    def create_token(self, user: str, role: str, created_by: str, address: str = "") -> str:
        """A new API token; only its hash is stored, the secret is returned once."""
        token = new_token()
        with self.tx() as s:
            s.add(Token(user=user, role=role, token_hash=hash_token(token), created_at=time.time(),
                        created_by=created_by))
            self.record(s, created_by, "token.create", user, {"role": role}, address)
        return token

    def bootstrap_admin(self, url: str) -> str | None:
        """On the first start, create an admin token for the local user and write client.toml."""
        with Session(self.engine) as s:
            if s.exec(select(Token)).first() is not None:
                return None
        token = self.create_token(getpass.getuser(), "admin", "first-start")
        write_private(client_config_path(), f'url = "{url}"\ntoken = "{token}"\n')
        return token

    async def start(self) -> None:
        self._wake = asyncio.Event()
        self._running = True
        with Session(self.engine) as s:
            for node in s.exec(select(Node)).all():
                self.start_link(node)
        self._tasks = [
            asyncio.create_task(self._schedule_loop(), name="schedule"),
            asyncio.create_task(self._housekeeping_loop(), name="housekeeping"),
        ]

    async def stop(self) -> None:
        self._running = False
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        await asyncio.gather(*(link.stop() for link in self.links.values()), return_exceptions=True)
        self.links.clear()
        self.close_streams()
        self.engine.dispose()

    def close_streams(self) -> None:
        """End every server-sent event stream (their readers reconnect to the next daemon)."""
        for q in list(self.subscribers):
            q.put_nowait(None)
        self.subscribers.clear()

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    # ------------------------------------------------------------------ state and events
    @contextlib.contextmanager
    def tx(self) -> Iterator[Session]:
        """One transaction; the events recorded in it are published only after it commits."""
        s = Session(self.engine, expire_on_commit=False)
        events: list[dict] = []
        s.info["events"] = events
        try:
            yield s
            s.commit()
        except BaseException:
            s.rollback()
            raise
        finally:
            s.close()
        for ev in events:
            self.publish(ev)

    def record(self, s: Session, actor: str, action: str, target: str, detail: dict | None = None,
               address: str = "") -> dict:
        """Add an audit/state event to the transaction; it is published once the transaction commits."""
        ev = {"time": time.time(), "actor": actor, "action": action, "target": target, "address": address,
              "detail": detail or {}}
        # a Core insert: events are written on every change, and ORM objects cost more than the row
        ev["id"] = s.execute(insert(Event.__table__), ev).inserted_primary_key[0]
        s.info["events"].append(ev)
        return ev

    def publish(self, data: dict) -> None:
        for q in list(self.subscribers):
            if q.qsize() > 10000:  # a stuck reader: drop it rather than grow without bound
                self.subscribers.discard(q)
                q.put_nowait(None)
                continue
            q.put_nowait(data)

    def set_state(self, s: Session, job: Job, state: str, reason: str = "", actor: str = "trainyard",
                  **detail) -> None:
        job.state = state
        job.reason = reason
        s.add(job)
        self.record(s, actor, "job.state", str(job.id),
                    {"state": state, "reason": reason, "user": job.user, **detail})

    # ------------------------------------------------------------------ nodes
    def target(self, node: Node) -> SshTarget:
        return SshTarget(node.name, node.address, node.port, node.user, node.key_path or str(self.key_path),
                         node.agent_dir, node.gpus_total, node.gpu_model)

    def start_link(self, node: Node) -> None:
        link = NodeLink(self.target(node), self.ssh_settings, self.on_agent_message, self.on_link)
        self.links[node.name] = link
        if node.name not in self.unreachable_since:
            self.unreachable_since[node.name] = time.time()
        link.start()

    async def stop_link(self, name: str) -> None:
        link = self.links.pop(name, None)
        if link is not None:
            await link.stop()
        self.telemetry.pop(name, None)
        self.history.forget(name)
        self.health_acted.pop(name, None)
        self.excluded_gpus.pop(name, None)
        self.link_error.pop(name, None)
        self.unreachable_since.pop(name, None)

    def connected(self, name: str) -> bool:
        link = self.links.get(name)
        return link is not None and link.connected

    async def on_link(self, name: str, up: bool, error: str) -> None:
        if up:
            self.link_error.pop(name, None)
            self.unreachable_since.pop(name, None)
            return
        changed = self.link_error.get(name) != error
        self.link_error[name] = error
        self.unreachable_since.setdefault(name, time.time())
        if changed:  # one event per new problem, not one per reconnect attempt
            with self.tx() as s:
                self.record(s, "trainyard", "node.unreachable", name, {"error": error})

    def on_agent_message(self, name: str, msg: dict) -> None:
        ev = msg.get("ev")
        if ev == "telemetry":
            sample = {"time": msg.get("time"), "gpus": msg.get("gpus", []), "source": msg.get("source")}
            self.telemetry[name] = sample
            self.on_telemetry(name, sample)
        elif ev == "hello":
            self.on_hello(name, msg)
        elif ev == "started":
            self.on_started(name, msg["key"])
        elif ev == "exited":
            self.on_exited(name, msg["key"], msg.get("rc"), bool(msg.get("lost")), msg.get("end_time"))
        elif ev == "error":
            log.warning("node %s: agent error: %s", name, msg.get("error"))

    def on_telemetry(self, name: str, sample: dict) -> None:
        """Apply the health rules: drain the node or take a GPU out of allocation, once per cause."""
        self.history.add(name, sample)
        verdicts = evaluate(self.health, name, self.history.samples(name), time.time())
        acted = self.health_acted.get(name, set())
        excluded = {g["index"]: "fell off the bus" for g in sample["gpus"] if g.get("off_bus")}
        for v in verdicts:
            if v.action == EXCLUDE_GPU:
                excluded[v.gpu] = v.reason
        if excluded != self.excluded_gpus.get(name, {}):
            self.excluded_gpus[name] = excluded
            self.wake()
        new = [v for v in verdicts if v.key not in acted and v.action == DRAIN_NODE]
        self.health_acted[name] = {v.key for v in verdicts}  # a cause that clears is forgotten
        if not new:
            return
        with self.tx() as s:
            node = s.get(Node, name)
            if node is None:
                return
            reason = "health: " + "; ".join(v.reason for v in new)
            self.record(s, "trainyard", "node.health", name, {"verdicts": [v.reason for v in new]})
            if node.state in (m.UP, m.DRAINING, m.DRAINED):
                self.drain(s, node, reason[:500], "trainyard")

    def drain(self, s: Session, node: Node, reason: str, actor: str, address: str = "") -> None:
        """Stop new work on a node: DRAINING while jobs run there, DRAINED once none do."""
        node.state = m.DRAINING if self.active_jobs_on(s, node.name) else m.DRAINED
        node.reason = reason
        s.add(node)
        self.record(s, actor, "node.drain", node.name, {"state": node.state, "reason": reason}, address)

    async def inject_fault(self, name: str, gpu: int, kind: str, value) -> dict:
        link = self.links.get(name)
        if link is None:
            raise Refused(f"node {name} is not known to the daemon", 404)
        reply = await link.request({"op": "fault", "gpu": gpu, "kind": kind, "value": value})
        if reply.get("ev") == "error":
            raise Refused(f"node {name}: {reply.get('error')}", 409)
        return reply

    def on_hello(self, name: str, msg: dict) -> None:
        with self.tx() as s:
            node = s.get(Node, name)
            if node is None:
                return
            if msg.get("gpu_source") in ("nvml", "simulated", "declared"):
                node.gpu_indices = [g["index"] for g in msg.get("gpus", [])]
                node.gpus_total = len(node.gpu_indices)
                node.gpu_model = msg.get("gpu_model") or node.gpu_model
            else:
                node.gpu_indices = []
                node.gpus_total = 0
            node.cpus = int(msg.get("cpus") or 0)
            node.mem_mb = int(msg.get("mem_mb") or 0)
            node.last_seen = time.time()
            if node.state in (m.DOWN, m.PROVISIONING) or (node.state == m.BOOTSTRAPPING and not node.reason):
                node.state = m.UP
                node.reason = ""
                self.record(s, "trainyard", "node.state", name, {"state": m.UP, "gpu_source": msg.get("gpu_source")})
            s.add(node)
        asyncio.get_running_loop().create_task(self.resync(name))

    async def resync(self, name: str) -> None:
        """Ask the agent what runs and what ended while nobody listened, and reconcile."""
        link = self.links.get(name)
        if link is None:
            return
        try:
            reply = await link.request({"op": "sync"}, timeout=30)
        except Exception as e:  # the link dropped again; the next hello retries
            log.info("node %s: sync failed: %s", name, e)
            return
        self.reconcile(name, reply.get("jobs", []))

    def reconcile(self, name: str, reports: list[dict]) -> None:
        reported = {r["key"]: r for r in reports}
        relaunch: list[Job] = []
        orphans: list[str] = []
        forget: list[str] = []
        watch: dict[str, dict] = {}
        with self.tx() as s:
            for job in self.active_jobs_on(s, name):
                key = job_key(job)
                r = reported.pop(key, None)
                gpus = next((a["gpus"] for a in job.allocation if a["node"] == name), [])
                state = r["state"] if r else "unknown"
                if state == "unknown":
                    if job.state == m.STARTING:
                        relaunch.append(job)  # the launch never arrived: send it again
                    else:
                        self.rank_ended(s, job, name, None, lost=True)
                elif state in ("running", "starting"):
                    watch[key] = {"gpus": gpus, "job_id": job.id}
                    if job.state == m.STARTING and state == "running":
                        self.set_state(s, job, m.RUNNING)
                elif state in ("exited", "lost"):
                    self.rank_ended(s, job, name, r.get("rc"), lost=state == "lost")
            for key, r in reported.items():
                if r["state"] in ("running", "starting"):
                    orphans.append(key)
                    self.record(s, "trainyard", "job.orphan", key, {"node": name, "action": "SIGKILL"})
                else:
                    forget.append(key)
        link = self.links.get(name)
        if link is None:
            return
        for job in relaunch:
            self.dispatch_rank(job, name)
        for key in orphans:
            link.send({"op": "signal", "key": key, "sig": "KILL"})
        if forget:
            link.send({"op": "forget", "keys": forget})
        if watch:
            link.send({"op": "watch", "jobs": watch})
        self.wake()

    def active_jobs_on(self, s: Session, name: str) -> list[Job]:
        jobs = s.exec(select(Job).where(col(Job.state).in_(m.ACTIVE_STATES))).all()
        return [j for j in jobs if any(a["node"] == name for a in j.allocation)]

    # ------------------------------------------------------------------ job lifecycle
    def on_started(self, name: str, key: str) -> None:
        job_id, attempt = parse_key(key)
        with self.tx() as s:
            job = s.get(Job, job_id)
            if job is None or job.attempt != attempt or job.state != m.STARTING:
                return
            self.set_state(s, job, m.RUNNING, node=name)
        t0 = self.starting_since.pop(job_id, None)
        if t0 is not None:
            self.metrics.dispatch_latency.observe(time.time() - t0)
        self.metrics.submit_to_running.observe(max(0.0, time.time() - job.submit_time))

    def on_exited(self, name: str, key: str, rc: int | None, lost: bool, end_time: float | None) -> None:
        job_id, attempt = parse_key(key)
        with self.tx() as s:
            job = s.get(Job, job_id)
            if job is None or job.attempt != attempt or job.state not in m.ACTIVE_STATES:
                stale = True
            else:
                stale = False
                self.rank_ended(s, job, name, rc, lost, end_time)
        if stale:
            link = self.links.get(name)
            if link:
                link.send({"op": "forget", "keys": [key]})

    def rank_ended(self, s: Session, job: Job, node: str, rc: int | None, lost: bool,
                   end_time: float | None = None) -> None:
        exits = self.rank_exits.setdefault(job.id, {})
        exits[node] = (rc, lost)
        ranks = [a["node"] for a in job.allocation]
        if len(exits) < len(ranks):
            # one rank of a gang ended early: a failure ends the whole job
            if (lost or rc != 0) and not job.kill_reason:
                job.kill_reason, job.kill_time = "rank_failed", time.time()
                s.add(job)
                self.signal_job(job, "TERM", skip=set(exits))
            return
        self.finish(s, job, exits, end_time)

    def finish(self, s: Session, job: Job, exits: dict, end_time: float | None = None) -> None:
        """All ranks have ended: decide the final state, requeue where allowed, free the nodes."""
        self.rank_exits.pop(job.id, None)
        self.starting_since.pop(job.id, None)
        key = job_key(job)
        nodes = [a["node"] for a in job.allocation]
        lost = [n for n, (_, was_lost) in exits.items() if was_lost]
        codes = [rc for n, (rc, _) in sorted(exits.items(), key=lambda kv: nodes.index(kv[0]) if kv[0] in nodes else 0)]
        failed_rc = next((rc for rc in codes if rc not in (0, None)), None)
        job.end_time = end_time or time.time()
        if job.start_time:
            gpus = job.gpus * len(nodes)
            job.attained_gpu_s += gpus * max(0.0, job.end_time - job.start_time)
            team = job.account or self.policy.user_team.get(job.user, "default")
            self.ledger.charge_run(job.user, team, gpus, job.start_time, job.end_time)
        job.exit_code = failed_rc if failed_rc is not None else (codes[0] if codes else None)
        reason = ""
        if job.kill_reason == "node_fail":  # the daemon gave up on the node (down, removed)
            state, reason = m.NODE_FAIL, job.reason or "node down"
        elif job.kill_reason == "cancel":
            state = m.CANCELLED
        elif job.kill_reason == "timeout":
            state, reason = m.TIMEOUT, f"time limit {job.time_limit_s}s reached"
        elif job.kill_reason == "preempt":
            state = m.PREEMPTED
        elif job.kill_reason == "requeue":
            state = "REQUEUE"
        elif lost:
            state, reason = m.NODE_FAIL, f"lost on {', '.join(lost)}"
        elif failed_rc is None:
            state = m.COMPLETED
        else:
            state, reason = m.FAILED, f"exit code {failed_rc}"
        for n in nodes:
            link = self.links.get(n)
            if link:
                link.send({"op": "forget", "keys": [key]})
        if state == "REQUEUE":
            self.requeue(s, job, "requeued by request")
        elif state == m.PREEMPTED:
            self.set_state(s, job, m.PREEMPTED, job.reason, exit_code=job.exit_code)
            self.requeue(s, job, "requeued after preemption")
        elif state in (m.FAILED, m.NODE_FAIL) and job.failures < job.retries:
            self.set_state(s, job, state, reason, exit_code=job.exit_code)
            job.failures += 1
            self.requeue(s, job, f"retry {job.failures} of {job.retries} after {state}")
        else:
            self.set_state(s, job, state, reason, exit_code=job.exit_code)
            job.kill_reason = ""
            s.add(job)
        self.settle_drains(s, nodes)
        self.wake()

    def requeue(self, s: Session, job: Job, why: str) -> None:
        job.attempt += 1
        job.allocation = []
        job.start_time = None
        job.end_time = None
        job.kill_reason = ""
        job.kill_time = None
        job.exit_code = None
        job.eligible_time = time.time()
        self.set_state(s, job, m.PENDING, why)

    def settle_drains(self, s: Session, nodes: list[str]) -> None:
        for name in nodes:
            node = s.get(Node, name)
            if node is not None and node.state == m.DRAINING and not self.active_jobs_on(s, name):
                node.state = m.DRAINED
                s.add(node)
                self.record(s, "trainyard", "node.state", name, {"state": m.DRAINED, "reason": node.reason})

    def signal_job(self, job: Job, sig: str, skip: set[str] = frozenset()) -> None:
        for a in job.allocation:
            if a["node"] in skip:
                continue
            link = self.links.get(a["node"])
            if link is not None:
                link.send({"op": "signal", "key": job_key(job), "sig": sig})

    def kill(self, s: Session, job: Job, why: str) -> None:
        """Ask a running job to stop: SIGTERM now, SIGKILL after the grace period."""
        if job.kill_reason in ("cancel", "timeout") and why != "cancel":
            return
        if why != "preempt":
            job.kill_grace_s = None
        job.kill_reason, job.kill_time = why, time.time()
        s.add(job)
        self.signal_job(job, "TERM")

    # ------------------------------------------------------------------ scheduling
    # Columns the planner needs, read as plain Core rows: hydrating ORM objects (or even ORM
    # row results) for thousands of pending jobs per cycle costs more than the planning itself.
    _T = Job.__table__.c
    VIEW_COLUMNS = (_T.id, _T.user, _T.queue, _T.name, _T.gpus, _T.nodes, _T.cpus, _T.mem_mb,
                    _T.gpu_type, _T.priority, _T.submit_time, _T.state, _T.time_limit_s,
                    _T.start_time, _T.allocation, _T.dependency, _T.constraint, _T.exclusive,
                    _T.nice, _T.account, _T.array_parent, _T.array_limit, _T.attained_gpu_s,
                    _T.kill_reason, _T.kill_time, _T.reason, _T.estimated_start, _T.attempt)
    # pending jobs hold no allocation: skip decoding that JSON column for them
    PENDING_COLUMNS = tuple(literal_column("NULL").label("allocation") if c.name == "allocation" else c
                            for c in VIEW_COLUMNS)

    def view_rows(self, s: Session, columns, *where) -> list:
        return s.connection().execute(sa_select(*columns).where(*where)).all()

    def pending_views(self, s: Session) -> tuple[list[JobView], dict[int, tuple]]:
        """The pending jobs as JobViews, decoded only when new or changed since the last cycle.

        While a job stays PENDING only its priority can change (PATCH); a requeue bumps its
        attempt. So (attempt, priority) is the cache key; everything else is fetched once.
        """
        t = self._T
        light = s.connection().execute(sa_select(t.id, t.attempt, t.priority, t.reason, t.estimated_start)
                                       .where(t.state == m.PENDING)).all()
        cache, fresh = self._pending_cache, {}
        missing = []
        for jid, attempt, prio, _reason, _est in light:
            hit = cache.get(jid)
            if hit is not None and hit[0] == (attempt, prio):
                fresh[jid] = hit
            else:
                missing.append(jid)
        for i in range(0, len(missing), 500):
            for r in self.view_rows(s, self.PENDING_COLUMNS, t.id.in_(missing[i:i + 500])):
                fresh[r[0]] = ((r[27], r[9]), job_view_row(r))
        self._pending_cache = fresh
        views = [fresh[jid][1] for jid, *_ in light if jid in fresh]
        return views, {jid: (reason, est) for jid, _a, _p, reason, est in light}

    def snapshot(self, s: Session, now: float) -> tuple[Snapshot | None, dict[int, tuple]]:
        pending, rows = self.pending_views(s)
        if not pending:
            return None, {}
        nodes = s.exec(select(Node)).all()
        active = [job_view_row(r) for r in self.view_rows(s, self.VIEW_COLUMNS,
                                                           self._T.state.in_(m.ACTIVE_STATES))]
        used: dict[str, set[int]] = {}
        cpus_used: dict[str, int] = {}
        mem_used: dict[str, int] = {}
        for j in active:
            for node, gpus in j.allocation:
                used.setdefault(node, set()).update(gpus)
                cpus_used[node] = cpus_used.get(node, 0) + j.cpus
                mem_used[node] = mem_used.get(node, 0) + j.mem_mb
        node_views = tuple(
            NodeView(
                name=n.name, gpus_total=n.gpus_total,
                free_gpus=tuple(g for g in n.gpu_indices if g not in used.get(n.name, ())
                                and g not in self.excluded_gpus.get(n.name, ())),
                cpus_total=n.cpus, cpus_free=n.cpus - cpus_used.get(n.name, 0),
                mem_total_mb=n.mem_mb, mem_free_mb=n.mem_mb - mem_used.get(n.name, 0),
                gpu_model=n.gpu_model, labels=dict(n.labels),
                schedulable=n.state == m.UP and self.connected(n.name),
            )
            for n in nodes
        )
        deps: set[int] = set()
        for j in pending:
            deps.update(depends_on(j.dependency))
        finished = {}
        if deps:
            finished = dict(s.exec(select(Job.id, Job.state).where(col(Job.id).in_(deps))).all())
        queues = {q.name: QueueView(q.name, q.priority, q.open, q.default_time_limit_s, q.max_time_limit_s)
                  for q in s.exec(select(Queue)).all()}
        snap = Snapshot(
            nodes=node_views, pending=tuple(pending), running=tuple(active), queues=queues,
            finished=finished, usage=self.ledger.decayed(now, active, self.policy.team_of),
        )
        return snap, rows

    def schedule_once(self) -> int:
        t0 = time.perf_counter()
        now = time.time()
        started: list[Job] = []
        preempted: list[Job] = []
        with self.tx() as s:
            snap, rows = self.snapshot(s, now)
            if snap is None:
                self.last_cycle_s = time.perf_counter() - t0
                return 0
            decisions = plan(snap, now, self.policy)
            for st in decisions.starts:
                job = s.get(Job, st.job_id)
                job.allocation = [{"node": n, "gpus": list(g)} for n, g in st.allocation]
                job.start_time = now
                job.estimated_start = None
                self.set_state(s, job, m.STARTING, st.reason, allocation=job.allocation)
                started.append(job)
            changed = []
            for w in decisions.waits:
                reason, est = rows[w.job_id]
                if reason != w.reason or est != w.estimated_start:
                    changed.append({"b_id": w.job_id, "b_reason": w.reason, "b_est": w.estimated_start})
            if changed:
                t = Job.__table__
                s.execute(update(t).where(t.c.id == bindparam("b_id"))
                          .values(reason=bindparam("b_reason"), estimated_start=bindparam("b_est")),
                          changed)
            for c in decisions.cancels:
                job = s.get(Job, c.job_id)
                job.end_time = now
                self.set_state(s, job, m.CANCELLED, c.reason)
            for p in decisions.preempts:
                job = s.get(Job, p.job_id)
                if job is None or job.state not in m.ACTIVE_STATES or job.kill_reason:
                    continue
                job.reason = p.reason
                job.kill_grace_s = p.grace_period_s
                self.kill(s, job, "preempt")
                self.record(s, "trainyard", "job.preempt", str(job.id),
                            {"reason": p.reason, "for_job": p.for_job, "grace_s": p.grace_period_s})
                preempted.append(job)
        self.last_cycle_s = time.perf_counter() - t0
        self.metrics.schedule_cycle.observe(self.last_cycle_s)
        for job in started:
            self.starting_since[job.id] = time.time()
            for a in job.allocation:
                self.dispatch_rank(job, a["node"])
        return len(started)

    def dispatch_rank(self, job: Job, node: str) -> None:
        ranks = [a["node"] for a in job.allocation]
        rank = ranks.index(node)
        gpus = job.allocation[rank]["gpus"]
        with Session(self.engine) as s:
            addresses = {n.name: n.address for n in s.exec(select(Node).where(col(Node.name).in_(ranks))).all()}
        env = dict(job.env)
        env.update({
            "TRAINYARD_JOB_ID": str(job.id),
            "TRAINYARD_JOB_NAME": job.name,
            "TRAINYARD_ATTEMPT": str(job.attempt),
            "TRAINYARD_NODELIST": ",".join(ranks),
            "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus),
            "MASTER_ADDR": addresses.get(ranks[0], ranks[0]),
            "MASTER_PORT": str(job.allocation[0].get("port") or master_port(job)),
            "WORLD_SIZE": str(len(ranks)),
            "NNODES": str(len(ranks)),
            "NODE_RANK": str(rank),
            "TRAINYARD_NODE_RANK": str(rank),
        })
        if job.array_task_id is not None:
            env["TRAINYARD_ARRAY_TASK_ID"] = str(job.array_task_id)
            env["TRAINYARD_ARRAY_JOB_ID"] = str(job.array_parent or job.id)
        link = self.links.get(node)
        if link is None:
            return
        link.send({"op": "launch", "key": job_key(job), "job_id": job.id, "argv": job.command,
                   "script": job.script, "env": env, "workdir": job.workdir, "gpus": gpus})

    async def _schedule_loop(self) -> None:
        assert self._wake is not None
        while self._running:
            # with nothing new, re-plan now and then (ages, reservations), but a big queue that
            # costs long cycles is re-planned less often when nothing changes
            idle = max(self.config.schedule_interval_s, 10 * self.last_cycle_s)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), idle)
            # Pace the cycles: a burst of submissions is planned together, and scheduling never
            # takes more than about a quarter of the event loop's time from the API.
            await asyncio.sleep(min(0.25, max(0.002, 3 * self.last_cycle_s)))
            self._wake.clear()
            try:
                self.schedule_once()
            except Exception:
                log.exception("scheduling cycle failed")

    # ------------------------------------------------------------------ housekeeping
    async def _housekeeping_loop(self) -> None:
        while self._running:
            await asyncio.sleep(0.5)
            try:
                self.housekeeping(time.time())
            except Exception:
                log.exception("housekeeping failed")

    def housekeeping(self, now: float) -> None:
        t = self._T
        with self.tx() as s:
            # only jobs being stopped or with a time limit can need anything here
            due = s.exec(select(Job).where(col(Job.state).in_(m.ACTIVE_STATES),
                                           (t.kill_reason != "") | t.time_limit_s.is_not(None))).all()
            for job in due:
                grace = self.config.kill_grace_s if job.kill_grace_s is None else job.kill_grace_s
                if job.kill_reason and job.kill_time and now - job.kill_time > grace:
                    job.kill_time = now  # SIGKILL again each grace period until it is gone
                    s.add(job)
                    self.signal_job(job, "KILL")
                elif (not job.kill_reason and job.time_limit_s and job.start_time
                      and now - job.start_time > job.time_limit_s):
                    self.kill(s, job, "timeout")
                    self.record(s, "trainyard", "job.timeout", str(job.id), {"limit_s": job.time_limit_s})
            for name, since in list(self.unreachable_since.items()):
                if now - since < self.config.node_grace_s:
                    continue
                node = s.get(Node, name)
                if node is None:
                    continue
                if node.state != m.DOWN:
                    node.state = m.DOWN
                    node.reason = f"unreachable for {now - since:.0f}s: {self.link_error.get(name, 'no answer')}"
                    s.add(node)
                    self.record(s, "trainyard", "node.state", name, {"state": m.DOWN, "reason": node.reason})
                for job in self.active_jobs_on(s, name):
                    job.kill_reason, job.reason = "node_fail", f"node {name} down"
                    exits = {a["node"]: (None, True) for a in job.allocation}
                    self.signal_job(job, "KILL", skip={name})
                    self.finish(s, job, exits)

    # ------------------------------------------------------------------ queries used by API
    def gpu_usage(self, s: Session) -> dict[str, int]:
        used: dict[str, int] = {}
        for (alloc,) in self.view_rows(s, (self._T.allocation,), self._T.state.in_(m.ACTIVE_STATES)):
            for a in alloc or ():
                used[a["node"]] = used.get(a["node"], 0) + len(a["gpus"])
        return used

    def job_counts(self, s: Session) -> list[tuple[str, str, int]]:
        return list(s.exec(select(Job.state, Job.queue, func.count()).group_by(Job.state, Job.queue)).all())


def master_port(job: Job) -> int:
    return 29500 + (job.id * 7 + job.attempt) % 20000


def job_view_row(r) -> JobView:
    """A JobView from one row of Daemon.VIEW_COLUMNS."""
    (jid, user, queue, name, gpus, nodes, cpus, mem, gpu_type, prio, submit, state, limit, start, alloc,
     dep, constraint, exclusive, nice, account, parent, alimit, attained, kill_reason, kill_time, _r, _e,
     _attempt) = r
    return JobView(
        id=jid, user=user, queue=queue, name=name, gpus=gpus, nodes=nodes, cpus=cpus, mem_mb=mem,
        gpu_type=gpu_type, priority=prio, submit_time=submit, held=state == m.HELD, time_limit_s=limit,
        start_time=start, allocation=tuple((a["node"], tuple(a["gpus"])) for a in alloc or ()),
        dependency=dep or "", constraint=constraint or {}, exclusive=exclusive, nice=nice, account=account,
        array_parent=parent, array_limit=alimit, attained_gpu_s=attained,
        preempted_at=kill_time if kill_reason == "preempt" else None,
    )


def event_json(ev: Event) -> dict:
    return {"id": ev.id, "time": ev.time, "actor": ev.actor, "action": ev.action, "target": ev.target,
            "address": ev.address, "detail": ev.detail}
