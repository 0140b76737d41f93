"""Reconcile: what the agents report (hello, started, exited, sync) against what the database holds."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from .. import models as m
from ..models import Job, Node
from .clock import Clock
from .dispatch import Dispatcher
from .errors import DomainError
from .lifecycle import JobLifecycle, RankExit, job_key, parse_key
from .links import NodeLinks
from .state import StateStore

log = logging.getLogger("trainyard.daemon")

GPU_SOURCES = ("nvml", "simulated", "declared")
# what hello tells about the node that `trainyard nodes` shows (fencing: how jobs are isolated)
AGENT_FACTS = ("protocol", "host", "user", "root", "jobs_as_owners", "min_uid", "fencing", "gpu_note",
               "driver_version", "containers")


class Reconciler:
    """The node is the source of truth for processes (DESIGN.md boundary 2): believe its reports."""

    def __init__(self, store: StateStore, links: NodeLinks, lifecycle: JobLifecycle,
                 dispatcher: Dispatcher, clock: Clock, wake, observe_latency):
        self.store = store
        self.links = links
        self.lifecycle = lifecycle
        self.dispatcher = dispatcher
        self.clock = clock
        self.wake = wake
        self.observe_latency = observe_latency  # (job, started_at) -> None
        self._batch: list[tuple] = []  # reports of this loop tick, committed together

    def on_hello(self, name: str, msg: dict) -> Node | None:
        """Record what the agent says of its node (GPUs, CPUs, memory, its facts; UP if it was
        DOWN), then ask it what runs. The node as committed, for the health gate; None for a
        node removed meanwhile."""
        with self.store.tx() as s:
            node = s.get(Node, name)
            if node is None:
                return None
            if msg.get("gpu_source") in GPU_SOURCES:
                node.gpu_indices = [int(g["index"]) for g in msg.get("gpus", [])]
                node.gpus_total = len(node.gpu_indices)
                node.gpu_model = msg.get("gpu_model") or node.gpu_model
            else:
                node.gpu_indices = []
                node.gpus_total = 0
            node.cpus = int(msg.get("cpus") or 0)
            node.mem_mb = int(msg.get("mem_mb") or 0)
            node.agent_info = {k: msg[k] for k in AGENT_FACTS if k in msg}
            node.last_seen = self.clock.time()
            if node.state in (m.DOWN, m.PROVISIONING) or (node.state == m.BOOTSTRAPPING and not node.reason):
                node.state = m.UP
                node.reason = ""
                self.store.record(s, "trainyard", "node.state", name,
                                  {"state": m.UP, "gpu_source": msg.get("gpu_source")})
            s.add(node)
        asyncio.get_running_loop().create_task(self.resync(name))
        return node

    async def resync(self, name: str) -> None:
        """Ask the agent what runs and what ended while nobody listened, and reconcile."""
        try:
            reply = await self.links.request(name, {"op": "sync"}, timeout=30)
        except DomainError as e:  # the link dropped again; the next hello retries
            log.info("node %s: sync failed: %s", name, e)
            return
        self.reconcile(name, reply.get("jobs", []))

    def reconcile(self, name: str, reports: list[dict]) -> None:
        reported = {r["key"]: r for r in reports if isinstance(r, dict) and "key" in r}
        if self._as_recorded(name, reported):
            return
        relaunch: list[Job] = []
        orphans: list[str] = []
        forget: list[str] = []
        watch: dict[str, dict] = {}
        with self.store.tx() as s:
            for job in self.lifecycle.active_jobs_on(s, name):
                key = job_key(job)
                r = reported.pop(key, None)
                state = r["state"] if r else "unknown"
                if state == "unknown":
                    if job.state == m.CONFIGURING:
                        relaunch.append(job)  # the launch never arrived: send it again
                    else:
                        self.lifecycle.rank_ended(s, job, name, RankExit(None, lost=True))
                elif state in ("running", "starting"):
                    watch[key] = _held(job, name)
                    if job.state == m.CONFIGURING and state == "running":
                        self.store.set_state(s, job, m.RUNNING)
                elif state == "failed":  # the launch was refused on the node (no such account, ...)
                    self.lifecycle.fail_launch(s, job, name, str(r.get("reason", "launch failed")))
                elif state in ("exited", "lost"):
                    self.lifecycle.rank_ended(s, job, name, RankExit(r.get("rc"), lost=state == "lost",
                                                                     oom=bool(r.get("oom"))))
            for key, r in reported.items():
                if r.get("state") in ("running", "starting"):
                    orphans.append(key)
                    self.store.record(s, "trainyard", "job.orphan", key, {"node": name, "action": "SIGKILL"})
                else:
                    forget.append(key)
        for job in relaunch:
            self.dispatcher.dispatch_rank(job, name)
        for key in orphans:
            self.links.send(name, {"op": "signal", "key": key, "sig": "KILL"})
        if forget:
            self.links.send(name, {"op": "forget", "keys": forget})
        if watch:
            self.links.send(name, {"op": "watch", "jobs": watch})
        self.wake()

    def _as_recorded(self, name: str, reported: dict[str, dict]) -> bool:
        """The common case after a reconnect (a daemon's restart, a takeover): every active job
        on the node runs as the database says, and nothing else runs there. Then nothing is
        written, and the agent is told which GPUs each job holds (for its telemetry) after one
        read instead of a write transaction (on PostgreSQL its epoch fence and commit, per node
        reconnecting). Anything else, an ended job to forget included, takes the fenced write
        path: a deposed leader must not make an agent drop an end the new leader has not read."""
        watch: dict[str, dict] = {}
        with self.store.read() as s:
            for job in self.lifecycle.active_jobs_on(s, name):
                key = job_key(job)
                state = reported.get(key, {}).get("state")
                if state not in ("running", "starting") or (job.state == m.CONFIGURING and state == "running"):
                    return False
                watch[key] = _held(job, name)
        if len(watch) != len(reported):
            return False  # an orphan to kill (and record), or an end to forget
        if watch:
            self.links.send(name, {"op": "watch", "jobs": watch})
        self.wake()
        return True

    # ------------------------------------------------------------ started / exited / launch_failed
    # Reports that arrive in the same loop tick are committed together: one transaction (and one
    # fsync) for a burst of ends, instead of one per message. Each is committed before anything
    # is acted on (forget, a woken scheduling cycle), so write-ahead holds.
    def on_started(self, name: str, key: str, image_digest: str | None = None) -> None:
        self._report(self._started, name, key, image_digest)

    def on_exited(self, name: str, key: str, end: RankExit, end_time: float | None) -> None:
        self._report(self._exited, name, key, end, end_time)

    def on_pull_progress(self, name: str, msg: dict) -> None:
        """A CONFIGURING container job says which node is pulling its image, and how far."""
        try:
            job_id, attempt = parse_key(msg.get("key") or "")
        except ValueError:
            return
        total = msg.get("layers_total")
        done = msg.get("layers_done", 0)
        reason = f"pulling {msg.get('image')} on {name} ({done}{'/' + str(total) if total else ''} layers)"
        with self.store.tx() as s:
            job = s.get(Job, job_id)
            if job is not None and job.attempt == attempt and job.state == m.CONFIGURING:
                job.reason = reason[:500]
                s.add(job)

    def on_launch_failed(self, name: str, key: str, reason: str) -> None:
        """The agent could not start a rank (no such account, refused user): the job FAILS with why."""
        self._report(self._launch_failed, name, key, reason)

    def _report(self, handler, *args) -> None:
        self._batch.append((handler, args))
        if len(self._batch) == 1:
            try:
                asyncio.get_running_loop().call_soon(self.flush)
            except RuntimeError:  # no event loop (a direct call): commit it now
                self.flush()

    def flush(self) -> None:
        """Commit the reports gathered this tick in one transaction, then act on them."""
        batch, self._batch = self._batch, []
        if not batch:
            return
        acts: list = []
        ids = []
        for _handler, args in batch:  # every report names its node, then its job's key
            with contextlib.suppress(ValueError, IndexError, TypeError, AttributeError):
                ids.append(parse_key(args[1])[0])
        try:
            with self.store.tx() as s:
                # one read; then each handler's s.get finds its job in the session (which holds
                # them weakly: `loaded` keeps them there until the commit)
                loaded = self.store.load_jobs(s, ids) if len(ids) > 1 else {}  # noqa: F841
                for handler, args in batch:
                    handler(s, acts, *args)
        except Exception:  # noqa: BLE001 - one bad report must not lose the others: one at a time
            if len(batch) == 1:
                raise
            log.exception("a batch of %d agent reports failed; committing them one by one", len(batch))
            for item in batch:
                self._batch = [item]
                with contextlib.suppress(Exception):
                    self.flush()
            return
        for act in acts:
            act()

    def _started(self, s, acts: list, name: str, key: str, image_digest: str | None = None) -> None:
        job_id, attempt = parse_key(key)
        job = s.get(Job, job_id)
        if job is None or job.attempt != attempt or job.state != m.CONFIGURING:
            return
        if image_digest:  # the digest actually run, whatever tag was asked for
            job.image_digest = image_digest
        self.store.set_state(s, job, m.RUNNING, node=name)
        acts.append(lambda: self.observe_latency(job))

    def _exited(self, s, acts: list, name: str, key: str, end: RankExit, end_time: float | None) -> None:
        job_id, attempt = parse_key(key)
        job = s.get(Job, job_id)
        if job is None or job.attempt != attempt or job.state not in m.ACTIVE_STATES:
            acts.append(lambda: self.links.send(name, {"op": "forget", "keys": [key]}))
            return
        self.lifecycle.rank_ended(s, job, name, end, end_time)

    def _launch_failed(self, s, acts: list, name: str, key: str, reason: str) -> None:
        job_id, attempt = parse_key(key)
        job = s.get(Job, job_id)
        if job is None or job.attempt != attempt or job.state not in m.ACTIVE_STATES:
            return
        self.lifecycle.fail_launch(s, job, name, reason)


def _held(job: Job, node: str) -> dict:
    """What the agent is told to watch of a running job: the GPUs it holds there, its id."""
    return {"gpus": next((a["gpus"] for a in job.allocation if a["node"] == node), []), "job_id": job.id}
