"""Simulated nodes for the demo and benchmarks: asyncssh servers that run jobs as local processes.

The demo runs them in a process of their own (`spawn_sim_nodes`): a node's SSH server, like a
real node's sshd, is not the daemon's work, and in the daemon's process each message to or
from an agent would cost the daemon both ends of the SSH link and the copy to the agent's pipes.

Each node is an SSH server on loopback with its own host key and its own directory. The daemon
reaches it through the same code path as a real node (SSH, upload of the same agent bundle,
the agent channel); the agent runs as a real local process of the demo's user. What makes the
node simulated is around that path, in the environment of the node's commands: the GPU
simulator plugin (simgpu.py, which real nodes never get: TRAINYARD_SIM_GPUS and
TRAINYARD_SIM_PLUGIN_DIR) and the node's own agent directory (TRAINYARD_AGENT_DIR), since all
simulated nodes share one machine. Jobs are real processes; the GPUs are not.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import asyncssh


@dataclass
class SimNode:
    name: str
    root: Path
    gpus: int
    host_key: asyncssh.SSHKey
    plugin_dir: Path | None = None
    port: int = 0
    server: asyncssh.SSHAcceptor | None = None
    processes: set = field(default_factory=set)
    fleet: FleetAgent | None = None  # set: the node answers the agent protocol in-process


async def _run_command(node: SimNode, process: asyncssh.SSHServerProcess) -> None:
    if node.fleet is not None:
        await node.fleet.serve(process)
        return
    env = dict(os.environ)
    env.update({"HOME": str(node.root), "TRAINYARD_SIM_GPUS": str(node.gpus), "TRAINYARD_SIM_NODE": node.name,
                "TRAINYARD_SIM_CPUS": str(max(8, node.gpus * 8)),
                "TRAINYARD_SIM_MEM_MB": str(max(1, node.gpus) * 128 * 1024),
                "TRAINYARD_SIM_PLUGIN_DIR": str(node.plugin_dir or ""),
                "TRAINYARD_AGENT_DIR": str(node.root / "agent")})
    local = await asyncio.create_subprocess_shell(
        process.command or "true", cwd=node.root, env=env, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )
    node.processes.add(local)

    async def feed() -> None:  # the channel's stdin to the process, until EOF
        with contextlib.suppress(Exception):
            while data := await process.stdin.read(65536):
                local.stdin.write(data)
                await local.stdin.drain()
        with contextlib.suppress(Exception):
            local.stdin.close()

    async def pump(src, dst) -> None:
        while data := await src.read(65536):
            dst.write(data)

    feeder = asyncio.create_task(feed())
    try:
        # copied by hand: asyncssh's redirect() of subprocess pipes loses the connection under uvloop
        await asyncio.gather(pump(local.stdout, process.stdout), pump(local.stderr, process.stderr))
        process.exit(await local.wait())
    except asyncssh.BreakReceived:
        process.exit(255)
    finally:
        feeder.cancel()
        node.processes.discard(local)
        if local.returncode is None:  # the connection went away: the agent sees EOF and exits
            with contextlib.suppress(Exception):
                local.stdin.close()


async def start_sim_nodes(base: Path, count: int, gpus: int, client_public_key: str,
                          host: str = "127.0.0.1", prefix: str = "node") -> list[SimNode]:
    authorized = asyncssh.import_authorized_keys(client_public_key)
    plugins = base / "plugins"  # the GPU simulator, for these nodes' agents only
    plugins.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(Path(__file__).with_name("simgpu.py"), plugins / "simgpu.py")
    nodes = []
    for i in range(1, count + 1):
        name = f"{prefix}-{i}"
        root = base / name
        root.mkdir(parents=True, exist_ok=True)
        node = SimNode(name, root, gpus, asyncssh.generate_private_key("ssh-ed25519"), plugins)

        def process_factory(process, node=node):
            return _run_command(node, process)

        node.server = await asyncssh.listen(
            host, 0, server_host_keys=[node.host_key], authorized_client_keys=authorized,
            process_factory=process_factory, sftp_factory=asyncssh.SFTPServer, allow_scp=False,
            encoding=None, line_editor=False, keepalive_interval=5, config=[],
        )
        node.port = node.server.sockets[0].getsockname()[1]
        nodes.append(node)
    return nodes


async def stop_sim_nodes(nodes: list[SimNode], grace_s: float = 2.0) -> None:
    """Close the nodes and end every process they started: agents, job steps, jobs and what
    the jobs spawned (a real node keeps jobs running without its agent; a demo must not)."""
    for node in nodes:
        if node.server is not None:
            node.server.close()
            await node.server.wait_closed()
    roots = [node.root for node in nodes if node.fleet is None]
    if roots:
        await asyncio.to_thread(end_processes, roots, grace_s)
    for node in nodes:
        for proc in list(node.processes):
            if proc.returncode is None:
                proc.kill()


NODES_NICE = 19  # the demo's nodes' niceness: see serve_sim_nodes


@dataclass
class NodesProcess:
    """Simulated nodes served by a process of their own (`python -m scheduler.simnode agents`);
    `nodes` as `start_sim_nodes` returns them, but with only their public host keys."""

    proc: asyncio.subprocess.Process
    nodes: list[SimNode]

    async def stop(self, grace_s: float = 2.0) -> None:
        """End the nodes and every process they started (as `stop_sim_nodes`), then the process."""
        if self.proc.returncode is None:
            with contextlib.suppress(Exception):
                self.proc.stdin.close()  # end of file: the process stops its nodes and exits
            try:
                await asyncio.wait_for(self.proc.wait(), grace_s + 10)
            except TimeoutError:
                self.proc.kill()
                await self.proc.wait()
        await asyncio.to_thread(end_processes, [node.root for node in self.nodes], grace_s)


async def spawn_sim_nodes(base: Path, count: int, gpus: int, client_public_key: str,
                          timeout_s: float = 60.0) -> NodesProcess:
    """`start_sim_nodes` in a process of its own. It ends with its nodes' processes when `stop`
    is called or when this process goes away (the end of file on its standard input); what it
    logs goes to `base`/nodes.log."""
    base.mkdir(parents=True, exist_ok=True)
    key_file = base / "authorized_key.pub"
    key_file.write_text(client_public_key)
    with open(base / "nodes.log", "ab") as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "scheduler.simnode", "agents", str(count), str(gpus), str(base),
            str(key_file), stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=log)
    nodes = []
    try:
        while True:
            line = (await asyncio.wait_for(proc.stdout.readline(), timeout_s)).decode().split()
            if line == ["ready"]:
                break
            if len(line) != 4:
                raise RuntimeError(f"the simulated nodes did not start (see {base / 'nodes.log'})")
            name, port, key = line[0], int(line[1]), asyncssh.import_public_key(" ".join(line[2:]))
            nodes.append(SimNode(name, base / name, gpus, key, port=port))
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        raise
    return NodesProcess(proc, nodes)


async def serve_sim_nodes(count: int, gpus: int, base: Path, client_public_key: str) -> None:
    """The process behind `spawn_sim_nodes`: start the nodes, say `NAME PORT HOST_KEY` for each
    and `ready`, and serve until the end of file on standard input or SIGTERM; then end them."""
    import signal

    # The nodes' work (agents, job supervisors, jobs) yields to the control plane: on a real
    # cluster the nodes are other machines, while here they share the daemon's cores, so they
    # get what the control plane leaves (the lowest priority). At a higher one, the job ends
    # they send sooner take the daemon's share of the CPU from the submissions (8 clients,
    # 10,000 jobs: 220-266 jobs/s at nice 0, 263-407 at nice 5, 570-632 at nice 19; README,
    # Performance). Where Linux has it, they also take the SCHED_IDLE policy: they run only on
    # a core that nothing else wants, and the scheduler counts a core that runs only them as
    # free, so the daemon's threads and its clients are woken there rather than beside the
    # daemon (8 clients: 681 and 764 jobs/s against 637 and 645 at nice 19 alone, alternating
    # runs; the daemon 87-88 % of a core against 80-81 %).
    os.nice(NODES_NICE)
    if hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    nodes = await start_sim_nodes(base, count, gpus, client_public_key)
    for n in nodes:
        print(n.name, n.port, n.host_key.export_public_key().decode().strip())
    print("ready", flush=True)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    loop.add_signal_handler(signal.SIGTERM, stop.set)
    for sig in (signal.SIGINT, signal.SIGHUP):  # a terminal's: the daemon stops, then says so here
        loop.add_signal_handler(sig, lambda: None)
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    eof = asyncio.ensure_future(reader.read())
    await asyncio.wait([eof, asyncio.ensure_future(stop.wait())], return_when=asyncio.FIRST_COMPLETED)
    await stop_sim_nodes(nodes)


def end_processes(roots: list[Path], grace_s: float = 2.0) -> set[int]:
    """SIGTERM every process of these nodes, SIGKILL what is left after `grace_s`; the pids."""
    import signal

    ended: set[int] = set()
    for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 1.0), (signal.SIGKILL, 1.0)):
        pids = node_processes(roots)
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        ended |= pids
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and node_processes(roots) & pids:
            time.sleep(0.05)
    return ended


def node_processes(roots: list[Path]) -> set[int]:
    """Live processes started on these nodes: those with a node's agent directory in their
    environment (every command of a simulated node gets it, and jobs inherit it), and every
    process in a session one of them leads (a job that scrubbed its environment)."""
    markers = {f"TRAINYARD_AGENT_DIR={root / 'agent'}".encode() for root in roots}
    own, sessions, marked = os.getpid(), {}, set()
    try:
        entries = [int(p) for p in os.listdir("/proc") if p.isdigit()]
    except OSError:  # no /proc (not Linux): the agents are still ended by their channels
        return set()
    for pid in entries:
        if pid == own:
            continue
        try:
            with open(f"/proc/{pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            if fields[0] == b"Z":  # a zombie has ended; its parent reaps it
                continue
            sessions[pid] = int(fields[3])
            with open(f"/proc/{pid}/environ", "rb") as f:
                if markers & set(f.read().split(b"\0")):
                    marked.add(pid)
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile, or not ours to read
    return marked | {pid for pid, sid in sessions.items() if sid in marked}


# ------------------------------------------------------------------ a fleet of many nodes
# A thousand agents as processes would need a thousand Pythons; a fleet node instead answers
# the agent protocol inside this process, behind a real SSH server: the daemon's side (SSH,
# locate, hello, sync, launch, telemetry) is exactly what it is for a real node.

SIGNAL_RC = {"TERM": 143, "KILL": 137, "INT": 130}


class FleetAgent:
    """The agent protocol of one simulated node, answered in-process: `sleep N` ends after N
    seconds, anything else at once with status 0; telemetry from the GPU simulator."""

    def __init__(self, node: SimNode):
        from .simgpu import SimulatedGpus

        self.node = node
        self.gpus = SimulatedGpus(node.gpus)
        self.jobs: dict[str, dict] = {}  # key -> {"state", "rc", "end_time", "gpus", "job_id"}
        self.timers: dict[str, asyncio.TimerHandle] = {}
        self.out: asyncssh.SSHWriter | None = None

    async def serve(self, process: asyncssh.SSHServerProcess) -> None:
        command = process.command or ""
        if "--node" not in command:  # the daemon's locate (nodestate.py): the directory and bundle
            import json

            process.stdout.write(json.dumps({"uid": os.geteuid(), "user": "fleet", "python": "3.11",
                                             "dir": str(self.node.root / "agent"), "have_bundle": True})
                                 .encode() + b"\n")
            process.exit(0)
            return
        interval = float(command.split("--telemetry", 1)[1].split()[0]) if "--telemetry" in command else 2.0
        self.out = process.stdout
        self._send(self._hello())
        ticker = asyncio.get_running_loop().create_task(self._telemetry(interval))
        try:
            while line := await process.stdin.readline():
                self._handle(line)
        except (asyncssh.Error, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            ticker.cancel()
            self.out = None
            with contextlib.suppress(Exception):
                process.exit(0)

    def _hello(self):
        from . import protocol as P

        return P.Hello(protocol=P.PROTOCOL_VERSION, host="fleet", node=self.node.name, pid=os.getpid(),
                       user="fleet", cpus=max(8, self.node.gpus * 8),
                       mem_mb=max(1, self.node.gpus) * 128 * 1024, gpu_source="simulated",
                       gpu_model=self.gpus.model, gpus=self.gpus.describe(), gpu_note=self.gpus.note,
                       root="", min_uid=1000)

    def _send(self, msg) -> None:
        from . import protocol as P

        if self.out is not None:
            self.out.write(P.encode(msg).encode())

    async def _telemetry(self, interval: float) -> None:
        from . import protocol as P

        while True:
            await asyncio.sleep(interval)
            busy = {g: j["job_id"] for j in self.jobs.values() if j["state"] == "running" for g in j["gpus"]}
            self._send(P.Telemetry(time=time.time(), source="simulated", gpus=self.gpus.telemetry(busy)))

    def _handle(self, line: bytes | str) -> None:
        import json

        from . import protocol as P

        try:
            msg = json.loads(line)
        except ValueError:
            return
        op, key = msg.get("op"), msg.get("key")
        if op == "launch":
            self.jobs[key] = {"state": "running", "rc": None, "end_time": None, "gpus": msg.get("gpus") or [],
                              "job_id": msg.get("job_id")}
            self._send(P.Started(key, pid=0))
            argv = msg.get("argv") or []
            seconds = float(argv[1]) if len(argv) == 2 and argv[0] == "sleep" else 0.0
            self.timers[key] = asyncio.get_running_loop().call_later(seconds, self._exit, key, 0)
        elif op == "signal" and key in self.timers:
            self.timers[key].cancel()
            self._exit(key, SIGNAL_RC.get(msg.get("sig"), 143))
        elif op == "sync":
            jobs = [{"key": k, **({"state": "exited", "rc": j["rc"], "end_time": j["end_time"]}
                                  if j["state"] == "exited" else {"state": "running", "pid": 0})}
                    for k, j in self.jobs.items()]
            self._send(P.Jobs(id=msg.get("id"), jobs=jobs))
        elif op == "forget":
            for k in msg.get("keys") or ():
                if self.jobs.get(k, {}).get("state") == "exited":
                    del self.jobs[k]
        elif op == "log":  # fleet jobs write no output
            self._send(P.LogChunk(key or "", id=msg.get("id"), offset=msg.get("offset", 0),
                                  next=msg.get("offset", 0)))
        elif op == "ping":
            self._send(P.Pong(msg.get("id")))
        elif msg.get("id") is not None:
            self._send(P.Error(f"{op!r} is not simulated on fleet nodes", id=msg.get("id")))

    def _exit(self, key: str, rc: int) -> None:
        from . import protocol as P

        self.timers.pop(key, None)
        job = self.jobs.get(key)
        if job is None or job["state"] != "running":
            return
        job.update(state="exited", rc=rc, end_time=time.time())
        self._send(P.Exited(key, rc=rc, end_time=job["end_time"]))


async def start_fleet(base: Path, count: int, gpus: int, client_public_key: str, host_key: asyncssh.SSHKey,
                      prefix: str = "fleet") -> list[SimNode]:
    """`count` nodes that share one host key, each an SSH server whose agent is a FleetAgent."""
    authorized = asyncssh.import_authorized_keys(client_public_key)
    nodes = []
    for i in range(1, count + 1):
        node = SimNode(f"{prefix}-{i:04d}", base / f"{prefix}-{i:04d}", gpus, host_key)
        node.root.mkdir(parents=True, exist_ok=True)
        node.fleet = FleetAgent(node)

        def process_factory(process, node=node):
            return _run_command(node, process)

        node.server = await asyncssh.listen(
            "127.0.0.1", 0, server_host_keys=[host_key], authorized_client_keys=authorized,
            process_factory=process_factory, encoding=None, line_editor=False, keepalive_interval=30,
            config=[],
        )
        node.port = node.server.sockets[0].getsockname()[1]
        nodes.append(node)
    return nodes


def main() -> None:
    """`python -m scheduler.simnode COUNT GPUS DIR AUTHORIZED_KEY_FILE`: run a fleet until SIGTERM.

    Writes the fleet's host key to DIR/host_key and prints one line per node, `NAME PORT`, then
    `ready`. With `agents` first: nodes whose agents are processes (`serve_sim_nodes`)."""
    import signal

    if sys.argv[1:2] == ["agents"]:
        count, gpus, base, pub = int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]), Path(sys.argv[5])
        asyncio.run(serve_sim_nodes(count, gpus, base, pub.read_text()))
        return
    count, gpus, base, pub = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3]), Path(sys.argv[4])

    async def run() -> None:
        base.mkdir(parents=True, exist_ok=True)
        key = asyncssh.generate_private_key("ssh-ed25519")
        (base / "host_key.pub").write_bytes(key.export_public_key())
        nodes = await start_fleet(base, count, gpus, pub.read_text(), key)
        for n in nodes:
            print(n.name, n.port)
        print("ready", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await stop_sim_nodes(nodes)

    asyncio.run(run())


if __name__ == "__main__":
    main()
