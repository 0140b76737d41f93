"""`trainyard demo`: the daemon on SQLite plus simulated SSH nodes (a process of their own), fed a trace."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import click
from sqlmodel import select

from . import models as m
from .config import DaemonConfig
from .daemon import Daemon
from .models import Node
from .nodes import pin_host_key
from .server import bind, run, serve
from .simnode import spawn_sim_nodes

# The demo cluster's trainyard.toml: two queues (prod preempts dev) and two teams with quotas
# that may borrow from each other; the demo writes it to its directory for a reader to see.
DEMO_TOML = """\
# trainyard.toml of the demo cluster (written by `trainyard demo`)
[daemon]
cluster_name = "demo"
telemetry_interval_s = 1
kill_grace_s = 5
node_grace_s = 30
connect_timeout_s = 5
keepalive_interval_s = 2

[scheduler]
policy = "backfill"
grace_period = 5             # a preempted job has 5 s to checkpoint

[queues.prod]
priority = 100
preempts = ["dev"]           # production work may preempt development work

[queues.dev]
priority = 10
max_time = "2:00:00"
{teams}"""

# what stops the demo (and ends every job it started): Ctrl-C, kill, a closed terminal
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

TEAM_TOML = """
[teams.{name}]
nominal_gpus = {nominal}
borrowing_limit_gpus = {borrow}
cohort = "lab"
users = [{users}]
"""


def demo_toml(gpus_total: int) -> str:
    """The demo's trainyard.toml for a cluster of `gpus_total` GPUs: each team's quota is a
    half of it, and it may borrow a quarter more from the other team."""
    from .demo_feed import team_members

    members = team_members()
    nominal, borrow = max(1, gpus_total // len(members)), max(1, gpus_total // 4)
    teams = "".join(TEAM_TOML.format(name=t, nominal=nominal, borrow=borrow,
                                     users=", ".join(f'"{u}"' for u in users))
                    for t, users in members.items())
    return DEMO_TOML.format(teams=teams)


def demo_config(base: Path, listen: str, gpus_total: int = 32) -> DaemonConfig:
    """The demo daemon's configuration, from the trainyard.toml it writes to `base`."""
    base.mkdir(parents=True, exist_ok=True)
    path = base / "trainyard.toml"
    path.write_text(demo_toml(gpus_total))
    config = DaemonConfig.load(path)
    config.listen = listen
    config.db = str(base / "home" / "trainyard.db")
    return config


async def start_demo(base: Path, nodes: int, gpus: int, listen: str = "127.0.0.1:0",
                     config: DaemonConfig | None = None):
    """Build the cluster; returns (daemon, socket, sims, token) ready for `serve`."""
    config = config or demo_config(base, listen, nodes * gpus)
    daemon = Daemon(config, base / "home")
    daemon.prepare()
    pub = (daemon.key_path.parent / "id_ed25519.pub").read_text()
    sims = await spawn_sim_nodes(base / "nodes", nodes, gpus, pub)
    with daemon.store.tx() as s:
        for i, sim in enumerate(sims.nodes):
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


async def feed_demo(daemon: Daemon, plan, stop: asyncio.Event, max_backlog: int) -> None:
    """Replay the plan's trace slice on the demo cluster as its users (a token each) until `stop`."""
    from .demo_feed import USERS, feed

    tokens = {u: daemon.create_token(u, "user", "demo") for u in USERS}
    await feed(daemon.url, tokens, plan, stop, max_backlog=max_backlog)


def run_demo(nodes: int, gpus: int, tui: bool, listen: str, workdir: str | None,
             idle: bool = False, until_ready: bool = False) -> None:
    """Run the demo until the TUI quits, SIGINT or SIGTERM; `idle`: no workload of its own;
    `until_ready`: stop as soon as every node is UP (what `make demo-ready` measures)."""
    base = Path(workdir) if workdir else Path(tempfile.mkdtemp(prefix="trainyard-demo-"))
    base.mkdir(parents=True, exist_ok=True)
    ready = threading.Event()
    info: dict = {}

    async def main(stop: asyncio.Event) -> None:
        daemon, sock, sims, token = await start_demo(base, nodes, gpus, listen)

        def on_ready(d: Daemon) -> None:
            info.update(url=d.url, token=token, daemon=d)

        feeder: asyncio.Task | None = None
        try:
            async def announce():
                nonlocal feeder
                while "url" not in info:
                    await asyncio.sleep(0.01)
                await wait_nodes_up(daemon, nodes)
                if not idle and not until_ready:
                    if nodes * gpus == 0:
                        info["workload"] = "the demo cluster has no GPUs: its workload is off"
                    else:
                        from .demo_feed import describe, plan_feed

                        plan = await asyncio.to_thread(plan_feed, nodes * gpus)
                        info["workload"] = describe(plan, nodes * gpus)
                        feeder = asyncio.create_task(
                            feed_demo(daemon, plan, stop, max_backlog=3 * nodes * gpus))
                ready.set()
                if until_ready:
                    stop.set()

            announcer = asyncio.create_task(announce())
            await serve(daemon, sock, on_ready, stop)
            announcer.cancel()
        finally:
            if feeder is not None:
                feeder.cancel()
                with contextlib.suppress(BaseException):
                    await feeder
            await sims.stop()  # and every process their jobs started

    if tui and not until_ready:
        try:
            from tui.app import TrainyardApp
            from tui.backend import HttpBackend
        except ImportError:
            TrainyardApp = None  # noqa: N806 - the TUI is optional: run headless without it
        if TrainyardApp is not None:
            _run_with_tui(main, ready, info, base,
                          lambda url, token: TrainyardApp(HttpBackend(url, token)))
            return

    async def headless():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            loop.add_signal_handler(sig, stop.set)

        async def printer():
            while not ready.is_set():
                await asyncio.sleep(0.02)
            print_lines(info, base)
            if until_ready:
                return
            if "workload" in info:
                click.echo(info["workload"], err=True)
            click.echo("demo cluster running; Ctrl-C stops it. Try, in another terminal:\n"
                       "  export TRAINYARD_URL=... TRAINYARD_TOKEN=...   (the two lines above)\n"
                       "  trainyard submit --gpus 2 -- sh -c 'echo $CUDA_VISIBLE_DEVICES; sleep 30'\n"
                       "  trainyard jobs; trainyard nodes; trainyard tui", err=True)

        p = asyncio.create_task(printer())
        await main(stop)
        await asyncio.sleep(0)  # let the printer say what it has to
        p.cancel()

    run(headless())


def _run_with_tui(main, ready: threading.Event, info: dict, base: Path, make_app) -> None:
    """The cluster on a thread of its own, the TUI on this one; quitting the TUI, SIGTERM or
    SIGHUP stops the cluster and ends its jobs before the process exits."""
    loop = asyncio.new_event_loop()
    stop_holder: dict = {}
    app = None
    killed: list[int] = []

    def thread_main():
        asyncio.set_event_loop(loop)
        stop = asyncio.Event()
        stop_holder["stop"] = stop
        loop.run_until_complete(main(stop))

    t = threading.Thread(target=thread_main, name="demo-daemon", daemon=True)

    def stop_cluster() -> None:
        if "stop" in stop_holder and not loop.is_closed():
            with contextlib.suppress(RuntimeError):  # the loop ended meanwhile
                loop.call_soon_threadsafe(stop_holder["stop"].set)
        t.join(15)

    def on_signal(signum, frame):  # SIGTERM, or SIGHUP: the terminal went away
        killed.append(signum)
        try:  # the TUI's loop runs on this thread: ask it to quit as `q` would
            asyncio.get_running_loop().call_soon_threadsafe(app.exit, None, 128 + signum)
        except (RuntimeError, AttributeError):  # no TUI running (yet, or any more)
            stop_cluster()
            raise SystemExit(128 + signum) from None

    previous = {sig: signal.signal(sig, on_signal) for sig in STOP_SIGNALS if sig != signal.SIGINT}
    t.start()
    try:
        if not ready.wait(30):
            raise click.ClickException("the demo cluster did not come up within 30 s")
        app = make_app(info["url"], info["token"])
        app.run()
    finally:
        stop_cluster()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    click.echo(f"demo stopped; its state is kept in {base}", err=True)
    if killed:
        raise SystemExit(128 + killed[0])


def print_lines(info: dict, base: Path) -> None:
    sys.stdout.write(f"TRAINYARD_URL={info['url']}\nTRAINYARD_TOKEN={info['token']}\n")
    sys.stdout.flush()
    click.echo(f"demo state in {base}", err=True)
