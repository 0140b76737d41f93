"""Simulated nodes for the demo and benchmarks: asyncssh servers that run jobs as local processes.

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


async def _run_command(node: SimNode, process: asyncssh.SSHServerProcess) -> None:
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


async def stop_sim_nodes(nodes: list[SimNode]) -> None:
    for node in nodes:
        if node.server is not None:
            node.server.close()
            await node.server.wait_closed()
        for proc in list(node.processes):
            if proc.returncode is None:
                proc.kill()
