"""The node agent: launches jobs detached, reports their exits and the node's GPUs, over JSON lines.

Runs on the node under `python3`, uploaded by the daemon over SFTP (DESIGN.md boundary 3).
Standard library only; pynvml is used when the node has it. The daemon writes one JSON object
per line on stdin (`launch`, `signal`, `sync`, `forget`, `log`, `ping`); the agent answers on
stdout (`hello`, `started`, `exited`, `jobs`, `log`, `pong`, `telemetry`, `error`).

Every job runs under a small sh wrapper in its own session, so it survives
the agent, the SSH link and the daemon. The wrapper writes the job's exit status atomically
to `<agent_dir>/jobs/<key>/rc`; whoever asks later reads it from there.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import random
import signal
import socket
import subprocess
import sys
import threading
import time

PROTOCOL = 1
SIGNALS = {"TERM": signal.SIGTERM, "KILL": signal.SIGKILL, "INT": signal.SIGINT,
           "USR1": signal.SIGUSR1, "HUP": signal.SIGHUP}


# ---------------------------------------------------------------- the wrapper (own session)

# The wrapper is a tiny sh script in its own session. `setsid` (util-linux) puts the job in a
# session and process group of its own whose id is the job's pid, so signals reach the job
# and its children but never the wrapper, which waits and records the exit status.
WRAPPER = """echo $$ > wpid
setsid "$@" >>log 2>&1 </dev/null &
pid=$!
echo $pid > pid.tmp && mv pid.tmp pid
wait $pid
echo $? > rc.tmp && mv rc.tmp rc
"""


def _write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# ---------------------------------------------------------------- GPUs

class Gpus:
    """The node's GPUs: NVML when present, simulated in the demo, else what was declared."""

    def __init__(self, declared: int, declared_model: str):
        self.source = "none"
        self.nvml = None
        self.count = 0
        self.model = declared_model
        sim = os.environ.get("TRAINYARD_SIM_GPUS")
        if sim:
            self.source, self.count = "simulated", int(sim)
            self.model = os.environ.get("TRAINYARD_SIM_GPU_MODEL", "NVIDIA H100 80GB HBM3")
            return
        try:
            import pynvml  # noqa: PLC0415

            pynvml.nvmlInit()
            self.nvml = pynvml
            self.count = pynvml.nvmlDeviceGetCount()
            self.source = "nvml"
            if self.count:
                name = pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(0))
                self.model = name.decode() if isinstance(name, bytes) else name
        except Exception:  # no pynvml, no driver, or NVML refused: fall back to the declaration
            self.nvml = None
            if declared:
                self.source, self.count = "declared", declared

    def describe(self) -> list[dict]:
        return [{"index": i, "name": self.model} for i in range(self.count)]

    def telemetry(self, busy: dict[int, int]) -> list[dict]:
        out = []
        for i in range(self.count):
            if self.source == "simulated":
                job = busy.get(i)
                util = random.randint(85, 100) if job else random.randint(0, 3)
                out.append({
                    "index": i, "name": self.model, "uuid": f"GPU-sim-{socket.gethostname()}-{i}",
                    "util_gpu": util, "util_mem": util // 2,
                    "mem_total_mb": 81559, "mem_used_mb": 60000 + random.randint(0, 4000) if job else 0,
                    "temp_c": 60 + util // 5 + random.randint(0, 3), "power_w": 90 + util * 6,
                    "power_limit_w": 700, "ecc_dbe": 0, "xid": None, "job_id": job,
                })
            elif self.source == "nvml":
                out.append(self._nvml_gpu(i, busy.get(i)))
            else:
                out.append({"index": i, "name": self.model, "job_id": busy.get(i)})
        return out

    def _nvml_gpu(self, i: int, job) -> dict:
        n = self.nvml
        g: dict = {"index": i, "job_id": job}

        def guard(key, fn):
            try:
                g[key] = fn()
            except Exception:  # a field this driver does not support is reported missing
                g[key] = None

        h = n.nvmlDeviceGetHandleByIndex(i)
        guard("name", lambda: _text(n.nvmlDeviceGetName(h)))
        guard("uuid", lambda: _text(n.nvmlDeviceGetUUID(h)))
        guard("util_gpu", lambda: n.nvmlDeviceGetUtilizationRates(h).gpu)
        guard("util_mem", lambda: n.nvmlDeviceGetUtilizationRates(h).memory)
        guard("mem_total_mb", lambda: n.nvmlDeviceGetMemoryInfo(h).total // 2**20)
        guard("mem_used_mb", lambda: n.nvmlDeviceGetMemoryInfo(h).used // 2**20)
        guard("temp_c", lambda: n.nvmlDeviceGetTemperature(h, n.NVML_TEMPERATURE_GPU))
        guard("power_w", lambda: n.nvmlDeviceGetPowerUsage(h) / 1000)
        guard("power_limit_w", lambda: n.nvmlDeviceGetEnforcedPowerLimit(h) / 1000)
        return g


def _text(v):
    return v.decode() if isinstance(v, bytes) else v


# ---------------------------------------------------------------- the agent

class Agent:
    def __init__(self, root: str, declared_gpus: int, declared_model: str, telemetry_s: float):
        self.root = os.path.abspath(root)
        self.jobs_dir = os.path.join(self.root, "jobs")
        os.makedirs(self.jobs_dir, exist_ok=True)
        self.out_lock = threading.Lock()
        self.inbox: queue.Queue = queue.Queue()
        self.wrappers: dict[str, subprocess.Popen] = {}
        self.watching: dict[str, dict] = {}  # key -> {"gpus": [...], "job_id": ...}
        self.gpus = Gpus(declared_gpus, declared_model)
        self.telemetry_s = telemetry_s

    def send(self, msg: dict) -> None:
        line = json.dumps(msg, separators=(",", ":")) + "\n"
        with self.out_lock:
            sys.stdout.write(line)
            sys.stdout.flush()

    def job_dir(self, key: str) -> str:
        if not key or "/" in key or key.startswith("."):
            raise ValueError(f"bad job key {key!r}")
        return os.path.join(self.jobs_dir, key)

    # --- requests
    def on_launch(self, msg: dict) -> None:
        key = msg["key"]
        d = self.job_dir(key)
        info = {"gpus": msg.get("gpus", []), "job_id": msg.get("job_id"), "announced": False}
        try:
            os.mkdir(d)
        except FileExistsError:
            # launched before (the daemon retries after a crash): report, never run twice
            self.watching.setdefault(key, info)
            self.report(key)
            return
        self.watching[key] = info
        argv = msg.get("argv")
        if msg.get("script") is not None:
            path = os.path.join(d, "script")
            with open(path, "w") as f:
                f.write(msg["script"])
            os.chmod(path, 0o700)
            argv = [path] if msg["script"].startswith("#!") else ["/bin/sh", path]
        workdir = msg.get("workdir")
        if workdir and not os.path.isdir(workdir):
            _write_atomic(os.path.join(d, "log"),
                          f"trainyard: workdir {workdir!r} does not exist on {socket.gethostname()}\n")
            _write_atomic(os.path.join(d, "rc"), "127")
            self.report(key)
            return
        if workdir:
            argv = ["sh", "-c", 'cd "$0" && exec "$@"', workdir, *argv]
        env = dict(os.environ)
        env.update(msg.get("env") or {})
        with open(os.path.join(d, "spec.json"), "w") as f:
            json.dump({"argv": argv, "env": msg.get("env") or {}, "workdir": workdir}, f)
        self.wrappers[key] = subprocess.Popen(
            ["/bin/sh", "-c", WRAPPER, "trainyard-wrapper", *argv], cwd=d, env=env,
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, close_fds=True,
        )

    def exists(self, d: str, name: str) -> bool:
        return os.path.exists(os.path.join(d, name))

    def status(self, key: str) -> dict:
        d = self.job_dir(key)
        if not os.path.isdir(d):
            return {"key": key, "state": "unknown"}
        for attempt in (0, 1):
            rc = self.read(d, "rc")
            if rc is not None:
                end = os.stat(os.path.join(d, "rc")).st_mtime
                return {"key": key, "state": "exited", "rc": int(rc), "end_time": end}
            if attempt:
                break
            pid = self.read(d, "pid")
            if pid is not None and self.alive(int(pid)):
                # running once setsid has made it the leader of its own process group
                state = "running" if self.group_leader(int(pid)) else "starting"
                return {"key": key, "state": state, "pid": int(pid)}
            wpid = self.read(d, "wpid")
            if wpid is None or self.alive(int(wpid)):
                # the wrapper is still starting the job, or about to write its exit status
                return {"key": key, "state": "starting" if pid is None else "running",
                        "pid": int(pid) if pid else None}
        # job and wrapper are gone and no exit status was written (e.g. the node rebooted)
        return {"key": key, "state": "lost"}

    @staticmethod
    def read(d: str, name: str):
        try:
            with open(os.path.join(d, name)) as f:
                return f.read().strip()
        except FileNotFoundError:
            return None

    @staticmethod
    def group_leader(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[2]) == pid
        except (OSError, ValueError, IndexError):
            return os.getpgid(pid) == pid if hasattr(os, "getpgid") else True

    @staticmethod
    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:  # kill -0 succeeds on zombies
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return True

    def report(self, key: str) -> None:
        st = self.status(key)
        if st["state"] == "running":
            self.send({"ev": "started", "key": key, "pid": st["pid"]})
        elif st["state"] in ("exited", "lost"):
            self.send({"ev": "exited", "key": key, "rc": st.get("rc"), "end_time": st.get("end_time"),
                       "lost": st["state"] == "lost"})
            self.watching.pop(key, None)

    def on_signal(self, msg: dict) -> None:
        key, sig = msg["key"], SIGNALS[msg.get("sig", "TERM")]
        pid = self.read(self.job_dir(key), "pid")
        if pid is None:
            return
        try:
            os.killpg(int(pid), sig)
        except ProcessLookupError:  # not yet its own group leader: signal the process itself
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), sig)

    def on_sync(self, msg: dict) -> None:
        """Report every job that has not been forgotten: running ones and exits nobody heard."""
        jobs = []
        for key in sorted(os.listdir(self.jobs_dir)):
            d = os.path.join(self.jobs_dir, key)
            if os.path.exists(os.path.join(d, "forgotten")):
                continue
            st = self.status(key)
            jobs.append(st)
            if st["state"] in ("running", "starting"):
                self.watching.setdefault(key, {"gpus": [], "job_id": None})
        self.send({"ev": "jobs", "id": msg.get("id"), "jobs": jobs})

    def on_watch(self, msg: dict) -> None:
        """After a reconnect the daemon says which GPUs each running job holds (for telemetry)."""
        for key, info in msg.get("jobs", {}).items():
            if key in self.watching:
                self.watching[key] = info

    def on_forget(self, msg: dict) -> None:
        for key in msg.get("keys", []):
            d = self.job_dir(key)
            if os.path.isdir(d):
                open(os.path.join(d, "forgotten"), "w").close()
            self.watching.pop(key, None)
            w = self.wrappers.pop(key, None)
            if w is not None:
                w.poll()

    def on_log(self, msg: dict) -> None:
        d = self.job_dir(msg["key"])
        offset, limit = int(msg.get("offset", 0)), int(msg.get("limit", 65536))
        data, size = b"", 0
        try:
            with open(os.path.join(d, "log"), "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(min(offset, size))
                data = f.read(limit)
        except FileNotFoundError:
            pass
        self.send({"ev": "log", "id": msg.get("id"), "key": msg["key"], "offset": offset,
                   "data": data.decode("utf-8", "replace"), "next": offset + len(data), "size": size})

    # --- loops
    def read_stdin(self) -> None:
        for line in sys.stdin:
            line = line.strip()
            if line:
                self.inbox.put(line)
        self.inbox.put(None)  # EOF: the daemon went away

    def hello(self) -> dict:
        mem_mb = 0
        try:
            with open("/proc/meminfo") as f:
                mem_mb = int(f.readline().split()[1]) // 1024
        except (OSError, ValueError, IndexError):
            pass
        # simulated nodes (demo, tests) share one machine, so they may claim a size of their own
        cpus = int(os.environ.get("TRAINYARD_SIM_CPUS") or os.cpu_count() or 1)
        mem_mb = int(os.environ.get("TRAINYARD_SIM_MEM_MB") or mem_mb)
        return {"ev": "hello", "protocol": PROTOCOL, "host": socket.gethostname(), "pid": os.getpid(),
                "cpus": cpus, "mem_mb": mem_mb, "gpu_source": self.gpus.source,
                "gpu_model": self.gpus.model, "gpus": self.gpus.describe(), "root": self.root}

    def run(self) -> None:
        self.send(self.hello())
        threading.Thread(target=self.read_stdin, daemon=True).start()
        handlers = {"launch": self.on_launch, "signal": self.on_signal, "sync": self.on_sync,
                    "forget": self.on_forget, "log": self.on_log, "watch": self.on_watch,
                    "ping": lambda m: self.send({"ev": "pong", "id": m.get("id")})}
        next_tel = next_lost_check = time.monotonic()
        while True:
            try:
                starting = any(not i.get("announced", True) for i in self.watching.values())
                line = self.inbox.get(timeout=0.002 if starting else 0.05)
            except queue.Empty:
                line = ""
            if line is None:
                return
            if line:
                try:
                    msg = json.loads(line)
                    handlers[msg["op"]](msg)
                except Exception as e:  # a bad request never kills the agent
                    self.send({"ev": "error", "id": _get_id(line), "error": f"{type(e).__name__}: {e}"})
            check_lost = time.monotonic() >= next_lost_check
            if check_lost:
                next_lost_check = time.monotonic() + 1.0
            for key, info in list(self.watching.items()):
                d = self.job_dir(key)
                if self.exists(d, "rc"):
                    self.report(key)
                elif not info.get("announced", True) and self.exists(d, "pid"):
                    if self.status(key)["state"] != "starting":
                        info["announced"] = True
                        self.report(key)
                elif check_lost and self.status(key)["state"] == "lost":
                    self.report(key)
            for key, w in list(self.wrappers.items()):
                if w.poll() is not None and key not in self.watching:
                    del self.wrappers[key]
            if self.telemetry_s > 0 and time.monotonic() >= next_tel:
                next_tel = time.monotonic() + self.telemetry_s
                busy = {g: info.get("job_id") for info in self.watching.values() for g in info.get("gpus", [])}
                self.send({"ev": "telemetry", "time": time.time(), "gpus": self.gpus.telemetry(busy)})


def _get_id(line: str):
    try:
        return json.loads(line).get("id")
    except Exception:
        return None


def main(argv: list[str]) -> int:
    import argparse  # noqa: PLC0415

    p = argparse.ArgumentParser(prog="trainyard-agent")
    p.add_argument("--root", default=".trainyard")
    p.add_argument("--gpus", type=int, default=0, help="GPUs declared for this node (used without NVML)")
    p.add_argument("--gpu-model", default="")
    p.add_argument("--telemetry", type=float, default=2.0, help="seconds between telemetry reports")
    args = p.parse_args(argv)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    Agent(args.root, args.gpus, args.gpu_model, args.telemetry).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
