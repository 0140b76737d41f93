"""Helpers for the TUI tests: a frozen-clock app on the in-memory backend, waiting, reading the screen."""

from __future__ import annotations

import os
import time

from fake_backend import FROZEN_NOW, FakeBackend

from tui.app import TrainyardApp

os.environ["TZ"] = "UTC"
time.tzset()

SOURCES = {"me", "cluster", "nodes", "jobs", "queues", "events"}
SIZE = (140, 36)


class Clock:
    """A clock the test moves by hand."""

    def __init__(self, now: float = FROZEN_NOW):
        self.now = now

    def __call__(self) -> float:
        return self.now


def make_app(backend: FakeBackend | None = None, **kwargs) -> TrainyardApp:
    kwargs.setdefault("clock", Clock())
    kwargs.setdefault("stream", False)
    kwargs.setdefault("refresh", 30.0)  # tests fetch on demand, not on a timer
    return TrainyardApp(backend or FakeBackend(), **kwargs)


async def settle(pilot, sources=SOURCES) -> None:
    """Wait until every source has answered once and the answers are on screen."""
    app = pilot.app
    for _ in range(500):
        if set(sources) <= set(app.state.fetched_at) | set(app.state.errors):
            break
        await pilot.pause(0.01)
    await app.workers.wait_for_complete()
    await pilot.pause()


async def refetch(pilot, *sources: str) -> None:
    """Fetch sources again now (as a refresh tick would) and wait for the answers."""
    for source in sources:
        pilot.app.fetch(source)
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()


def screen_text(app) -> str:
    """What the terminal shows now, as plain text (modal screens over their background)."""
    import io

    from rich.console import Console

    width, height = app.size
    console = Console(width=width, height=height, file=io.StringIO(), record=True,
                      force_terminal=True, legacy_windows=False, safe_box=False)
    console.print(app.screen._compositor.render_update(
        full=True, screen_stack=app._background_screens))
    return console.export_text()




class TcpProxy:
    """A loopback TCP proxy that can be cut and restored: the daemon 'goes away and comes back'."""

    def __init__(self, target_host: str, target_port: int):
        import socket

        self.target = (target_host, target_port)
        probe = socket.socket()
        probe.bind(("127.0.0.1", 0))
        self.port = probe.getsockname()[1]
        probe.close()
        self._listener = None
        self._conns: list = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        import socket
        import threading

        listener = socket.socket()
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", self.port))
        listener.listen(64)
        self._listener = listener
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()

    def _accept(self, listener) -> None:
        import socket
        import threading

        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self.target)
            except OSError:
                client.close()
                continue
            self._conns += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(src, dst) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.close()
                except OSError:
                    pass

    def stop(self) -> None:
        import socket

        if self._listener is not None:
            self._listener.close()
            self._listener = None
        for conn in self._conns:
            try:
                conn.shutdown(socket.SHUT_RDWR)
                conn.close()
            except OSError:
                pass
        self._conns = []


def toasts(app) -> list[str]:
    """The text of the notifications on screen, unwrapped (a toast wraps long messages)."""
    from textual.widgets._toast import Toast

    return [" ".join(t.render().plain.split()) for t in app.screen.query(Toast)]
