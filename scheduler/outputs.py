"""Job output shipping: each job's log streamed to the daemon as it is written, within windows,
resent from the last acknowledged offset after a reconnect. Standard library only (bundled)."""

from __future__ import annotations

import base64
import contextlib
import os
import time

if __package__:
    from . import protocol as P
    from .nodefiles import write_atomic
else:  # inside the agent's bundle on a node
    import protocol as P
    from nodefiles import write_atomic


class OutputStreams:
    """Sends every job's output to the daemon as it is written, like a log shipper: at most
    WINDOW bytes of a stream (and MAX_IN_FLIGHT of all streams) beyond the daemon's last
    acknowledgement, resent from there when no acknowledgement comes for RESEND_S. The last
    acknowledged offset is kept beside the log (`log.acked`), so an agent started after a
    daemon restart goes on from there; the daemon skips what it already holds. A stream ends
    when the daemon says `done` (`log.done`): the job ended and every byte is stored, or the
    daemon wants no more of it."""

    CHUNK = 65536
    WINDOW = 4 * CHUNK
    MAX_IN_FLIGHT = 32 * CHUNK
    RESEND_S = 2.0
    PERSIST_S = 1.0

    def __init__(self, agent):  # the Agent whose jobs these are
        self.agent = agent
        self.streams: dict[str, dict] = {}

    def load(self, keys: list) -> None:
        """Streams the daemon has not finished with, of the job directories `keys`: jobs of
        earlier agents included."""
        for key in keys:
            d = os.path.join(self.agent.jobs_dir, key)
            if os.path.isdir(d) and not os.path.exists(os.path.join(d, "log.done")):
                self.add(key)

    def add(self, key: str) -> None:
        if key in self.streams:
            return
        acked = self.agent.read(self.agent.job_dir(key), "log.acked")
        start = int(acked) if acked and acked.isdigit() else 0
        self.streams[key] = {"acked": start, "sent": start, "saved": start, "eof": False,
                             "since": time.monotonic(), "persisted": time.monotonic()}

    def in_flight(self) -> int:
        return sum(st["sent"] - st["acked"] for st in self.streams.values())

    def on_ack(self, msg: P.OutputAck) -> None:
        st = self.streams.get(msg.key)
        if st is None:
            return
        d = self.agent.job_dir(msg.key)
        if msg.done:
            del self.streams[msg.key]
            with contextlib.suppress(FileNotFoundError):  # the job's directory was removed
                write_atomic(os.path.join(d, "log.done"), str(msg.offset))
                self.agent.job_dirs.ended(msg.key)
            return
        offset = int(msg.offset)
        if offset < st["acked"] or offset > st["sent"]:
            # the daemon holds less than was acknowledged (or more than was sent, from an
            # earlier agent): go on from what it holds
            st["sent"] = offset
            st["eof"] = False
        st["acked"] = offset
        st["since"] = time.monotonic()
        now = time.monotonic()
        if now - st["persisted"] >= self.PERSIST_S and st["saved"] != offset:
            write_atomic(os.path.join(d, "log.acked"), str(offset))
            st["saved"], st["persisted"] = offset, now

    def ended(self, key: str, d: str) -> bool:
        if self.agent.exists(d, "rc") or self.agent.exists(d, "failed"):
            return True
        if key in self.agent.watching:
            return False
        return self.agent.status(key)["state"] in ("exited", "lost", "unknown")

    def pump(self) -> None:
        """Send what was written since the last call, within the windows."""
        budget = self.MAX_IN_FLIGHT - self.in_flight()
        now = time.monotonic()
        for key, st in list(self.streams.items()):
            if st["sent"] > st["acked"] or st["eof"]:
                if now - st["since"] < self.RESEND_S:
                    if st["eof"]:
                        continue
                else:  # nothing acknowledged for a while: resend from the acknowledged offset
                    budget += st["sent"] - st["acked"]
                    st["sent"], st["eof"], st["since"] = st["acked"], False, now
            d = self.agent.job_dir(key)
            path = os.path.join(d, "log")
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                size = 0
            room = min(self.WINDOW - (st["sent"] - st["acked"]), budget)
            while room > 0 and st["sent"] < size:
                with open(path, "rb") as f:
                    f.seek(st["sent"])
                    data = f.read(min(self.CHUNK, room, size - st["sent"]))
                if not data:
                    break
                self.agent.send(P.Output(key, st["sent"],
                                         base64.b64encode(data).decode("ascii"), False))
                if st["sent"] == st["acked"]:
                    st["since"] = now
                st["sent"] += len(data)
                room -= len(data)
                budget -= len(data)
            if st["sent"] >= size and not st["eof"] and self.ended(key, d):
                # the end, once everything written has been sent (its size cannot grow now)
                try:
                    size = os.stat(path).st_size
                except FileNotFoundError:
                    size = 0
                if st["sent"] >= size:
                    self.agent.send(P.Output(key, st["sent"], "", True))
                    st["eof"] = True
                    st["since"] = now
