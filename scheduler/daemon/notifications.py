"""Notifications wired into the daemon: job-state hooks and node events feed the Notifier.

Job changes come from the store's after-commit hook; node drains and downs from the event
trail the store publishes. Both only queue deliveries (notify.py's bounded queue), so a slow
or hanging receiver never delays a commit or the scheduling cycle.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from .. import models as m
from ..notify import Notifier, NotifyConfig, job_event_types
from ..settings import NotifySettings
from .state import StateStore

log = logging.getLogger("trainyard.notify")


class Notifications:
    """Owns the Notifier; start() and stop() inside the daemon's event loop."""

    def __init__(self, settings: NotifySettings, store: StateStore, cluster_name: str):
        self.store = store
        self.notifier = Notifier(NotifyConfig.from_dict(settings.model_dump()), cluster_name)
        self._events: asyncio.Queue | None = None
        self._task: asyncio.Task | None = None
        self._drained: set[str] = set()  # nodes whose drain was told (DRAINING, then DRAINED)
        store.on_job_state.append(self.on_job_state)

    async def start(self) -> None:
        await self.notifier.start()
        self._events = self.store.subscribe()
        self._task = asyncio.create_task(self._node_events(), name="notify-nodes")

    async def stop(self) -> None:
        if self._events is not None:
            self.store.unsubscribe(self._events)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.notifier.stop(drain_s=2.0)

    # ---------------------------------------------------------------- jobs
    def on_job_state(self, seen, old: str | None) -> None:
        """After a job-state commit: queue what its owner and the cluster asked to be told."""
        if not job_event_types(seen.state, old):
            return
        # the snapshot carries the job's name and notification settings: no read per job end
        self.notifier.on_job_state(seen, old)

    # ---------------------------------------------------------------- nodes
    async def _node_events(self) -> None:
        assert self._events is not None
        while True:
            ev = await self._events.get()
            if ev is None:  # the store closed its streams: the daemon is stopping
                return
            try:
                self.on_event(ev)
            except Exception:
                log.exception("notification for event %s failed", ev.get("id"))

    def on_event(self, ev: dict) -> None:
        """A node's drain (once, whether DRAINING or at once DRAINED) and its going DOWN."""
        if ev.get("action") not in ("node.drain", "node.state", "node.resume", "node.remove"):
            return
        node, detail = str(ev.get("target", "")), ev.get("detail") or {}
        state = detail.get("state")
        if ev["action"] in ("node.resume", "node.remove") or state == m.UP:
            self._drained.discard(node)
            return
        if state in (m.DRAINING, m.DRAINED):
            if node in self._drained:
                return
            self._drained.add(node)
        if state in (m.DRAINING, m.DRAINED, m.DOWN):
            self.notifier.node_event(node, state, str(detail.get("reason", "")))
