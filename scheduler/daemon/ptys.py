"""Terminals in running jobs: who may open one, and the relay between a client and the node's agent.

A session rides the node's existing link (no new SSH connection, no SSH from the user to the
node): `pty_open` asks the agent for a pty in the job (scheduler/ptys.py), the terminal's bytes
travel as `pty_data` both ways, and the daemon acknowledges output (`pty_ack`) only once its
client took it, so a slow terminal holds back its own session and nothing else.
"""

from __future__ import annotations

import asyncio
import base64
import secrets
from dataclasses import dataclass

from .. import models as m
from ..models import Job
from .caller import Caller
from .errors import Conflict, DomainError, Forbidden, NotFound, Unavailable
from .lifecycle import job_key
from .links import NodeLinks
from .state import StateStore

OPEN_TIMEOUT_S = 15.0
LINK_CHECK_S = 1.0


class AgentTooOld(DomainError):
    """The node's agent predates terminals in jobs (HTTP 501)."""

    kind = "not_implemented"


@dataclass(frozen=True)
class PtyOutput:
    data: bytes
    offset: int  # the session's output up to here, once `data` is passed on


@dataclass(frozen=True)
class PtyExit:
    rc: int | None
    reason: str = ""


class PtySession:
    """One terminal as the daemon relays it: output and the end arrive on a queue."""

    def __init__(self, relay: PtyRelay, name: str, node: str, job_id: int):
        self.relay = relay
        self.name = name
        self.node = node
        self.job_id = job_id
        self.queue: asyncio.Queue[PtyOutput | PtyExit] = asyncio.Queue()
        self.closed = False

    async def next(self) -> PtyOutput | PtyExit:
        """The next piece of output, or the session's end (also when the node's link drops)."""
        while True:
            try:
                return await asyncio.wait_for(self.queue.get(), LINK_CHECK_S)
            except TimeoutError:
                if not self.relay.links.connected(self.node):
                    self.relay.forget(self)
                    return PtyExit(None, f"the daemon lost its link to {self.node}")

    def delivered(self, offset: int) -> None:
        self.relay.links.send(self.node, {"op": "pty_ack", "pty": self.name, "offset": offset})

    def write(self, data: bytes) -> None:
        if data and not self.closed:
            self.relay.links.send(self.node, {"op": "pty_data", "pty": self.name,
                                              "data": base64.b64encode(data).decode()})

    def resize(self, rows: int, cols: int) -> None:
        if not self.closed:
            self.relay.links.send(self.node, {"op": "pty_resize", "pty": self.name,
                                              "rows": rows, "cols": cols})

    def close(self) -> None:
        """The client went away: hang the terminal up (the agent answers with pty_close)."""
        if not self.closed:
            self.relay.links.send(self.node, {"op": "pty_close", "pty": self.name})
            self.relay.forget(self)


class PtyRelay:
    """Opens terminals in jobs for their owners (and operators), audited, and routes the agents'
    pty_data/pty_close events to their sessions."""

    def __init__(self, store: StateStore, links: NodeLinks):
        self.store = store
        self.links = links
        self.sessions: dict[str, PtySession] = {}

    async def open(self, caller: Caller, job_id: int, rank: int = 0, argv: list[str] | None = None,
                   rows: int = 24, cols: int = 80, term: str = "", cwd: str = "") -> PtySession:
        """A terminal running `argv` (default: the owner's shell) in rank `rank` of a RUNNING job.

        NotFound for a job or rank that does not exist, Forbidden for someone else's job,
        Conflict unless the job runs, Unavailable when the node cannot be reached, AgentTooOld
        when its agent does not know terminals."""
        with self.store.read() as s:
            job = s.get(Job, job_id)
            if job is None:
                raise NotFound(f"job {job_id} does not exist", "job_id")
            if not caller.may_act_on(job.user):
                raise Forbidden(f"job {job_id} belongs to {job.user}; only they or an operator may open "
                                f"a terminal in it ({caller.user} is {caller.role})")
            if job.state != m.RUNNING:
                raise Conflict(f"job {job_id} is {job.state}; a terminal opens only in a RUNNING job"
                               + (" (wait for it: `squeue -j ID`)" if job.state in m.WAITING_STATES
                                  | m.ACTIVE_STATES else ""))
            nodes = [a["node"] for a in job.allocation]
            if not 0 <= rank < len(nodes):
                raise NotFound(f"job {job_id} has {len(nodes)} node(s), ranks 0-{len(nodes) - 1}; "
                               f"it has no rank {rank}", "rank")
            node, key, owner = nodes[rank], job_key(job), job.user
        session = PtySession(self, secrets.token_hex(8), node, job_id)
        self.sessions[session.name] = session
        msg = {"op": "pty_open", "key": key, "pty": session.name, "argv": argv or None,
               "rows": rows, "cols": cols, "term": term, "cwd": cwd}
        try:
            reply = await self.links.request(node, msg, timeout=OPEN_TIMEOUT_S)
        except (Unavailable, NotFound):
            self.forget(session)
            raise
        if reply.get("ev") != "pty_opened":
            self.forget(session)
            error = str(reply.get("error") or reply)
            if "unknown op" in error:
                raise AgentTooOld(f"the agent on {node} does not know terminals in jobs; update the "
                                  f"agent on {node} (it is replaced when the daemon reconnects to it)")
            raise Conflict(error)
        self.store.audit(caller.user, "job.pty", str(job_id),
                         {"node": node, "rank": rank, "argv": argv or None, "owner": owner,
                          "pty": session.name}, caller.address)
        return session

    def node_restarted(self, node: str) -> None:
        """A node's agent said hello again (a new link): its terminals ended with the old one."""
        for session in [s for s in self.sessions.values() if s.node == node]:
            session.queue.put_nowait(PtyExit(None, f"the link to {node} was re-established; "
                                                   "the terminal ended with the old one"))
            self.forget(session)

    def forget(self, session: PtySession) -> None:
        session.closed = True
        self.sessions.pop(session.name, None)

    def on_event(self, node: str, msg: dict) -> None:
        """An agent's pty_data or pty_close."""
        session = self.sessions.get(str(msg.get("pty")))
        if session is None or session.node != node:
            if msg.get("ev") == "pty_data":  # output of a session nobody relays any more
                self.links.send(node, {"op": "pty_close", "pty": msg.get("pty")})
            return
        if msg["ev"] == "pty_data":
            data = base64.b64decode(msg.get("data") or "")
            session.queue.put_nowait(PtyOutput(data, int(msg.get("offset") or 0) + len(data)))
        elif msg["ev"] == "pty_close":
            rc = msg.get("rc")
            session.queue.put_nowait(PtyExit(rc if isinstance(rc, int) else None, str(msg.get("reason") or "")))
            self.forget(session)
