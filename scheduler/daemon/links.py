"""Node links: one SSH connection and agent channel per node, their state, and their telemetry."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from ..models import UP, Node
from ..nodes import NodeError, NodeLink, SshSettings, SshTarget
from .clock import Clock
from .errors import NotFound, Unavailable

log = logging.getLogger("trainyard.daemon")


def settled(gpus):
    """A telemetry sample's GPUs as the daemon keeps them: each GPU's list fields become tuples
    and its dict is rebuilt, so that it holds only numbers, strings and tuples. CPython then
    leaves the dict out of its garbage collector, which otherwise walks every field of every
    GPU's latest reading (8,000 dicts and their 24,000 lists at 1,000 nodes) at each young
    collection: most of a 100 ms pause of the event loop there. About 30 µs per 8-GPU sample."""
    if type(gpus) is not list:
        return gpus  # malformed: the readers skip what is not a list or tuple of dicts
    out = []
    for g in gpus:
        if type(g) is dict:
            for k in _LIST_FIELDS:
                v = g.get(k)
                if type(v) is list:
                    g[k] = tuple(v)
            g = dict(g.items())  # a new dict is tracked only if a value is (a dict's copy is as its original)
        out.append(g)
    return tuple(out)


_LIST_FIELDS = ("processes", "xid_events", "mig_instances")  # GPU_FIELDS that are lists


class NodeLinks:
    """The daemon's side of every node: who is connected, why not, and what the agent last said."""

    def __init__(self, settings: SshSettings, default_key: str, clock: Clock,
                 on_message: Callable[[str, dict], None], on_problem: Callable[[str, str], None],
                 agent_dir: str = "", min_uid: int = 1000):
        self.settings = settings
        self.agent_dir = agent_dir  # [nodes] agent_dir: a node's own setting wins
        self.min_uid = min_uid
        self.default_key = default_key
        self.clock = clock
        self._on_message = on_message
        self._on_problem = on_problem
        self._links: dict[str, NodeLink] = {}
        self.errors: dict[str, str] = {}  # node -> why its link is down
        # node -> when it was first tried (or lost) and not reached since: its grace clock
        # (node_grace_s). A node still queued for its turn in the handshake is not in it.
        self.unreachable_since: dict[str, float] = {}
        self.telemetry: dict[str, dict] = {}  # node -> last sample {"time", "gpus", "source"}
        self.addresses: dict[str, str] = {}
        # at most this many nodes in the SSH handshake at once (a takeover of 1,000 nodes)
        self.handshakes = asyncio.Semaphore(settings.connect_concurrency)

    def target(self, node: Node) -> SshTarget:
        agent_dir = node.agent_dir if node.agent_dir not in ("", ".trainyard") else self.agent_dir
        return SshTarget(node.name, node.address, node.port, node.user, node.key_path or self.default_key,
                         agent_dir, node.gpus_total, node.gpu_model, self.min_uid, node.privilege)

    def start_all(self, nodes: Iterable[Node], jobs_on: Callable[[str], int]) -> None:
        """Start every node's link, queued for its handshake turn in the order that matters
        to a new leader: the nodes running the most jobs first (their ends are reported, and
        their grace clocks started, soonest), then those last seen UP, then the rest (a node
        long DOWN is likely to hold a turn until connect_timeout_s). Links that fail go to the
        back of the queue with their backoff."""
        for node in sorted(nodes, key=lambda n: (-jobs_on(n.name), n.state != UP, n.name)):
            self.start(node)

    def start(self, node: Node) -> None:
        link = NodeLink(self.target(node), self.settings, self._on_message, self._on_link,
                        self.handshakes, self._on_attempt)
        self._links[node.name] = link
        self.addresses[node.name] = node.address
        link.start()

    async def stop(self, name: str) -> None:
        link = self._links.pop(name, None)
        if link is not None:
            await link.stop()
        for table in (self.telemetry, self.errors, self.unreachable_since, self.addresses):
            table.pop(name, None)

    async def stop_all(self) -> None:
        for name in list(self._links):
            await self.stop(name)

    def names(self) -> list[str]:
        return list(self._links)

    def connected(self, name: str) -> bool:
        link = self._links.get(name)
        return link is not None and link.connected

    def state_key(self) -> int:
        """Changes whenever a link comes up, goes down or fails differently (cheap to compare)."""
        return hash((tuple((name, link.connected) for name, link in self._links.items()),
                     tuple(self.errors.items())))

    def connected_count(self) -> int:
        return sum(link.connected for link in self._links.values())

    def send(self, name: str, msg: dict) -> bool:
        """Queue one message for a node's agent; False when the link is down or unknown."""
        link = self._links.get(name)
        return link is not None and link.send(msg)

    async def request(self, name: str, msg: dict, timeout: float = 10.0) -> dict:
        link = self._links.get(name)
        if link is None:
            raise NotFound(f"node {name} is not known to the daemon")
        try:
            return await link.request(msg, timeout=timeout)
        except NodeError as e:
            raise Unavailable(str(e)) from None

    def problem(self, name: str) -> str:
        if self.connected(name):
            return ""
        # started and not yet tried (each attempt, and each drop, enters unreachable_since):
        # most nodes for a while after a takeover of many
        if name in self._links and name not in self.unreachable_since:
            return f"waiting for its turn to connect (connect_concurrency = {self.settings.connect_concurrency})"
        return self.errors.get(name, "")

    def _on_attempt(self, name: str) -> None:
        """A node's grace clock starts when the daemon first tries it, not when its link is
        started: a new leader taking over 1,000 nodes queues most of them behind
        `connect_concurrency` handshakes, and one slow minute of that queue must not count as
        the last nodes' absence (their jobs would end NODE_FAIL without the node ever being
        tried). A node that does not answer still counts from its first attempt, and one that
        was lost from the moment it went (`_on_link`), whatever its place in the queue."""
        self.unreachable_since.setdefault(name, self.clock.time())

    async def _on_link(self, name: str, up: bool, error: str) -> None:
        if up:
            self.errors.pop(name, None)
            self.unreachable_since.pop(name, None)
            return
        changed = self.errors.get(name) != error
        self.errors[name] = error
        self.unreachable_since.setdefault(name, self.clock.time())
        if changed:  # one event per new problem, not one per reconnect attempt
            self._on_problem(name, error)
