"""Job lifecycle: signals, rank ends, final states, requeues, time limits and lost nodes."""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from types import SimpleNamespace

from sqlalchemy import bindparam, case, func, or_
from sqlalchemy import select as sa_select
from sqlmodel import Session, col, select

from .. import models as m
from ..models import Job, Node
from ..planner import PolicyConfig, UsageLedger
from .clock import Clock
from .links import NodeLinks
from .state import StateStore, TableCache


def job_key(job: Job) -> str:
    """The agent's name for one attempt of a job: `<id>.<attempt>`."""
    return f"{job.id}.{job.attempt}"


def parse_key(key: str) -> tuple[int, int]:
    a, _, b = str(key).partition(".")
    return int(a), int(b or 0)


def runs_batch_step(job: Job) -> bool:
    """Slurm's model on the nodes: the script runs once, on the first node, the other nodes hold
    the allocation, and `srun` starts tasks on all of them (docs/slurm.md). Container jobs run
    their script on every node instead (the image has no srun that could reach the others)."""
    return bool(job.batch_step) and not job.image and len(job.allocation) > 1


# a batch job's script ended: the ranks that hold the rest of its allocation are released
BATCH_END = "batch_end"


# signals a job may ask for ahead of its end: those the agent delivers, but never KILL
ADVANCE_SIGNALS = {"TERM": 15, "INT": 2, "USR1": 10, "HUP": 1}
DEFAULT_SIGNAL_S = 60  # Slurm's default when --signal names no time


@dataclass(frozen=True)
class SignalSpec:
    """Slurm's --signal=[{R|B}:]SIG[@SECONDS]: SIG that many seconds before the time limit."""

    sig: str
    seconds: int = DEFAULT_SIGNAL_S
    batch_only: bool = False  # B: Slurm signals only the batch shell; here the whole job gets it

    @classmethod
    def parse(cls, text: str) -> SignalSpec:
        """ValueError says what is wrong with the value and what is accepted."""
        raw = str(text).strip()
        spec, batch = raw, False
        if spec[:2].upper() in ("B:", "R:"):
            batch, spec = spec[0].upper() == "B", spec[2:]
        sig, _, secs = spec.partition("@")
        name = sig.strip().upper().removeprefix("SIG")
        if name.isdigit():
            name = next((k for k, v in ADVANCE_SIGNALS.items() if v == int(name)), name)
        if name not in ADVANCE_SIGNALS:
            raise ValueError(f"signal {raw!r}: unknown signal {sig!r}; use one of "
                             f"{', '.join(ADVANCE_SIGNALS)} (by name or number), e.g. USR1@120")
        if secs and not (secs.isdigit() and 0 <= int(secs) <= 65535):
            raise ValueError(f"signal {raw!r}: {secs!r} is not a number of seconds (0-65535)")
        return cls(name, int(secs) if secs else DEFAULT_SIGNAL_S, batch)


def signal_spec(job: Job) -> SignalSpec | None:
    try:
        return SignalSpec.parse(job.signal) if job.signal else None
    except ValueError:  # refused at submit; a stored bad value never stops housekeeping
        return None


@dataclass(frozen=True)
class RankExit:
    rc: int | None
    lost: bool = False
    oom: bool = False


class Deadlines:
    """When each active job next needs the housekeeping tick: its time limit, the --signal that
    comes before it, or the end of a kill's grace period (SIGKILL). Kept in a heap between ticks
    and updated from the jobs that committed transactions changed (StateStore), so a tick costs
    O(jobs changed + jobs due), not O(active jobs). Read in full every FULL_READ_S and after
    `forget` (taking office), as the scheduling cycle's rows are. A job whose deadline came is
    looked at again at the next tick whatever was done to it, so none is dropped."""

    FULL_READ_S = 300.0

    def __init__(self, store: StateStore):
        self.store = store
        self.heap: list[tuple[float, int]] = []
        self.when: dict[int, float] = {}  # job id -> its deadline in the heap (others are stale)
        self.again: set[int] = set()  # due at the last tick: read again at this one
        self.full_at = -math.inf

    def forget(self) -> None:
        self.full_at = -math.inf

    @staticmethod
    def _query():
        """(id, deadline, signal, signal_time, kill_reason) of active jobs; the deadline without
        --signal, worked out by the database: the end of a kill's grace (the daemon's grace
        period bound as `grace`), else the time limit. Every active job's, and those of `ids`:
        built once (a statement built per call cost more than running it)."""
        t = Job.__table__.c
        deadline = case((t.kill_reason != "", t.kill_time + func.coalesce(t.kill_grace_s, bindparam("grace"))),
                        (t.time_limit_s > 0, t.start_time + t.time_limit_s), else_=None)
        every = sa_select(t.id, deadline, t.signal, t.signal_time, t.kill_reason).where(
            t.state.in_(m.ACTIVE_STATES))
        return every, every.where(t.id.in_(bindparam("ids", expanding=True)))

    def _deadlines(self, s: Session, ids: set[int] | None, kill_grace_s: float) -> dict[int, float]:
        (every, of_ids), run = _DEADLINE_READS, s.connection().execute
        if ids is None:
            rows = run(every, {"grace": kill_grace_s}).all()
        else:
            rows, ids = [], list(ids)
            for i in range(0, len(ids), 500):
                rows += run(of_ids, {"grace": kill_grace_s, "ids": ids[i:i + 500]}).all()
        out = {}
        for jid, d, sig, signal_time, kill_reason in rows:
            if d is None:
                continue
            if sig and signal_time is None and not kill_reason:  # --signal comes before the limit
                spec = signal_spec(SimpleNamespace(signal=sig))
                if spec is not None:
                    d -= spec.seconds
            out[jid] = d
        return out

    def due(self, s: Session, now: float, kill_grace_s: float) -> list[int]:
        """The ids of the jobs whose deadline is `now` or earlier (a superset of those due)."""
        changed = self.store.take_deadline_changes() | self.again
        if now >= self.full_at:
            self.full_at = now + self.FULL_READ_S
            self.when = self._deadlines(s, None, kill_grace_s)
            self.heap = [(d, jid) for jid, d in self.when.items()]
            heapq.heapify(self.heap)
        elif changed:
            when, heap = self.when, self.heap
            fresh = self._deadlines(s, changed, kill_grace_s)
            for jid in changed:  # gone, ended, or no deadline any more: nothing to look at
                d = fresh.get(jid)
                if d is None:
                    when.pop(jid, None)
                elif when.get(jid) != d:
                    when[jid] = d
                    heapq.heappush(heap, (d, jid))
        when, heap = self.when, self.heap
        out = []
        while heap and heap[0][0] <= now:
            d, jid = heapq.heappop(heap)
            if when.get(jid) == d:
                del when[jid]
                out.append(jid)
        if len(heap) > 2 * len(when) + 1000:  # stale entries: keep the heap the size of the work
            self.heap = [(d, jid) for jid, d in when.items()]
            heapq.heapify(self.heap)
        self.again = set(out)
        return out


_DEADLINE_READS = Deadlines._query()


class JobLifecycle:
    """Ends jobs: decides each final state in Slurm's words, requeues where allowed, frees nodes."""

    def __init__(self, store: StateStore, links: NodeLinks, clock: Clock, policy: PolicyConfig,
                 ledger: UsageLedger, kill_grace_s: float, wake):
        self.store = store
        self.links = links
        self.clock = clock
        self.policy = policy
        self.ledger = ledger
        self.kill_grace_s = kill_grace_s
        self.wake = wake
        self.rank_exits: dict[int, dict[str, RankExit]] = {}
        self.deadlines = Deadlines(store)
        self._draining_names: TableCache[frozenset[str]] = TableCache(store, "node")  # DRAINING nodes

    def forget_cached(self) -> None:
        """On taking office: another daemon may have changed jobs meanwhile (the node caches
        follow StateStore.forget_cached)."""
        self.deadlines.forget()

    # ---------------------------------------------------------------- queries
    def active_jobs_on(self, s: Session, node: str) -> list[Job]:
        ids = self.store.active.on(node)
        if not ids:
            return []
        return [j for j in self.store.load_jobs(s, ids).values() if j.state in m.ACTIVE_STATES]

    # ---------------------------------------------------------------- signals
    def signal(self, s: Session, job: Job, sig: str, skip: frozenset[str] | set[str] = frozenset()) -> None:
        """Signal the job's ranks (but those on `skip`) once `s` has committed (write-ahead)."""
        msg = {"op": "signal", "key": job_key(job), "sig": sig}
        self.send_after(s, [a["node"] for a in job.allocation if a["node"] not in skip], msg)

    def send_after(self, s: Session, nodes: list[str], msg: dict) -> None:
        """Send `msg` to the agents of `nodes` once `s` has committed, never before: a daemon
        that dies in between has told no agent what its database does not say (it would end
        a job whose end it never recorded)."""
        if nodes:
            self.store.after_commit(s, lambda: [self.links.send(n, msg) for n in nodes])

    def forget_after(self, s: Session, nodes: list[str], key: str) -> None:
        """Tell the agents of `nodes` to forget the ended job `key` once `s` has committed (see
        `send_after`). The ends one transaction records reach each node as one `forget` with
        all their keys."""
        if not nodes:
            return
        keys = s.info.get("forget")
        if keys is None:
            keys = s.info["forget"] = {}
            self.store.after_commit(s, lambda: [
                self.links.send(n, {"op": "forget", "keys": ks}) for n, ks in keys.items()])
        for n in nodes:
            keys.setdefault(n, []).append(key)

    def kill(self, s: Session, job: Job, why: str) -> None:
        """Ask a running job to stop: SIGTERM now, SIGKILL after the grace period.

        A preempted job that asked for --signal gets that signal instead of SIGTERM at the start
        of its grace period, so it can checkpoint; SIGKILL still ends the period."""
        if job.kill_reason == BATCH_END or (job.kill_reason in ("cancel", "timeout") and why != "cancel"):
            return  # the script's end (or the first cancel or time limit) decides the end state
        if why != "preempt":
            job.kill_grace_s = None
        job.kill_reason, job.kill_time = why, self.clock.time()
        s.add(job)
        if why == "preempt":  # TRAINYARD_PREEMPT_DEADLINE_FILE says when SIGKILL comes
            grace = self.kill_grace_s if job.kill_grace_s is None else job.kill_grace_s
            self.send_after(s, [a["node"] for a in job.allocation],
                            {"op": "notice", "key": job_key(job), "deadline": job.kill_time + grace})
        spec = signal_spec(job) if why == "preempt" else None
        if spec is not None:
            grace = self.kill_grace_s if job.kill_grace_s is None else job.kill_grace_s
            self.signal(s, job, spec.sig)
            self.store.record(s, "trainyard", "job.signal", str(job.id),
                              {"sig": spec.sig, "why": "preemption", "deadline": job.kill_time + grace})
            return
        self.signal(s, job, "TERM")

    # ---------------------------------------------------------------- ends
    def rank_ended(self, s: Session, job: Job, node: str, end: RankExit,
                   end_time: float | None = None) -> None:
        exits = self.rank_exits.setdefault(job.id, {})
        exits[node] = end
        ranks = [a["node"] for a in job.allocation]
        if len(exits) < len(ranks) and node == ranks[0] and runs_batch_step(job):
            # the batch script is the job: its end releases the nodes that held the allocation
            if not job.kill_reason:
                job.kill_reason, job.kill_time = BATCH_END, self.clock.time()
                s.add(job)
            self.signal(s, job, "TERM", skip=set(exits))
            return
        if len(exits) < len(ranks):
            # one rank of a gang ended early: a failure ends the whole job
            if (end.lost or end.oom or end.rc != 0) and not job.kill_reason:
                job.kill_reason, job.kill_time = "rank_failed", self.clock.time()
                s.add(job)
                self.signal(s, job, "TERM", skip=set(exits))
            return
        self.finish(s, job, exits, end_time)

    def fail_launch(self, s: Session, job: Job, node: str, reason: str) -> None:
        """A rank could not start (no such account, a refused user): the job FAILS, saying why."""
        job.reason = f"launch failed on {node}: {reason}"[:500]
        job.kill_reason = "launch_failed"
        self.store.record(s, "trainyard", "job.launch_failed", str(job.id), {"node": node, "reason": reason})
        self.rank_ended(s, job, node, RankExit(None))

    def fail_on_node(self, s: Session, job: Job, node: str, why: str) -> None:
        """The daemon gives up on a node: the job ends NODE_FAIL (requeued if retries allow)."""
        job.kill_reason, job.reason = "node_fail", why
        self.signal(s, job, "KILL", skip={node})
        # the ranks elsewhere were killed, not lost: only `node` is excluded from the rerun
        self.finish(s, job, {a["node"]: RankExit(None, lost=a["node"] == node) for a in job.allocation})

    def finish(self, s: Session, job: Job, exits: dict[str, RankExit], end_time: float | None = None) -> None:
        """All ranks have ended: decide the final state, requeue where allowed, free the nodes."""
        self.rank_exits.pop(job.id, None)
        key = job_key(job)
        nodes = [a["node"] for a in job.allocation]
        order = {n: i for i, n in enumerate(nodes)}
        ranked = sorted(exits.items(), key=lambda kv: order.get(kv[0], 0))
        codes = [e.rc for _, e in ranked]
        if runs_batch_step(job) and nodes and nodes[0] in exits:
            codes = [exits[nodes[0]].rc]  # the holders' ends say nothing: the script's is the job's
        lost = [n for n, e in ranked if e.lost]
        oom = [n for n, e in ranked if e.oom]
        failed_rc = next((rc for rc in codes if rc not in (0, None)), None)
        job.end_time = end_time or self.clock.time()
        if job.start_time:
            gpus = job.gpus * len(nodes)
            job.attained_gpu_s += gpus * max(0.0, job.end_time - job.start_time)
            self.ledger.charge_run(job.user, self.policy.team_of(job), gpus, job.start_time, job.end_time)
        job.exit_code = failed_rc if failed_rc is not None else (codes[0] if codes else None)
        state, reason = self._final_state(job, lost, oom, failed_rc)
        self.forget_after(s, nodes, key)
        if state == "REQUEUE":
            self.requeue(s, job, "requeued by request")
        elif state == m.PREEMPTED:
            self.store.set_state(s, job, m.PREEMPTED, job.reason, exit_code=job.exit_code)
            job.preemptions = (job.preemptions or 0) + 1
            self.requeue(s, job, "requeued after preemption")
        elif state in (m.FAILED, m.NODE_FAIL, m.OUT_OF_MEMORY) and job.failures < job.retries:
            self.store.set_state(s, job, state, reason, exit_code=job.exit_code)
            job.failures += 1
            why = f"retry {job.failures} of {job.retries} after {state}"
            if state == m.NODE_FAIL and lost:  # rerun on the healthy nodes plus a replacement
                job.exclude = sorted(set(job.exclude or ()) | set(lost))
                why += f", excluding {', '.join(lost)}"
            self.requeue(s, job, why)
        else:
            self.store.set_state(s, job, state, reason, exit_code=job.exit_code)
            job.kill_reason = ""
            s.add(job)
        self.settle_drains(s, nodes, exclude=job.id)
        self.wake()

    def _final_state(self, job: Job, lost: list[str], oom: list[str], failed_rc) -> tuple[str, str]:
        why = job.kill_reason
        if why == "node_fail":  # the daemon gave up on the node (down, removed)
            return m.NODE_FAIL, job.reason or "node down"
        if why == "cancel":
            return m.CANCELLED, job.reason if job.reason.startswith("cancelled") else ""
        if why == "timeout":
            return m.TIMEOUT, f"time limit {job.time_limit_s}s reached"
        if why == "preempt":
            return m.PREEMPTED, ""
        if why == "requeue":
            return "REQUEUE", ""
        if why == "launch_failed":
            return m.FAILED, job.reason
        if why == BATCH_END:  # the holders were released after the script ended: their ends
            first = job.allocation[0]["node"] if job.allocation else ""  # lost later do not count
            lost = [n for n in lost if n == first]
        if oom:
            return m.OUT_OF_MEMORY, f"memory limit of {job.mem_mb} MiB exceeded on {', '.join(oom)}"
        if lost:
            return m.NODE_FAIL, f"lost on {', '.join(lost)}"
        if failed_rc is None:
            return m.COMPLETED, ""
        return m.FAILED, f"exit code {failed_rc}"

    def requeue(self, s: Session, job: Job, why: str) -> None:
        job.attempt += 1
        job.allocation = []
        job.start_time = None
        job.end_time = None
        job.kill_reason = ""
        job.kill_time = None
        job.signal_time = None
        job.exit_code = None
        job.eligible_time = self.clock.time()
        self.store.set_state(s, job, m.PENDING, why)

    # ---------------------------------------------------------------- nodes
    def drain(self, s: Session, node: Node, reason: str, actor: str, address: str = "") -> None:
        """Stop new work on a node: DRAINING while jobs run there, DRAINED once none do."""
        node.state = m.DRAINING if self.store.active.on(node.name) else m.DRAINED
        node.reason = reason
        s.add(node)
        self.store.record(s, actor, "node.drain", node.name, {"state": node.state, "reason": reason}, address)

    def settle_drains(self, s: Session, nodes: list[str], exclude: int | None = None) -> None:
        """DRAINING nodes that no active job holds any more become DRAINED."""
        if not nodes:
            return
        for name in self._draining(s, nodes):
            if self.store.active.on(name) - {exclude}:
                continue
            node = s.get(Node, name)
            node.state = m.DRAINED
            s.add(node)
            self.store.record(s, "trainyard", "node.state", name, {"state": m.DRAINED, "reason": node.reason})

    def _draining(self, s: Session, nodes: list[str]) -> list[str]:
        """Which of `nodes` are DRAINING. On every job end: from the names of the draining nodes
        kept per committed node version (one query when a node changed, none otherwise), or from
        the database when this transaction itself wrote a node."""
        if "node" in s.info.get("tables_touched", ()) or any(isinstance(o, Node) for o in s.dirty | s.new):
            return list(s.exec(select(Node.name).where(col(Node.name).in_(nodes), Node.state == m.DRAINING)).all())
        draining = self._draining_names.get(
            lambda: frozenset(s.exec(select(Node.name).where(Node.state == m.DRAINING)).all()))
        return [n for n in nodes if n in draining] if draining else []

    # ---------------------------------------------------------------- housekeeping
    def enforce_limits(self, s: Session, now: float) -> None:
        """SIGKILL what outlived its grace period; stop what reached its time limit."""
        ids = self.deadlines.due(s, now, self.kill_grace_s)
        if not ids:
            return
        t = Job.__table__.c
        # of the jobs whose deadline came, those still due by their committed rows
        grace = func.coalesce(t.kill_grace_s, self.kill_grace_s)
        waiting = (t.kill_reason == "") & t.start_time.is_not(None) & t.time_limit_s.is_not(None)
        due: list[Job] = []
        for i in range(0, len(ids), 500):
            due += s.exec(select(Job).where(col(Job.id).in_(ids[i:i + 500]), col(Job.state).in_(m.ACTIVE_STATES), or_(
                (t.kill_reason != "") & (t.kill_time + grace < now),
                waiting & (t.start_time + t.time_limit_s < now),
                waiting & t.signal_time.is_(None) & (t.signal != "")))).all()
        for job in due:
            grace = self.kill_grace_s if job.kill_grace_s is None else job.kill_grace_s
            if job.kill_reason and job.kill_time and now - job.kill_time > grace:
                job.kill_time = now  # SIGKILL again each grace period until it is gone
                s.add(job)
                self.signal(s, job, "KILL")
            elif (not job.kill_reason and job.time_limit_s and job.start_time
                  and now - job.start_time > job.time_limit_s):
                self.kill(s, job, "timeout")
                self.store.record(s, "trainyard", "job.timeout", str(job.id), {"limit_s": job.time_limit_s})
            elif not job.kill_reason and job.time_limit_s and job.start_time and job.signal_time is None:
                self._advance_signal(s, job, now)

    def _advance_signal(self, s: Session, job: Job, now: float) -> None:
        """--signal: SIG once per attempt, SECONDS before the time limit."""
        spec = signal_spec(job)
        deadline = job.start_time + job.time_limit_s
        if spec is None or now < deadline - spec.seconds:
            return
        job.signal_time = now
        s.add(job)
        self.signal(s, job, spec.sig)
        self.store.record(s, "trainyard", "job.signal", str(job.id),
                          {"sig": spec.sig, "why": "time limit", "deadline": deadline})
