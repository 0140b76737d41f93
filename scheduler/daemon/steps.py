"""Job steps across nodes: the daemon's relay between `srun` on a job's first node and the agents
of its other nodes (the agents' sides are in scheduler/steps.py; the model in docs/slurm.md).

A step rides the nodes' existing links: the caller's agent asks for it (`step_launch`), the daemon
checks that the job runs with Slurm's batch step on both nodes and sends `step_exec` to the
other node, then passes the output and the end back, and the caller's acknowledgements and
hang-up forward. Nothing here touches the database: a step lives as long as its `srun`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from .. import models as m
from ..models import Job
from .lifecycle import job_key, parse_key, runs_batch_step
from .links import NodeLinks
from .state import StateStore

log = logging.getLogger("trainyard.steps")

# agent -> daemon events that are relayed here, and what each becomes on the other side
FORWARD = {"step_output": "step_output", "step_end": "step_end"}  # runner -> caller
BACKWARD = {"step_ack": "step_ack", "step_kill": "step_kill",  # caller -> runner
            "step_signal": "step_signal"}
EVENTS = ("step_launch", *FORWARD, *BACKWARD)


@dataclass
class Route:
    caller: str  # the node whose srun started the step
    runner: str  # the node that runs this share of it
    job_id: int


class StepRelay:
    def __init__(self, store: StateStore, links: NodeLinks):
        self.store = store
        self.links = links
        self.routes: dict[str, Route] = {}

    def on_event(self, node: str, msg: dict) -> None:
        ev, step = msg.get("ev"), str(msg.get("step") or "")
        if ev == "step_launch":
            self.launch(node, step, msg)
            return
        route = self.routes.get(step)
        if ev in FORWARD:
            if route is None or route.runner != node:
                if ev == "step_output":  # output of a step nobody waits for: end it
                    self.links.send(node, {"op": "step_kill", "step": step})
                return
            self.links.send(route.caller, {**_fields(msg), "op": FORWARD[ev]})
            if ev == "step_end":
                self.routes.pop(step, None)
        elif ev in BACKWARD and route is not None and route.caller == node:
            self.links.send(route.runner, {**_fields(msg), "op": BACKWARD[ev]})

    def launch(self, caller: str, step: str, msg: dict) -> None:
        runner = str(msg.get("node") or "")
        why = self.refusal(caller, runner, step, str(msg.get("key") or ""))
        if why:
            self.links.send(caller, {"op": "step_end", "step": step, "rc": None, "reason": why})
            return
        self.routes[step] = Route(caller, runner, parse_key(str(msg["key"]))[0])
        self.links.send(runner, {
            "op": "step_exec", "step": step, "key": msg["key"], "argv": msg.get("argv") or [],
            "srun": msg.get("srun") or [], "env": msg.get("env") or {},
            "unset": msg.get("unset") or [], "cwd": msg.get("cwd") or ""})

    def refusal(self, caller: str, runner: str, step: str, key: str) -> str:
        """Why this step may not run (empty: it may)."""
        if not step or step in self.routes:
            return f"step name {step!r} is empty or already in use"
        try:
            job_id, _ = parse_key(key)
        except ValueError:
            return f"{key!r} is not a job key"
        with self.store.read() as s:
            job = s.get(Job, job_id)
        if job is None or job_key(job) != key or job.state != m.RUNNING:
            return f"job {job_id} is not running (this attempt has ended)"
        nodes = [a["node"] for a in job.allocation]
        if caller not in nodes:
            return f"{caller} is not a node of job {job_id}"
        if runner not in nodes:
            return (f"{runner} is not a node of job {job_id} (its nodes: {', '.join(nodes)}); "
                    "srun -w names nodes of the job's allocation")
        if not runs_batch_step(job):
            return f"job {job_id} runs its script on every node: each node's srun starts its own tasks"
        if not self.links.connected(runner):
            return f"the daemon has no link to {runner} right now"
        return ""

    def node_restarted(self, node: str) -> None:
        """A node's agent said hello again: its steps, as caller or runner, ended with the old one."""
        for step, route in list(self.routes.items()):
            if route.runner == node:
                self.links.send(route.caller, {
                    "op": "step_end", "step": step, "rc": None,
                    "reason": f"the link to {node} was re-established; the step's tasks there "
                              "ended with the old one"})
                self.routes.pop(step, None)
            elif route.caller == node:
                self.links.send(route.runner, {"op": "step_kill", "step": step})
                self.routes.pop(step, None)


def _fields(msg: dict) -> dict:
    return {k: v for k, v in msg.items() if k not in ("ev", "op")}
