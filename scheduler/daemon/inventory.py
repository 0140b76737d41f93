"""Node inventory: register (pinning host keys), remove, drain, resume, bootstrap phases, faults."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlmodel import Session, select

from .. import models as m
from ..models import Node
from ..nodes import (
    NodeError,
    SshTarget,
    fetch_host_key,
    fingerprint,
    is_pinned,
    pin_host_key,
    probe,
    unpin_host_key,
)
from .caller import Caller
from .clock import Clock
from .errors import Conflict, Invalid, NotFound
from .healthgate import FAILED, HealthGate
from .lifecycle import JobLifecycle
from .links import NodeLinks
from .state import StateStore


@dataclass
class NodeRequest:
    name: str
    address: str
    port: int = 22
    user: str = "trainyard"
    key_path: str | None = None
    agent_dir: str = ""
    accept_new_host_key: bool = False
    gpus: int | None = None
    gpu_model: str | None = None
    pool: str = "default"
    provider: str = "onprem"
    labels: dict[str, str] = field(default_factory=dict)
    probe: bool = True
    privilege: str = "login"


class Inventory:
    """Every change to the node table; nothing is half-registered when a step fails."""

    def __init__(self, store: StateStore, links: NodeLinks, lifecycle: JobLifecycle, clock: Clock,
                 known_hosts: Path, default_key: Path, connect_timeout_s: float, wake, forget_health,
                 gate: HealthGate):
        self.store = store
        self.links = links
        self.lifecycle = lifecycle
        self.clock = clock
        self.known_hosts = known_hosts
        self.default_key = default_key
        self.connect_timeout_s = connect_timeout_s
        self.wake = wake
        self.forget_health = forget_health
        self.gate = gate

    @staticmethod
    def get(s: Session, name: str) -> Node:
        node = s.get(Node, name)
        if node is None:
            raise NotFound(f"node {name!r} does not exist; `trainyard nodes` lists them", "name")
        return node

    async def register(self, caller: Caller, req: NodeRequest) -> str:
        with self.store.read() as s:
            if s.get(Node, req.name) is not None:
                raise Conflict(f"node {req.name!r} already exists; `trainyard node remove` it first")
        if req.key_path and not Path(req.key_path).is_file():
            raise Invalid(f"key_path: {req.key_path!r} is not a file on the daemon's host", "key_path")
        pinned_now = False
        if not is_pinned(self.known_hosts, req.address, req.port):
            try:
                key = await fetch_host_key(req.address, req.port, self.connect_timeout_s)
            except NodeError as e:
                raise Invalid(f"node {req.name}: {e}", "address") from None
            if not req.accept_new_host_key:
                raise Invalid(f"node {req.name}: host key of {req.address}:{req.port} is not known "
                              f"({key.get_algorithm()} {fingerprint(key)}); check it and re-run with "
                              "--accept-new-host-key to pin it", "accept_new_host_key")
            pin_host_key(self.known_hosts, req.address, req.port, key)
            pinned_now = True
        target = SshTarget(req.name, req.address, req.port, req.user, req.key_path or str(self.default_key),
                           req.agent_dir, req.gpus or 0, req.gpu_model or "", self.links.min_uid, req.privilege)
        if req.probe:
            try:
                await probe(target, self.links.settings)
            except NodeError as e:
                if pinned_now:  # leave nothing half-registered
                    unpin_host_key(self.known_hosts, req.address, req.port)
                raise Invalid(f"node {req.name}: {e}", "address") from None
        with self.store.tx() as s:
            node = Node(name=req.name, address=req.address, port=req.port, user=req.user,
                        key_path=req.key_path, agent_dir=req.agent_dir, pool=req.pool, privilege=req.privilege,
                        provider=req.provider, gpu_model=req.gpu_model or "", gpus_total=req.gpus or 0,
                        gpus_expected=req.gpus or 0, health_checks={"status": "pending", "trigger": "node add"},
                        labels=req.labels, state=m.DOWN, reason="connecting", created_at=self.clock.time())
            s.add(node)
            self.store.record(s, caller.user, "node.add", req.name,
                              {"address": req.address, "port": req.port, "host_key_pinned": pinned_now},
                              caller.address)
        self.links.start(node)
        return req.name

    async def remove(self, caller: Caller, name: str, force: bool) -> None:
        with self.store.tx() as s:
            node = self.get(s, name)
            active = self.lifecycle.active_jobs_on(s, name)
            if active and not force:
                ids = ", ".join(str(j.id) for j in active[:10])
                raise Conflict(f"node {name} runs jobs {ids}; drain it and wait, or remove with --force")
            for job in active:  # forced: their runs there are lost to us (requeued if retries allow)
                self.lifecycle.fail_on_node(s, job, "", f"node {name} removed by {caller.user}")
            s.delete(node)
            shared = s.exec(select(Node).where(Node.address == node.address, Node.port == node.port,
                                               Node.name != name)).first()
            if shared is None:  # a reinstalled host must be able to come back with a new key
                unpin_host_key(self.known_hosts, node.address, node.port)
            self.store.record(s, caller.user, "node.remove", name, {"forced": bool(active)}, caller.address)
        self.gate.cancel(name)
        await self.links.stop(name)
        self.forget_health(name)

    def drain(self, caller: Caller, name: str, reason: str) -> None:
        with self.store.tx() as s:
            self.lifecycle.drain(s, self.get(s, name), reason, caller.user, caller.address)

    def drain_for_health(self, name: str, verdicts: list[str]) -> None:
        with self.store.tx() as s:
            node = s.get(Node, name)
            if node is None:
                return
            self.store.record(s, "trainyard", "node.health", name, {"verdicts": verdicts})
            if node.state in (m.UP, m.DRAINING, m.DRAINED):
                self.gate.invalidate(node)
                self.lifecycle.drain(s, node, ("health: " + "; ".join(verdicts))[:500], "trainyard")

    async def resume(self, caller: Caller, name: str, force: bool = False) -> None:
        """Back into service through the health gate: the node goes UP once its checks pass.

        Answers when the checks end within [gate] resume_wait (Conflict naming the failed check),
        else leaves them running with the node DRAINED ("health gate: checking"). `force` skips
        the checks; the audit event says so."""
        with self.store.tx() as s:
            node = self.get(s, name)
            if node.state == m.UP:
                raise Conflict(f"node {name} is already UP")
            if node.state in (m.PROVISIONING, m.BOOTSTRAPPING):
                raise Conflict(f"node {name} is {node.state}; it enters service when that ends")
            if force:
                self.gate.cancel(name)
                last = (node.health_checks or {}).get("status", "pending")
                self._back_in_service(node)
                s.add(node)
                self.store.record(s, caller.user, "node.resume", name,
                                  {"state": node.state, "forced": True, "health_checks": last}, caller.address)
            elif self.gate.running(name):
                raise Conflict(f"node {name}: its health checks are running; wait for them, or resume "
                               "with force=true to skip them")
            elif self.store.active.on(name):
                raise Conflict(f"node {name} still runs jobs ({node.state}); resume it once they end, "
                               "or with force=true to put it back without checks")
            else:
                self.gate.hold(s, node, f"resume by {caller.user}")
                self.store.record(s, caller.user, "node.resume", name, {"state": node.state, "gate": True},
                                  caller.address)
        if force:
            self.wake()
            return
        run = self.gate.start(name, f"resume by {caller.user}", held=True)
        done, _ = await asyncio.wait({run}, timeout=self.gate.config.resume_wait_s)
        if run in done and not run.cancelled() and run.exception() is None:
            outcome = run.result()
            if outcome["status"] == FAILED:
                failed = next(c for c in outcome["checks"] if c["result"] == "fail")
                raise Conflict(f"node {name} failed its health check {failed['check']}: {failed['detail']}; "
                               "it stays DRAINED. Fix it and resume again, or resume with force=true")

    def _back_in_service(self, node: Node) -> None:
        node.state = m.UP if self.links.connected(node.name) else m.DOWN
        node.reason = "" if node.state == m.UP else "connecting"

    def bootstrap_phase(self, caller: Caller, name: str, phase: str, detail: str) -> None:
        with self.store.tx() as s:
            node = self.get(s, name)
            if phase == "start":
                if self.store.active.on(name):
                    raise Conflict(f"node {name} runs jobs; drain it before bootstrapping")
                node.state, node.reason = m.BOOTSTRAPPING, detail or "bootstrap running"
                self.gate.invalidate(node)
            elif phase == "done":
                self.gate.hold(s, node, "after bootstrap")
            else:
                node.state, node.reason = m.DOWN, f"bootstrap failed: {detail}"[:500]
            s.add(node)
            self.store.record(s, caller.user, f"node.bootstrap.{phase}", name, {"detail": detail},
                              caller.address)
        if phase == "done":
            self.gate.start(name, "after bootstrap", held=True)
        self.wake()

    async def inject_fault(self, caller: Caller, name: str, fault: dict[str, Any]) -> dict:
        with self.store.read() as s:
            node = self.get(s, name)
        if not node.simulated:
            raise Conflict(f"node {name} is a real node; fault injection works only on the demo's "
                           "simulated GPUs")
        reply = await self.links.request(name, {"op": "fault", **fault})
        if reply.get("ev") == "error":
            raise Conflict(f"node {name}: {reply.get('error')}")
        self.store.audit(caller.user, "node.fault", name, fault, caller.address)
        return reply

    def mark_down(self, s: Session, node: Node, since: float, now: float) -> None:
        if node.state != m.DOWN:
            self.gate.cancel(node.name)
            self.gate.invalidate(node)
            node.state = m.DOWN
            node.reason = f"unreachable for {now - since:.0f}s: {self.links.errors.get(node.name, 'no answer')}"
            s.add(node)
            self.store.record(s, "trainyard", "node.state", node.name, {"state": m.DOWN, "reason": node.reason})
        for job in self.lifecycle.active_jobs_on(s, node.name):
            self.lifecycle.fail_on_node(s, job, node.name, f"node {node.name} down")

