"""An in-memory backend with the daemon's shapes: for the TUI's tests and its benchmark."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterator

from tui.backend import BackendError, BackendUnreachable

FROZEN_NOW = 1_767_225_600.0  # 2026-01-01 00:00:00 UTC: snapshots use a frozen clock

STATES = ["RUNNING", "PENDING", "PENDING", "HELD", "COMPLETED", "FAILED", "RUNNING", "PENDING"]
REASONS = {"PENDING": "Resources", "HELD": "Held"}
USERS = ["ana", "bo", "chen", "dara", "eli"]
QUEUES = ["default", "research", "prod"]
# [teams.*] as the daemon's config would have them; eli is in none, so in "default".
TEAMS = {
    "vision": {"cohort": "lab", "nominal_gpus": 8, "borrowing_limit_gpus": 8,
               "lending_limit_gpus": 4, "fairshare_shares": 2.0, "users": ["ana", "bo"]},
    "nlp": {"cohort": "lab", "nominal_gpus": 4, "borrowing_limit_gpus": None,
            "lending_limit_gpus": 0, "fairshare_shares": 1.0, "users": ["chen", "dara"]},
    "infra": {"cohort": None, "nominal_gpus": 8, "borrowing_limit_gpus": None,
              "lending_limit_gpus": None, "fairshare_shares": 0.5, "users": []},
}


ACTIVE = ("PENDING", "HELD", "STARTING", "CONFIGURING", "RUNNING")
LAUNCHED = ("STARTING", "CONFIGURING", "RUNNING")


class FakeBackend:
    """Deterministic cluster data; `advance()` moves telemetry on, actions emit events.

    `slurm_states=True` speaks Slurm's words, as the daemon will: a held job is PENDING with
    reason JobHeldUser, a launching one CONFIGURING, and a job killed for memory OUT_OF_MEMORY."""

    url = "fake://cluster"

    def __init__(self, nodes: int = 4, gpus_per_node: int = 8, jobs: int = 12,
                 now: float = FROZEN_NOW, role: str = "admin", name: str = "demo",
                 slurm_states: bool = False):
        self.now = now
        self.slurm_states = slurm_states
        self.role = role
        self.name = name
        self.problems: list[str] = []  # the daemon's own (GET /v1/cluster "problems")
        self.loop_lag_p99_ms = 0.4  # GET /v1/cluster "loop_lag_p99_ms": an idle daemon's
        self.up = True
        self.tick = 0
        self._lock = threading.Lock()
        self._listeners: list[queue.Queue] = []
        self._closed = threading.Event()
        self._events: list[dict] = []
        self.calls: list[tuple] = []
        self._nodes = {}
        for i in range(nodes):
            name_i = f"gpu-{i:04d}" if nodes > 99 else f"gpu-{i:02d}"
            self._nodes[name_i] = {
                "name": name_i, "address": f"10.0.{i // 250}.{i % 250 + 1}", "port": 22,
                "user": "trainyard", "pool": "aws-a100" if i % 2 == 0 else "onprem-h100",
                "provider": "aws" if i % 2 == 0 else "onprem", "state": "UP", "reason": None,
                "gpu_model": "A100-80GB" if i % 2 == 0 else "H100-80GB",
                "gpus_total": gpus_per_node, "gpus_used": 0, "cpus": 96, "mem_mb": 1_048_576,
                "labels": {"zone": f"z{i % 3}"}, "last_seen": now, "telemetry": None,
            }
        self._jobs: dict[int, dict] = {}
        names = list(self._nodes)
        free = {n: list(range(gpus_per_node)) for n in names}
        for j in range(1, jobs + 1):
            state = STATES[j % len(STATES)]
            gpus = [1, 2, 4, 8][j % 4] if gpus_per_node >= 8 else 1
            job = {
                "id": j, "name": f"train-{j}", "user": USERS[j % len(USERS)],
                "queue": QUEUES[j % len(QUEUES)], "state": state, "reason": REASONS.get(state),
                "gpus": gpus, "nodes": 1, "cpus": 8, "mem": "64G", "priority": 100 + j % 7,
                "submit_time": now - 3600 + j * 7, "start_time": None, "end_time": None,
                "exit_code": None, "allocation": [], "command": ["python", "train.py", f"--seed={j}"],
                "time_limit": 3600 * 4, "estimated_start": None,
                "account": "infra" if j % 10 == 0 else None,
            }
            if state in ("RUNNING", "COMPLETED", "FAILED"):
                node = next((n for n in names if len(free[n]) >= gpus), None)
                if node is None:
                    job.update(state="PENDING", reason="Resources")
                else:
                    job["start_time"] = job["submit_time"] + 60
                    if state == "RUNNING":
                        taken, free[node] = free[node][:gpus], free[node][gpus:]
                        job["allocation"] = [{"node": node, "gpus": taken}]
                    else:
                        job["end_time"] = job["start_time"] + 600
                        job["exit_code"] = 0 if state == "COMPLETED" else 1
            if slurm_states:
                job.update(_slurm_words(job, j))
            self._jobs[j] = job
        self._logs: dict[int, list[str]] = {}
        self._event("system", "cluster.start", name, {})
        self._refresh_telemetry()

    # -- data -------------------------------------------------------------------------------

    def _check(self) -> None:
        if not self.up:
            raise BackendUnreachable(f"cannot reach {self.url}: connection refused")

    def _refresh_telemetry(self) -> None:
        users = {}
        for job in self._jobs.values():
            if job["state"] in LAUNCHED:
                for a in job["allocation"]:
                    for g in a["gpus"]:
                        users[(a["node"], g)] = job["id"]
        for i, node in enumerate(self._nodes.values()):
            gpus = []
            for g in range(node["gpus_total"]):
                job_id = users.get((node["name"], g))
                busy = job_id is not None
                util = ((i * 37 + g * 11 + self.tick * 7) % 60 + 40) if busy else 0
                gpus.append({
                    "index": g, "name": node["gpu_model"], "uuid": f"GPU-{i:04d}-{g}",
                    "util_gpu": util, "util_mem": util // 2,
                    "mem_total_mb": 81920, "mem_used_mb": 60000 + g * 100 if busy else 0,
                    "temp_c": 35 + util // 2, "power_w": 60 + util * 3, "power_limit_w": 400,
                    "ecc_dbe": 1 if (i == 1 and g == 3) else 0, "xid": None, "job_id": job_id,
                })
            node["gpus_used"] = sum(1 for g in gpus if g["job_id"] is not None)
            node["telemetry"] = {"time": self.now, "gpus": gpus}

    def advance(self, seconds: float = 2.0) -> None:
        """Move the clock and telemetry on, as a daemon tick would."""
        with self._lock:
            self.now += seconds
            self.tick += 1
            self._refresh_telemetry()

    def _event(self, actor: str, action: str, target: str, detail: dict) -> dict:
        event = {"id": len(self._events) + 1, "time": self.now, "actor": actor, "action": action,
                 "target": target, "detail": detail, "address": "127.0.0.1"}
        self._events.append(event)
        for listener in list(self._listeners):
            listener.put(event)
        return event

    def me(self) -> dict:
        self._check()
        return {"user": "root" if self.role == "admin" else "ana", "role": self.role}

    def cluster(self) -> dict:
        self._check()
        with self._lock:
            nodes = list(self._nodes.values())
            jobs = list(self._jobs.values())
            return {
                "name": self.name,
                "nodes_up": sum(1 for n in nodes if n["state"] == "UP"),
                "nodes_total": len(nodes),
                "gpus_total": sum(n["gpus_total"] for n in nodes),
                "gpus_used": sum(n["gpus_used"] for n in nodes),
                "jobs_running": sum(1 for j in jobs if j["state"] in LAUNCHED),
                "jobs_pending": sum(1 for j in jobs if j["state"] in ("PENDING", "HELD")),
                "problems": list(self.problems),
                "loop_lag_p99_ms": self.loop_lag_p99_ms,
            }

    def nodes(self) -> list[dict]:
        self._check()
        with self._lock:
            return [dict(n) for n in self._nodes.values()]

    def node(self, name: str) -> dict:
        self._check()
        if name not in self._nodes:
            raise BackendError(f"no node named {name!r}", 404)
        return dict(self._nodes[name])

    def jobs(self, all=False, state=None, user=None, queue=None, limit=None) -> list[dict]:
        self._check()
        self.calls.append(("jobs", {"all": all, "state": state, "user": user, "queue": queue}))
        with self._lock:
            out = []
            for job in self._jobs.values():
                if not all and not state and job["state"] not in ACTIVE:
                    continue
                if state and job["state"].lower() != state.lower():
                    continue
                if user and job["user"] != user:
                    continue
                if queue and job["queue"] != queue:
                    continue
                out.append(dict(job))
                if limit and len(out) >= limit:
                    break
            return out

    def job(self, job_id: int) -> dict:
        self._check()
        if job_id not in self._jobs:
            raise BackendError(f"no job {job_id}", 404)
        return dict(self._jobs[job_id])

    def queues(self) -> list[dict]:
        self._check()
        with self._lock:
            out = []
            for i, name in enumerate(QUEUES):
                jobs = [j for j in self._jobs.values() if j["queue"] == name]
                out.append({
                    "name": name, "priority": [10, 50, 100][i], "state": "OPEN",
                    "pending": sum(1 for j in jobs if j["state"] in ("PENDING", "HELD")),
                    "running": sum(1 for j in jobs if j["state"] in LAUNCHED),
                    "gpus_used": sum(j["gpus"] * j["nodes"] for j in jobs if j["state"] in LAUNCHED),
                    "gpu_quota": [16, 32, None][i], "fair_share": [0.25, 0.5, 0.25][i],
                })
            return out

    def teams(self) -> list[dict]:
        """As the daemon's /v1/teams: the configured teams, any team an active job is charged to,
        and "default"; usage is the GPU-hours of the running jobs (no decay on a frozen clock)."""
        self._check()
        members = {u: name for name, t in TEAMS.items() for u in t["users"]}
        with self._lock:
            active = [j for j in self._jobs.values() if j["state"] in ACTIVE]
            team_of = {j["id"]: j.get("account") or members.get(j["user"], "default") for j in active}
            out = []
            for name in sorted(set(TEAMS) | set(team_of.values()) | {"default"}):
                quota = TEAMS.get(name)
                mine = [j for j in active if team_of[j["id"]] == name]
                running = [j for j in mine if j["state"] in LAUNCHED]
                out.append({
                    "name": name, "cohort": quota["cohort"] if quota else None,
                    "nominal_gpus": quota["nominal_gpus"] if quota else None,
                    "borrowing_limit_gpus": quota["borrowing_limit_gpus"] if quota else None,
                    "lending_limit_gpus": quota["lending_limit_gpus"] if quota else None,
                    "fairshare_shares": quota["fairshare_shares"] if quota else 1.0,
                    "users": list(quota["users"]) if quota else [],
                    "gpus_used": sum(j["gpus"] * j["nodes"] for j in running),
                    "running": len(running),
                    "pending": sum(1 for j in mine if j["state"] in ("PENDING", "HELD")),
                    "usage_gpu_hours": round(sum(
                        j["gpus"] * j["nodes"] * max(0.0, self.now - (j["start_time"] or self.now))
                        for j in running) / 3600, 3),
                })
            return out

    def events(self, since: int = 0, limit: int = 200) -> list[dict]:
        self._check()
        return [e for e in self._events if e["id"] > since][-limit:]

    def stream_events(self, since: int = 0) -> Iterator[dict]:
        self._check()
        q: queue.Queue = queue.Queue()
        self._listeners.append(q)
        try:
            yield from (e for e in self._events if e["id"] > since)
            while not self._closed.is_set():
                if not self.up:
                    raise BackendUnreachable("event stream closed")
                try:
                    yield q.get(timeout=0.1)
                except queue.Empty:
                    continue
        finally:
            self._listeners.remove(q)

    def log(self, job_id: int, offset: int = 0) -> tuple[str, int]:
        self._check()
        lines = self._logs.get(job_id)
        if lines is None:
            lines = [f"step {s:5d} loss {2.5 / (s + 1):.4f} job {job_id}" for s in range(40)]
            self._logs[job_id] = lines
        text = "".join(line + "\n" for line in lines)
        return text[offset:], len(text)

    def set_node(self, name: str, **fields) -> None:
        """Change what the cluster says of a node."""
        self._nodes[name].update(fields)

    def set_job(self, job_id: int, **fields) -> None:
        """Change what the cluster says of a job (as the daemon would after a change)."""
        self._jobs[job_id].update(fields)

    def append_log(self, job_id: int, line: str) -> None:
        self.log(job_id)
        self._logs[job_id].append(line)

    # -- actions ----------------------------------------------------------------------------

    def _refuse(self, what: str, allowed: tuple[str, ...]) -> None:
        self._check()
        if self.role not in allowed:
            raise BackendError(f"role {self.role!r} may not {what}; ask an operator or admin", 403)

    def _job_action(self, job_id: int, action: str, ok_from: tuple[str, ...], to: str,
                    reason: str | None = None) -> dict:
        self._refuse(f"{action} jobs", ("admin", "operator"))
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                raise BackendError(f"no job {job_id}", 404)
            current = "HELD" if _held(job) else job["state"]
            if current not in ok_from:
                raise BackendError(f"job {job_id} is {job['state']}; cannot {action} it", 409)
            job["state"], job["reason"] = to, reason
            if to in ("CANCELLED",):
                job["end_time"] = self.now
            if to == "PENDING":
                job["allocation"], job["start_time"] = [], None
            self._refresh_telemetry()
            self._event("root", f"job.{action}", f"job/{job_id}", {"state": to})
            return dict(job)

    def cancel(self, job_id: int) -> dict:
        return self._job_action(job_id, "cancel", ACTIVE, "CANCELLED")

    def hold(self, job_id: int) -> dict:
        if self.slurm_states:
            return self._job_action(job_id, "hold", ("PENDING",), "PENDING", "JobHeldUser")
        return self._job_action(job_id, "hold", ("PENDING",), "HELD", "Held")

    def release(self, job_id: int) -> dict:
        return self._job_action(job_id, "release", ("HELD",), "PENDING", "Priority")

    def requeue(self, job_id: int) -> dict:
        return self._job_action(job_id, "requeue", ("RUNNING", "FAILED", "OUT_OF_MEMORY", "PREEMPTED", "NODE_FAIL"),
                                "PENDING", "Priority")

    def set_priority(self, job_id: int, priority: int) -> dict:
        self._refuse("change priorities", ("admin", "operator"))
        with self._lock:
            self._jobs[job_id]["priority"] = priority
            self._event("root", "job.priority", f"job/{job_id}", {"priority": priority})
            return dict(self._jobs[job_id])

    def submit(self, spec: dict) -> dict:
        self._check()
        if not spec.get("command") and not spec.get("script"):
            raise BackendError("a job needs a command or a script", 422)
        with self._lock:
            job_id = max(self._jobs, default=0) + 1
            job = {
                "id": job_id, "name": spec.get("name") or f"job-{job_id}", "user": self.me()["user"],
                "queue": spec.get("queue") or "default", "state": "HELD" if spec.get("hold") else "PENDING",
                "reason": "Held" if spec.get("hold") else "Priority", "gpus": spec.get("gpus") or 0,
                "nodes": spec.get("nodes") or 1, "cpus": spec.get("cpus") or 1, "mem": spec.get("mem"),
                "priority": spec.get("priority") or 100, "submit_time": self.now, "start_time": None,
                "end_time": None, "exit_code": None, "allocation": [], "command": spec.get("command"),
                "time_limit": spec.get("time_limit"), "estimated_start": None,
                "account": spec.get("account"),
            }
            self._jobs[job_id] = job
            self._event(job["user"], "job.submit", f"job/{job_id}", {"name": job["name"]})
            return dict(job)

    def drain_node(self, name: str, reason: str) -> dict:
        self._refuse("drain nodes", ("admin", "operator"))
        with self._lock:
            node = self._nodes[name]
            node["state"] = "DRAINING" if node["gpus_used"] else "DRAINED"
            node["reason"] = reason
            self._event("root", "node.drain", f"node/{name}", {"reason": reason})
            return dict(node)

    def resume_node(self, name: str) -> dict:
        self._refuse("resume nodes", ("admin", "operator"))
        with self._lock:
            node = self._nodes[name]
            node["state"], node["reason"] = "UP", None
            self._event("root", "node.resume", f"node/{name}", {})
            return dict(node)

    def close(self) -> None:
        self._closed.set()


def _held(job: dict) -> bool:
    return job["state"] == "HELD" or str(job.get("reason") or "").startswith("JobHeld")


def _slurm_words(job: dict, j: int) -> dict:
    """The same job as a daemon speaking Slurm's words would report it."""
    if job["state"] == "HELD":
        return {"state": "PENDING", "reason": "JobHeldAdmin" if j % 16 == 3 else "JobHeldUser"}
    if job["state"] == "RUNNING" and j % 8 == 6:
        return {"state": "CONFIGURING"}
    if job["state"] == "FAILED":
        return {"state": "OUT_OF_MEMORY"}
    return {}


def main() -> None:
    """`python -m tests.tui.fake_backend [NODES] [JOBS]`: the TUI on an in-memory cluster."""
    import sys
    import threading as _threading

    from tui.app import TrainyardApp

    nodes = int(sys.argv[1]) if len(sys.argv) > 1 else 8
    jobs = int(sys.argv[2]) if len(sys.argv) > 2 else 40
    backend = FakeBackend(nodes=nodes, jobs=jobs, now=time.time())
    stop = _threading.Event()

    def tick() -> None:
        while not stop.wait(2.0):
            backend.advance(2.0)

    _threading.Thread(target=tick, daemon=True).start()
    try:
        TrainyardApp(backend, readonly="--readonly" in sys.argv).run()
    finally:
        stop.set()


if __name__ == "__main__":
    main()
