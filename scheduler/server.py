"""Runs the daemon and its HTTP API together on one event loop."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import resource
import socket
import time
from collections.abc import Callable

import uvicorn

from .api import create_app
from .config import parse_listen
from .daemon import Daemon
from .metrics import Metrics

# The collector's default (700, 10, 10) runs a young collection every 700 new container objects
# and a full one every few seconds at 1,000 nodes, where the daemon holds millions of objects
# (telemetry, health history, SSH connections, jobs): each full collection stopped the event loop
# for 270-480 ms. Objects that live as long as the process are frozen at start, and a young
# collection waits for 50,000 new objects, so that fewer short-lived ones (telemetry samples,
# requests) are promoted and full collections are rare: none in 240 s of the 1,000-node benchmark
# (tests/bench/bench_cluster_size.py), against young pauses of ~120 ms about every 20 s. With
# (10,000, 10, 10) that benchmark paused 138 times for ~36 ms, 13 for ~140 ms and once for 500 ms
# in 90 s. trainyard_gc_pause_seconds shows a daemon's own.
GC_THRESHOLDS = (50_000, 20, 10)

log = logging.getLogger("trainyard.server")


def run(main) -> None:
    """Run a coroutine on uvloop where it is installed (uvicorn[standard] brings it), else asyncio."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(main)
        return
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        runner.run(main)


def tune_gc(metrics: Metrics | None = None) -> None:
    """Shorten the garbage collector's pauses on the event loop (see GC_THRESHOLDS) and time
    each one into trainyard_gc_pause_seconds."""
    if metrics is not None:
        started = [0.0]
        by_generation = [metrics.gc_pause.labels(str(g)) for g in range(3)]

        def timed(phase: str, info: dict) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
            else:
                by_generation[info["generation"]].observe(time.perf_counter() - started[0])

        gc.callbacks.append(timed)
    gc.collect()
    gc.freeze()  # the imported modules and the started daemon live as long as the process
    gc.set_threshold(*GC_THRESHOLDS)


def raise_nofile_limit() -> None:
    """Each node holds a connection; run out of descriptors and asyncssh fails oddly (notes/ssh.md)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def bind(listen: str) -> socket.socket:
    host, port = parse_listen(listen)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto must say TCP, or asyncio skips TCP_NODELAY on accepted connections and every
    # keep-alive response waits ~40 ms for a delayed ACK (Nagle)
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(f"cannot listen on {listen}: {e.strerror}") from None
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the caller owns SIGINT/SIGTERM (stop event)."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


async def serve(daemon: Daemon, sock: socket.socket, on_ready: Callable[[Daemon], None] | None = None,
                stop: asyncio.Event | None = None) -> None:
    if logging.getLogger().getEffectiveLevel() > logging.DEBUG:
        # asyncssh says six lines per connection at INFO: at a thousand nodes that is noise
        # (and CPU) drowning what the daemon says; -v shows them again
        logging.getLogger("asyncssh").setLevel(logging.WARNING)
    host, port = sock.getsockname()[:2]
    shown = f"[{host}]" if ":" in host else host
    daemon.url = f"http://{shown}:{port}"
    app = create_app(daemon)
    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_keep_alive=75, server_header=False, timeout_graceful_shutdown=5,
                            proxy_headers=False)  # the audit log records the real peer address
    server = _Server(config)
    await daemon.start()
    tune_gc(daemon.metrics)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            if task.done():
                await task
                return
            await asyncio.sleep(0.01)
        if on_ready:
            on_ready(daemon)
        waiters = [task]
        if stop is not None:
            waiters.append(asyncio.create_task(stop.wait()))
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
    finally:
        daemon.close_streams()  # open event streams would hold uvicorn's graceful shutdown
        server.should_exit = True
        try:
            await asyncio.wait_for(task, 10)
        except (TimeoutError, asyncio.CancelledError):
            task.cancel()
        await daemon.stop()
