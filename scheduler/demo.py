"""`trainyard demo`: the daemon on SQLite plus simulated SSH nodes, in one process."""

from __future__ import annotations

import asyncio
import getpass
import signal
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import click
from sqlmodel import select

from . import models as m
from .config import DaemonConfig
from .daemon import Daemon
from .models import Node
from .nodes import pin_host_key
from .server import bind, run, serve
from .simnode import SimNode, start_sim_nodes, stop_sim_nodes


@dataclass
class DemoCluster:
    url: str
    token: str
    base: Path
    daemon: Daemon
    sims: list[SimNode]


def demo_config(base: Path, listen: str) -> DaemonConfig:
    return DaemonConfig(listen=listen, db=str(base / "home" / "trainyard.db"), cluster_name="demo",
                        telemetry_interval_s=1.0, kill_grace_s=5.0, node_grace_s=30.0,
                        connect_timeout_s=5.0, keepalive_interval_s=2.0)


async def start_demo(base: Path, nodes: int, gpus: int, listen: str = "127.0.0.1:0",
                     config: DaemonConfig | None = None):
    """Build the cluster; returns (daemon, socket, sims, token) ready for `serve`."""
    config = config or demo_config(base, listen)
    daemon = Daemon(config, base / "home")
    daemon.prepare()
    pub = (daemon.key_path.parent / "id_ed25519.pub").read_text()
    sims = await start_sim_nodes(base / "nodes", nodes, gpus, pub)
    with daemon.store.tx() as s:
        for i, sim in enumerate(sims):
            pin_host_key(daemon.known_hosts, "127.0.0.1", sim.port, sim.host_key)
            s.add(Node(name=sim.name, address="127.0.0.1", port=sim.port, user=getpass.getuser(),
                       pool="demo", provider="onprem", gpu_model="NVIDIA H100 80GB HBM3 (simulated)",
                       gpus_total=gpus, simulated=True, state=m.DOWN, reason="connecting",
                       labels={"rack": f"r{(i // 2) + 1}"}, created_at=time.time()))
            daemon.store.record(s, "demo", "node.add", sim.name, {"simulated": True, "port": sim.port})
    token = daemon.create_token(getpass.getuser(), "admin", "demo")
    return daemon, bind(listen), sims, token


async def wait_nodes_up(daemon: Daemon, count: int, timeout: float = 30.0) -> None:
    """Until every node is connected and UP (its health gate passed), or the timeout."""
    deadline = time.monotonic() + timeout

    def up() -> int:
        with daemon.store.read() as s:
            return sum(n.state == m.UP for n in s.exec(select(Node)).all())

    while time.monotonic() < deadline and (daemon.links.connected_count() < count or up() < count):
        await asyncio.sleep(0.05)


def run_demo(nodes: int, gpus: int, tui: bool, listen: str, workdir: str | None) -> None:
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="trainyard-demo-"))
    base.mkdir(parents=True, exist_ok=True)
    ready = threading.Event()
    info: dict = {}

    async def main(stop: asyncio.Event) -> None:
        daemon, sock, sims, token = await start_demo(base, nodes, gpus, listen)

        def on_ready(d: Daemon) -> None:
            info.update(url=d.url, token=token, daemon=d)

        try:
            async def announce():
                while "url" not in info:
                    await asyncio.sleep(0.01)
                await wait_nodes_up(daemon, nodes)
                ready.set()

            announcer = asyncio.create_task(announce())
            await serve(daemon, sock, on_ready, stop)
            announcer.cancel()
        finally:
            await stop_sim_nodes(sims)

    if tui:
        try:
            from tui.app import run_tui
        except ImportError:
            run_tui = None
        if run_tui is not None:
            loop = asyncio.new_event_loop()
            stop_holder: dict = {}

            def thread_main():
                asyncio.set_event_loop(loop)
                stop = asyncio.Event()
                stop_holder["stop"] = stop
                loop.run_until_complete(main(stop))

            t = threading.Thread(target=thread_main, name="demo-daemon", daemon=True)
            t.start()
            if not ready.wait(30):
                raise click.ClickException("the demo cluster did not come up within 30 s")
            try:
                run_tui(info["url"], info["token"])
            finally:
                loop.call_soon_threadsafe(stop_holder["stop"].set)
                t.join(15)
            click.echo(f"demo stopped; its state is kept in {base}", err=True)
            return

    async def headless():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)

        async def printer():
            while not ready.is_set():
                await asyncio.sleep(0.02)
            print_lines(info, base)
            click.echo("demo cluster running; Ctrl-C stops it. Try, in another terminal:\n"
                       "  export TRAINYARD_URL=... TRAINYARD_TOKEN=...   (the two lines above)\n"
                       "  trainyard submit --gpus 2 -- sh -c 'echo $CUDA_VISIBLE_DEVICES; sleep 30'\n"
                       "  trainyard jobs; trainyard nodes; trainyard tui", err=True)

        p = asyncio.create_task(printer())
        await main(stop)
        p.cancel()

    run(headless())


def print_lines(info: dict, base: Path) -> None:
    sys.stdout.write(f"TRAINYARD_URL={info['url']}\nTRAINYARD_TOKEN={info['token']}\n")
    sys.stdout.flush()
    click.echo(f"demo state in {base}", err=True)
