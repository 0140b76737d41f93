"""Terminals in jobs (`srun --pty`): a keystroke's round trip (client -> daemon -> node link ->
agent -> pty -> `cat` -> back) and output throughput, on a real daemon with a real sshd node on
loopback. Prints its figures."""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from websockets.sync.client import connect  # noqa: E402

from tests.conftest import DaemonProc, SshdNode, add_sshd_node, wait_job  # noqa: E402

KEYSTROKES = 200
OUTPUT_MB = 32


def terminal(d: DaemonProc, job_id: int, argv: list[str]):
    query = "&".join(f"argv={a}" for a in argv)
    return connect(f"ws{d.url.removeprefix('http')}/v1/jobs/{job_id}/pty?{query}",
                   additional_headers={"Authorization": f"Bearer {d.token}"}, open_timeout=30,
                   max_size=2**22)


def round_trips(d: DaemonProc, job_id: int) -> list[float]:
    samples = []
    with terminal(d, job_id, ["cat"]) as ws:
        for i in range(KEYSTROKES):
            key = bytes([97 + i % 26])
            t0 = time.perf_counter()
            ws.send(key)
            got = b""
            while key not in got:  # the pty's echo, then cat's copy after a newline (not sent)
                frame = ws.recv(timeout=10)
                got += frame if isinstance(frame, bytes) else b""
            samples.append(time.perf_counter() - t0)
    return samples


def throughput(d: DaemonProc, job_id: int) -> float:
    count = OUTPUT_MB * 2**20 // 4096
    with terminal(d, job_id, ["dd", "if=/dev/zero", "bs=4096", f"count={count}", "status=none"]) as ws:
        t0 = time.perf_counter()
        size = 0
        while True:
            frame = ws.recv(timeout=120)
            if isinstance(frame, bytes):
                size += len(frame)
            elif "exit" in json.loads(frame):
                break
        elapsed = time.perf_counter() - t0
    return size / elapsed / 2**20


def main() -> None:
    base = Path(tempfile.mkdtemp(prefix="bench-pty-"))
    d = DaemonProc(base).start()
    node = SshdNode(base, "bench-01", d.public_key)
    try:
        node.start()
        add_sshd_node(d, node, gpus=1)
        c = d.client()
        job_id = c.submit({"command": ["sleep", "3600"], "name": "bench-pty"})["id"]
        wait_job(c, job_id, "RUNNING", timeout=30)
        rtt = round_trips(d, job_id)
        q1, median, q3 = (x * 1000 for x in statistics.quantiles(rtt, n=4))
        print(f"keystroke round trip over {KEYSTROKES} keys: median {median:.2f} ms "
              f"(quartiles {q1:.2f}-{q3:.2f} ms, max {max(rtt) * 1000:.2f} ms)")
        print(f"output throughput ({OUTPUT_MB} MiB from dd): {throughput(d, job_id):.1f} MiB/s")
        c.cancel(job_id)
    finally:
        node.stop()
        d.stop()


if __name__ == "__main__":
    main()
