"""Keeping the TUI's data fresh: one worker per data source, re-armed with `set_timer` after the
previous fetch finished (dolphie's pattern), and the daemon's event stream on its own thread,
reconnecting after the daemon goes away. Workers post messages; they never touch widgets."""

from __future__ import annotations

import gc
import threading
import time
from collections.abc import Callable
from functools import partial
from typing import Any

from textual.timer import Timer

from tui.backend import Backend, BackendError, BackendUnreachable
from tui.messages import Fetched, FetchFailed, StreamEvent, StreamState

SOURCES = ("me", "cluster", "nodes", "jobs", "queues", "events")
# Which sources an event on the stream makes stale, by the event's action prefix.
AFFECTS = {"job": ("jobs", "cluster", "queues", "nodes"), "node": ("nodes", "cluster")}
SOON = 0.2  # seconds: coalesces a burst of events into one fetch per source
# A source is fetched again no sooner than PACE times its last fetch took: on a busy cluster
# every job event marks the jobs stale, and a page of 2,000 jobs takes the daemon ~0.15 s to
# read and encode; fetched again 0.2 s after each answer, one open TUI asked for that page 1-1.5
# times a second (tests/bench/bench_tui_busy.py). Paced, one TUI asks for at most a fifth of
# the daemon's time per source, however busy the cluster and however long its pages.
PACE = 4.0
# However cheap its fetch, a source the events mark stale is fetched at most this often: with the
# measuring of each table cell gone, a TUI on a busy cluster fetched the cluster, nodes and
# queues 3-4 times a second (tests/bench/bench_tui_busy.py), more than eyes read, and each open
# TUI costs the daemon that. The refresh interval and a user's own refresh (r) are not held to it.
MIN_GAP = 0.5
BACKOFF_MAX = 10.0


def queues_and_teams(backend: Backend) -> dict:
    """The queues source: the queues and the teams, in one fetch on one worker. A daemon without
    /v1/teams (404) gives teams None, and the queues view falls back to per-user counts."""
    queues = backend.queues()
    try:
        teams = backend.teams()
    except BackendError as exc:
        if exc.status != 404:
            raise
        teams = None
    return {"queues": queues, "teams": teams}


class RefreshMixin:
    """Mixed into the App: owns the fetch timers and the event stream thread."""

    backend: Backend
    refresh_interval: float

    def _init_refresh(self) -> None:
        self._inflight: set[str] = set()
        self._again: set[str] = set()
        self._source_timers: dict[str, Timer] = {}
        self._failures: dict[str, int] = {}
        self._took: dict[str, float] = {}  # seconds each source's last fetch took
        self._ended: dict[str, float] = {}  # when it answered (time.monotonic())
        self._stop_stream = threading.Event()
        self._stream_thread: threading.Thread | None = None
        self._stream_since = 0
        self._want_stream = True
        self._frozen = False
        self.streaming = False

    def start_refresh(self, stream: bool = True) -> None:
        self._want_stream = stream
        for source in SOURCES:
            self.fetch(source)

    def _start_stream(self) -> None:
        """Started after the first events fetch, so the stream resumes from what we have."""
        if not self._want_stream or self._stream_thread is not None:
            return
        self._stream_since = self.state.last_event_id
        self._stream_thread = threading.Thread(target=self._stream_loop, name="tui-events",
                                               daemon=True)
        self._stream_thread.start()

    def stop_refresh(self) -> None:
        if self._frozen:
            gc.unfreeze()  # hand what the app held back to the collector
        self._stop_stream.set()
        for timer in self._source_timers.values():
            timer.stop()

    def query_for(self, source: str) -> Callable[[Backend], Any]:
        """The call that fetches `source`, built on the UI thread from what the UI shows."""
        if source == "jobs":
            query = self.jobs_query()
            return lambda b: b.jobs(**query)
        if source == "events":
            since = self.state.last_event_id
            return lambda b: b.events(since=since, limit=500)
        if source == "queues":
            return queues_and_teams
        return lambda b: getattr(b, source)()

    def fetch(self, source: str) -> None:
        timer = self._source_timers.pop(source, None)
        if timer is not None:
            timer.stop()
        if source in self._inflight:
            self._again.add(source)
            return
        self._inflight.add(source)
        self.run_worker(partial(self._fetch_blocking, source, self.query_for(source)),
                        thread=True, group="fetch", exit_on_error=False)

    def _fetch_blocking(self, source: str, call: Callable[[Backend], Any]) -> None:
        t0 = time.monotonic()
        try:
            data = call(self.backend)
        except (BackendError, BackendUnreachable) as exc:
            self.post_message(FetchFailed(source, getattr(exc, "detail", None) or str(exc)))
        except Exception as exc:  # a broken answer must not kill the refresh loop
            self.post_message(FetchFailed(source, f"{source}: {type(exc).__name__}: {exc}"))
        else:
            self.post_message(Fetched(source, data, self.now(), time.monotonic() - t0))

    def gap(self, source: str) -> float:
        """The least time between the end of a fetch of `source` and the next (PACE)."""
        return PACE * self._took.get(source, 0.0)

    def _rearm(self, source: str, delay: float) -> None:
        self._inflight.discard(source)
        if source in self._again:  # asked for again while it was fetched: an event, mostly
            self._again.discard(source)
            delay = MIN_GAP
        delay = max(delay, self.gap(source))
        self._source_timers[source] = self.set_timer(delay, partial(self.fetch, source))

    def on_fetched(self, message: Fetched) -> None:
        self._failures.pop(message.source, None)
        self._took[message.source] = message.took
        self._ended[message.source] = time.monotonic()
        self.state.apply(message.source, message.data, message.at)
        self.data_changed(message.source)
        if not self._frozen and {"nodes", "jobs", "cluster"} <= set(self.state.fetched_at):
            # Everything built for the first full paint (Textual's widgets, styles, caches)
            # lives as long as the app: keep it out of the collector's full scans, which
            # otherwise cost 30-70 ms a tick at 1,000 nodes and 10,000 jobs.
            self._frozen = True
            gc.freeze()
        if message.source == "events":
            self._stream_since = max(self._stream_since, self.state.last_event_id)
            self._start_stream()
        if message.source == "me":
            self._inflight.discard("me")
            return
        delay = self.refresh_interval
        if message.source == "events" and self.streaming:
            delay = self.refresh_interval * 5  # the stream carries them; this is a safety net
        self._rearm(message.source, delay)

    def on_fetch_failed(self, message: FetchFailed) -> None:
        n = self._failures.get(message.source, 0) + 1
        self._failures[message.source] = n
        self.state.errors[message.source] = message.error
        self.data_changed(message.source)
        self._rearm(message.source, min(BACKOFF_MAX, self.refresh_interval * n))

    def soon(self, source: str) -> None:
        """Fetch `source` shortly: an event said it changed."""
        if source in self._inflight:
            self._again.add(source)
            return
        timer = self._source_timers.get(source)
        if timer is not None and getattr(timer, "_soon", False):
            return
        if timer is not None:
            timer.stop()
        paced = self._ended.get(source, 0.0) + max(MIN_GAP, self.gap(source)) - time.monotonic()
        timer = self.set_timer(max(SOON, paced), partial(self.fetch, source))
        timer._soon = True  # type: ignore[attr-defined]
        self._source_timers[source] = timer

    # -- the event stream (a plain daemon thread: it blocks on the socket) ------------------

    def _stream_loop(self) -> None:
        delay = 0.5
        while not self._stop_stream.is_set():
            try:
                # Optimistic: an idle stream sends nothing; a refused one fails at once.
                self.post_message(StreamState(True))
                for event in self.backend.stream_events(since=self._stream_since):
                    if self._stop_stream.is_set():
                        return
                    self.post_message(StreamEvent(event))
                    delay = 0.5
                error = "event stream ended"
            except Exception as exc:
                error = getattr(exc, "detail", None) or str(exc) or type(exc).__name__
            self.post_message(StreamState(False, error))
            self._stop_stream.wait(delay)
            delay = min(delay * 2, 5.0)

    def on_stream_state(self, message: StreamState) -> None:
        was = self.streaming
        self.streaming = message.connected
        if was and not message.connected:
            self.fetch("events")  # polling fallback picks up what the stream missed
        self.data_changed("stream")

    def on_stream_event(self, message: StreamEvent) -> None:
        fresh = self.state.add_events([message.event])
        if not fresh:
            return
        self._stream_since = self.state.last_event_id
        self.data_changed("events")
        prefix = str(message.event.get("action") or "").split(".", 1)[0]
        for source in AFFECTS.get(prefix, ("cluster",)):
            self.soon(source)

    def now(self) -> float:
        return time.time()
