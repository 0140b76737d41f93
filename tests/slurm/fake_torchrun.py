#!/usr/bin/env python3
"""A stand-in for torchrun in tests (torch is not installed): starts --nproc_per_node workers
with torchrun's variables, and rendezvous them over TCP the way torch.distributed does.

Rank 0 listens on MASTER_PORT; every other rank connects and sends what it sees. The nodes of
the tests share one host, so the connection goes to loopback; MASTER_ADDR is still recorded.
Each worker writes rank-RANK.json into --out; rank 0 also writes rendezvous.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import time

SEEN = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
        "MASTER_PORT", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "SLURM_NTASKS",
        "SLURM_NNODES", "SLURM_JOB_NODELIST", "SLURMD_NODENAME", "SLURM_JOB_ID", "SLURM_STEP_ID")


def worker(out: str) -> int:
    seen = {k: os.environ.get(k) for k in SEEN}
    rank, world = int(seen["RANK"]), int(seen["WORLD_SIZE"])
    with open(os.path.join(out, f"rank-{rank}.json"), "w") as f:
        json.dump(seen, f)
    port = int(seen["MASTER_PORT"])
    if rank == 0:
        peers = []
        with socket.create_server(("127.0.0.1", port)) as server:
            server.settimeout(60)
            while len(peers) < world - 1:
                conn, _ = server.accept()
                with conn, conn.makefile() as lines:
                    peers.append(json.loads(lines.readline()))
        with open(os.path.join(out, "rendezvous.json"), "w") as f:
            json.dump(sorted(peers, key=lambda p: int(p["RANK"])), f)
        return 0
    deadline = time.monotonic() + 60
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
                conn.sendall((json.dumps(seen) + "\n").encode())
            return 0
        except OSError:
            if time.monotonic() > deadline:
                print(f"rank {rank}: no rendezvous at {seen['MASTER_ADDR']}:{port}", file=sys.stderr)
                return 1
            time.sleep(0.1)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--nnodes", type=int, required=True)
    p.add_argument("--node_rank", type=int, required=True)
    p.add_argument("--nproc_per_node", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--worker", action="store_true")
    a = p.parse_args()
    if a.worker:
        return worker(a.out)
    world = a.nnodes * a.nproc_per_node
    procs = []
    for local in range(a.nproc_per_node):
        env = {**os.environ, "RANK": str(a.node_rank * a.nproc_per_node + local),
               "LOCAL_RANK": str(local), "WORLD_SIZE": str(world),
               "LOCAL_WORLD_SIZE": str(a.nproc_per_node), "GROUP_RANK": str(a.node_rank)}
        procs.append(subprocess.Popen([sys.executable, __file__, *sys.argv[1:], "--worker"], env=env))
    return max(p.wait() for p in procs)


if __name__ == "__main__":
    sys.exit(main())
