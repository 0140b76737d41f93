"""Jobs as users see them: submit, list, show, change, hold/release/cancel/requeue, read logs."""

from __future__ import annotations

import asyncio
import os
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

from sqlalchemy import case, insert, literal, union_all, update
from sqlalchemy import select as sa_select
from sqlmodel import Session, select

from .. import models as m
from ..models import Job, Node, Queue
from ..planner import PolicyConfig, depends_on, parse_array
from ..store import row_objects
from .caller import Caller
from .clock import Clock
from .errors import Conflict, DomainError, Forbidden, NotFound
from .lifecycle import JobLifecycle, signal_spec
from .links import NodeLinks
from .prediction import prediction_json
from .state import StateStore, TableCache, jobs_and_tasks
from .views import LISTED_COLUMNS, job_json

ACTIONS = ("cancel", "hold", "release", "requeue")
# built once (see scheduling.py's statements): one job, or a group's jobs with their ids in order
_JOB_INSERT = insert(Job.__table__)
_JOB_INSERT_IDS = insert(Job.__table__).returning(Job.__table__.c.id, sort_by_parameter_order=True)


@dataclass
class JobRequest:
    """A validated submission (the API's body, already parsed into plain values)."""

    command: list[str] | None = None
    script: str | None = None
    name: str | None = None
    queue: str = "default"
    gpus: int = 0
    gpu_type: str | None = None
    nodes: int = 1
    cpus: int = 1
    mem_mb: int | None = None
    time_limit_s: int | None = None
    priority: int = 0
    retries: int = 0
    dependency: str | None = None
    array: str | None = None
    constraint: dict[str, str] = field(default_factory=dict)
    exclusive: bool = False
    nice: int = 0
    account: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    workdir: str | None = None
    hold: bool = False
    slurm: dict[str, Any] = field(default_factory=dict)  # Slurm's batch options (Job columns)


# Slurm's batch options stored as they come (API field -> Job column)
SLURM_FIELDS = {
    "ntasks": "ntasks", "ntasks_per_node": "ntasks_per_node", "cpus_per_task": "cpus_per_task",
    "gpus_per_task": "gpus_per_task", "features": "features", "nodelist": "nodelist",
    "exclude": "exclude", "output": "output", "error": "error", "input": "input",
    "open_mode": "open_mode", "batch_step": "batch_step", "submit_dir": "submit_dir", "submit_host": "submit_host",
    "signal": "signal", "requeue": "requeue", "begin": "begin_time", "qos": "qos",
    "comment": "comment", "wckey": "wckey", "reservation": "reservation", "mail_type": "mail_type",
    "mail_user": "mail_user", "notify_url": "notify_url", "export": "export", "recorded": "recorded",
    "idle_opt_out": "idle_opt_out", "image": "image", "container_mounts": "container_mounts",
    "container_workdir": "container_workdir",
}


def _default(column: str):
    f = Job.model_fields[column]
    return f.default_factory() if f.default_factory is not None else f.default


SLURM_DEFAULTS = {c: _default(c) for c in SLURM_FIELDS.values()}


@dataclass(frozen=True)
class JobFilter:
    all: bool = False
    states: frozenset[str] = frozenset()
    user: str | None = None
    queue: str | None = None
    limit: int = 5000
    ids: frozenset[int] = frozenset()  # these jobs and the tasks of these arrays, in any state


def _limit_text(seconds: int | None) -> str:
    return "UNLIMITED" if seconds is None else f"{seconds}s"


# a listing's columns (LISTED_COLUMNS): a page of 2,000 jobs read every column, the scripts'
# text included, to show 55 of 78 and whether each job has a script
_LISTED = (*(Job.__table__.c[name] for name in LISTED_COLUMNS),
           case((Job.__table__.c.script.is_not(None), literal(True))).label("script"))


def list_jobs(engine, caller: Caller, f: JobFilter, uses_predictions: bool) -> list[dict[str, Any]]:
    """`GET /v1/jobs`' page as `caller` sees it: a read of committed rows and nothing else, so
    it runs in the daemon (read threads) or in a reader process (scheduler.daemon.readers)."""
    with engine.connect() as conn:
        rows = row_objects(conn.execute(listing_query(f)))
    return [{**job_json(j, caller), **prediction_json(j, uses_predictions)} for j in rows]


def listing_query(f: JobFilter):
    """`GET /v1/jobs`: plain rows (a listing of thousands need not build ORM objects), in id
    order (newest first with `all`), at most `f.limit`. A page of a state reads that state's
    part of the (state, id) index in id order, and a page of several states is made of one such
    read per state, so it costs the page, not every job of those states ever run (1.5 s at
    400,000 COMPLETED jobs when they were all sorted): a planner without statistics does not
    see that one `state IN (...)` over two indexes on state is better read per state."""
    t = Job.__table__.c
    order = t.id.desc() if f.all else t.id
    where = [t.user == f.user] if f.user else []
    if f.queue:
        where.append(t.queue == f.queue)
    if f.ids:
        where.append(jobs_and_tasks(f.ids))
        if f.states:
            where.append(t.state.in_(sorted(f.states)))
    elif len(f.states) > 1:
        arms = [sa_select(t.id).where(t.state == st, *where).order_by(order).limit(f.limit).subquery()
                for st in sorted(f.states)]
        where = [t.id.in_(union_all(*(sa_select(a.c.id) for a in arms)))]
    elif f.states:
        where.append(t.state == next(iter(f.states)))
    elif not f.all:
        where.append(t.state.in_(sorted(m.ACTIVE_STATES | m.WAITING_STATES)))
    return sa_select(*_LISTED).where(*where).order_by(order).limit(f.limit)


class JobService:
    def __init__(self, store: StateStore, lifecycle: JobLifecycle, links: NodeLinks, clock: Clock,
                 policy: PolicyConfig, wake, submitted=lambda queue, n: None,
                 aliases: dict[str, str] | None = None, predict=None):
        self.submitted = submitted
        # submit values -> the prediction columns (RunTimePrediction.columns); None: no prediction
        self.predict = predict
        self.aliases = dict(aliases or {})  # partition name -> queue ([queues.X] aliases)
        self.store = store
        self.lifecycle = lifecycle
        self.links = links
        self.clock = clock
        self.policy = policy
        self.wake = wake
        self._group: list[tuple[Caller, JobRequest, asyncio.Future]] = []  # submit_grouped's
        # what every submission checks against, kept until a transaction writes a queue or a
        # node (or the daemon takes office): the queues' rows by name; GPUs per node, and the
        # largest node's (GPUs, name)
        self._queues: TableCache[dict] = TableCache(store, "queue")
        self._sizes: TableCache[tuple[list[int], tuple | None]] = TableCache(store, "node")

    # ---------------------------------------------------------------- reads
    def get(self, caller: Caller, job_id: int) -> dict[str, Any]:
        with self.store.read() as s:
            job = self._job(s, job_id)
            return {**job_json(job, caller), **prediction_json(job, self.policy.backfill_on_prediction)}

    def list(self, caller: Caller, f: JobFilter) -> list[dict[str, Any]]:
        return list_jobs(self.store.engine, caller, f, self.policy.backfill_on_prediction)

    @staticmethod
    def _job(s: Session, job_id: int) -> Job:
        job = s.get(Job, job_id)
        if job is None:
            raise NotFound(f"job {job_id} does not exist", "job_id")
        return job

    # ---------------------------------------------------------------- submit
    def submit(self, caller: Caller, req: JobRequest) -> dict[str, Any]:
        """Submit one job (or one array), in a transaction of its own."""
        with self.store.tx() as s:
            job, tasks = self._submit_in(s, caller, req)
        return self._submitted(caller, req, job, tasks)

    async def submit_grouped(self, caller: Caller, req: JobRequest) -> dict[str, Any]:
        """`submit`, with the submissions that arrive in the same turn of the event loop checked
        and stored in one transaction (group commit): under many concurrent clients a commit
        per job is what limits the rate. Each is still checked in the transaction that stores
        it, and one refused submission does not affect the others of its group."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._group.append((caller, req, fut))
        if len(self._group) == 1:
            loop.call_soon(self._commit_group)
        return await fut

    def _commit_group(self) -> None:
        group, self._group = self._group, []
        done = []
        try:
            with self.store.tx() as s:
                batch: list = []  # checked single jobs, inserted together (in order)
                for caller, req, fut in group:
                    try:  # a refusal is raised before the job wrote anything: the others go on
                        if req.array:  # its tasks need its id: after the jobs before it
                            done += self._insert_batch(s, batch)
                            batch = []
                            done.append((fut, caller, req, self._submit_in(s, caller, req)))
                        else:
                            batch.append((fut, caller, req, self._checked(s, caller, req)[0]))
                    except DomainError as e:
                        done.append((fut, caller, req, e))
                done += self._insert_batch(s, batch)
        except Exception as e:  # the commit failed: none of the group is stored
            for _, _, fut in group:
                if not fut.done():
                    fut.set_exception(e)
            return
        for fut, caller, req, result in done:
            if fut.done():  # its client went away
                continue
            if isinstance(result, Exception):
                fut.set_exception(result)
            else:
                fut.set_result(self._submitted(caller, req, *result))

    def _submitted(self, caller: Caller, req: JobRequest, job, tasks: int) -> dict[str, Any]:
        self.submitted(job.queue, tasks)
        if not req.hold:
            self.wake()
        return {**job_json(job, caller), **prediction_json(job, self.policy.backfill_on_prediction)}

    def _insert_batch(self, s: Session, batch: list) -> list:
        """Insert checked single jobs (fut, caller, req, values) in one statement, in order; their
        (fut, caller, req, (job, 1)). A group's jobs went in a statement each before, and those
        statements were most of what a submission cost under many clients."""
        if not batch:
            return []
        columns = batch[0][3].keys()
        if len(batch) == 1 or any(values.keys() != columns for *_, values in batch):
            # (one statement needs the same columns in every row: they are, as built today)
            ids = [s.execute(_JOB_INSERT, values).inserted_primary_key[0] for *_, values in batch]
        else:
            ids = s.execute(_JOB_INSERT_IDS, [values for *_, values in batch]).scalars().all()
        return [(fut, caller, req, (self._stored(s, caller, jid, values, None), 1))
                for (fut, caller, req, values), jid in zip(batch, ids, strict=True)]

    def _submit_in(self, s: Session, caller: Caller, req: JobRequest) -> tuple[SimpleNamespace, int]:
        """Check and store one submission in `s`; (the job as stored, its number of tasks)."""
        values, tasks = self._checked(s, caller, req)
        table = Job.__table__
        first = s.execute(_JOB_INSERT, values).inserted_primary_key[0]
        if req.array:
            values["array_parent"] = first
            s.execute(update(table).where(table.c.id == first).values(array_parent=first))
            if len(tasks) > 1:
                s.execute(insert(table), [{**values, "array_task_id": t} for t in tasks[1:]])
        return self._stored(s, caller, first, values, len(tasks) if req.array else None), len(tasks)

    def _stored(self, s: Session, caller: Caller, first: int, values: dict[str, Any],
                tasks: int | None) -> SimpleNamespace:
        """The job as stored with id `first`, its `job.submit` event recorded in `s`."""
        job = SimpleNamespace(id=first, start_time=None, end_time=None, exit_code=None,
                              estimated_start=None, **values)
        self.store.record(s, caller.user, "job.submit", str(first),
                          {"queue": job.queue, "gpus": job.gpus, "nodes": job.nodes, "state": job.state,
                           "tasks": tasks}, caller.address)
        return job

    def _checked(self, s: Session, caller: Caller, req: JobRequest) -> tuple[dict[str, Any], tuple]:
        """Check one submission and build its row (DomainError when it is refused); with its
        array's task ids ((None,) for a single job)."""
        if req.priority > 0 and not caller.at_least("operator"):
            raise Forbidden(f"a positive --priority needs the operator role; {caller.user} is {caller.role}")
        if req.nice < 0 and not caller.at_least("operator"):
            raise Forbidden(f"a negative --nice needs the operator role; {caller.user} is {caller.role}")
        self._check_account(caller, req.account)
        now = self.clock.time()
        queue = self._queue(s, req.queue)
        self._check_fits(s, req)
        self._check_nodes(s, req)
        if req.time_limit_s == "UNLIMITED":  # Slurm: the partition's maximum, if it has one
            limit = queue.max_time_limit_s
        else:
            limit = req.time_limit_s or queue.default_time_limit_s or self.policy.default_time_limit_s
        limit = int(limit) if limit else None
        if queue.max_time_limit_s and limit and limit > queue.max_time_limit_s:
            raise Conflict(f"time_limit: {limit}s is over queue {queue.name!r}'s maximum of "
                           f"{queue.max_time_limit_s}s", "time_limit")
        for dep in depends_on(req.dependency or ""):
            if s.get(Job, dep) is None:
                raise NotFound(f"after: job {dep} does not exist", "after")
        name = req.name or (os.path.basename(req.command[0]) if req.command else "script")
        tasks, limit_tasks = parse_array(req.array) if req.array else ((None,), None)
        hold = m.HOLD_USER  # sbatch --hold is the submitter's own hold, as in Slurm
        # Core inserts: submission is the API's hot path, and ORM objects cost more than rows
        values = dict(
            name=name, user=caller.user, queue=queue.name, state=m.PENDING,
            held=hold if req.hold else "", reason=m.HOLD_REASONS[hold] if req.hold else "",
            command=req.command, script=req.script, gpus=req.gpus, gpu_type=req.gpu_type,
            nodes=req.nodes, cpus=req.cpus, mem_mb=req.mem_mb or 0, time_limit_s=limit,
            priority=req.priority, retries=req.retries, attempt=0, failures=0,
            dependency=req.dependency or "", env=req.env, workdir=req.workdir, submit_time=now,
            eligible_time=now, constraint=req.constraint or {}, exclusive=req.exclusive,
            nice=req.nice, account=req.account or "", allocation=[], kill_reason="",
            attained_gpu_s=0.0, preemptions=0, array_task_id=tasks[0], array_parent=None,
            array_limit=limit_tasks if req.array else None, array_spec=req.array or "",
        )
        values.update(SLURM_DEFAULTS, image_digest="")
        if self.predict is not None:
            values.update(self.predict(values))
        values.update({SLURM_FIELDS[k]: v for k, v in req.slurm.items() if k in SLURM_FIELDS and v is not None})
        if req.slurm.get("begin") and req.slurm["begin"] > now:
            values["eligible_time"] = req.slurm["begin"]
            values["reason"] = values["reason"] or "BeginTime"
        return values, tasks

    def _check_account(self, caller: Caller, account: str | None) -> None:
        """A user charges only a team they belong to; operators and admins may charge any."""
        if not account or caller.at_least("operator"):
            return
        team = self.policy.teams.get(account)
        own = self.policy.user_team.get(caller.user, "default")
        if account == own or (team is not None and caller.user in team.users):
            return
        raise Forbidden(f"account: {caller.user} is not a member of team {account!r} (their team: {own}); "
                        "only operators may charge another team", "account")

    def _queue(self, s: Session, name: str):
        """A queue (name and time limits) by its name or one of its partition aliases."""
        # rows, not ORM objects, read once per change of the queue table: this runs on every
        # submission
        t = Queue.__table__
        queues = self._queues.get(lambda: {r.name: r for r in s.connection().execute(
            sa_select(t.c.name, t.c.default_time_limit_s, t.c.max_time_limit_s)).all()})
        queue = queues.get(self.aliases.get(name, name))
        if queue is None:
            names = ", ".join(q.name for q in s.exec(select(Queue).order_by(Queue.name)).all())
            aliases = ", ".join(f"{a} (= {q})" for a, q in sorted(self.aliases.items()))
            raise NotFound(f"queue: unknown queue {name!r} (a Slurm partition name); queues: {names}"
                           + (f"; aliases: {aliases}" if aliases else ""), "queue")
        return queue

    @staticmethod
    def _check_nodes(s: Session, req: JobRequest) -> None:
        """-w names nodes that exist; -C names features some registered node has (Slurm refuses both)."""
        if not req.slurm.get("nodelist") and not req.slurm.get("features"):
            return
        nodes = {n.name: n.labels for n in s.exec(select(Node)).all()}
        missing = [n for n in req.slurm.get("nodelist") or () if n not in nodes]
        if missing:
            raise NotFound(f"nodelist: no node named {', '.join(missing)}; `trainyard nodes` lists them",
                           "nodelist")
        expr = req.slurm.get("features")
        if expr and nodes:
            from ..slurm.features import satisfies

            if not any(satisfies(expr, dict(labels)) for labels in nodes.values()):
                raise Conflict(f"features: no node has the features {expr!r} (Slurm: Invalid feature "
                               "specification); node features are labels: `trainyard node add --label`",
                               "features")

    def _check_fits(self, s: Session, req: JobRequest) -> None:
        # node sizes read once per change of the node table: this runs on every submission
        def sizes_of_nodes() -> tuple[list[int], tuple | None]:
            t = Node.__table__.c
            rows = s.connection().execute(sa_select(t.gpus_total, t.name).order_by(
                t.gpus_total.desc(), t.name.desc())).all()
            return [r[0] for r in rows], tuple(rows[0]) if rows else None

        sizes, largest = self._sizes.get(sizes_of_nodes)
        if largest is None:
            return  # nothing registered yet: the job waits for nodes
        if req.gpus > largest[0]:
            raise Conflict(f"gpus: {req.gpus} GPUs per node is more than any node has "
                          f"(largest: {largest[0]} on {largest[1]}); use --nodes to spread the job", "gpus")
        if req.nodes <= 1:
            return
        enough = sum(1 for g in sizes if g >= req.gpus)
        if req.nodes > enough:
            raise Conflict(f"nodes: {req.nodes} nodes with {req.gpus} GPUs each requested, "
                          f"but the cluster has only {enough} such nodes", "nodes")

    # ---------------------------------------------------------------- changes
    def set_priority(self, caller: Caller, job_id: int, priority: int) -> dict[str, Any]:
        with self.store.tx() as s:
            job = self._job(s, job_id)
            if not caller.may_act_on(job.user):
                raise Forbidden(f"job {job_id} belongs to {job.user}; only they or an operator may change it")
            if priority > job.priority and not caller.at_least("operator"):
                raise Forbidden(f"raising a job's priority needs the operator role; {caller.user} is {caller.role}")
            old, job.priority = job.priority, priority
            s.add(job)
            self.store.record(s, caller.user, "job.priority", str(job_id), {"from": old, "to": priority},
                              caller.address)
        self.wake()
        return job_json(job, caller)

    def set_time_limit(self, caller: Caller, job_id: int, limit: int | str) -> dict[str, Any]:
        """Slurm's `scontrol update TimeLimit=`: the owner may lower a waiting or running job's
        limit, only an operator may raise it (or make it UNLIMITED). A running job's deadline
        moves at once: the lifecycle's time-limit check reads the stored limit."""
        new = None if limit == "UNLIMITED" else int(limit)
        with self.store.tx() as s:
            job = self._job(s, job_id)
            if not caller.may_act_on(job.user):
                raise Forbidden(f"job {job_id} belongs to {job.user}; only they or an operator may change it")
            if job.state not in m.WAITING_STATES | m.ACTIVE_STATES:
                raise Conflict(f"job {job_id} is {job.state}; only a pending or running job's time "
                               "limit can change", "time_limit")
            old = job.time_limit_s
            raising = old is not None and (new is None or new > old)
            if raising and not caller.at_least("operator"):
                raise Forbidden(f"time_limit: raising job {job_id}'s limit from {_limit_text(old)} to "
                                f"{_limit_text(new)} needs the operator role ({caller.user} is "
                                f"{caller.role}); users may only lower a limit, as in Slurm", "time_limit")
            job.time_limit_s = new
            if job.signal_time is not None and new is not None and job.start_time is not None:
                spec = signal_spec(job)  # a raised limit earns the --signal warning again
                if spec is not None and job.start_time + new - spec.seconds > self.clock.time():
                    job.signal_time = None
            s.add(job)
            self.store.record(s, caller.user, "job.time_limit", str(job_id),
                              {"from": old, "to": new, "state": job.state}, caller.address)
        self.wake()
        return job_json(job, caller)

    def act(self, caller: Caller, job_id: int, action: str) -> dict[str, Any]:
        with self.store.tx() as s:
            job = self._job(s, job_id)
            self._act_on(s, caller, job, action)
        self.wake()
        return job_json(job, caller)

    def _act_on(self, s: Session, caller: Caller, job: Job, action: str) -> None:
        """One job action (cancel, hold, release, requeue), checked and audited; it raises before
        it changes anything."""
        if not caller.may_act_on(job.user):
            raise Forbidden(f"job {job.id} belongs to {job.user}; {caller.user} ({caller.role}) may only "
                            f"{action} their own jobs")
        getattr(self, f"_{action}")(s, job, caller)
        self.store.record(s, caller.user, f"job.{action}", str(job.id), {"state": job.state}, caller.address)

    def act_many(self, caller: Caller, ids: list[int], action: str) -> dict[str, Any]:
        """The same action on many jobs in one transaction (scancel of an array's 5,000 tasks was
        5,000 requests): each job is acted on or refused on its own, as `act` would; the refused
        ones say why ({"id", "kind", "detail"}) and change nothing. A refusal because the caller
        may not act on another user's job is audited once for the call."""
        done: list[int] = []
        refused: list[dict[str, Any]] = []
        with self.store.tx() as s:
            found = self.store.load_jobs(s, ids)
            for job_id in dict.fromkeys(ids):
                job = found.get(job_id)
                try:
                    if job is None:
                        raise NotFound(f"job {job_id} does not exist", "job_id")
                    self._act_on(s, caller, job, action)
                except DomainError as e:
                    refused.append({"id": job_id, "kind": e.kind, "detail": str(e)})
                    continue
                done.append(job_id)
            others = [r["id"] for r in refused if r["kind"] == Forbidden.kind]
            if others:
                self.store.record(s, caller.user, "api.refused", f"/v1/jobs/actions/{action}",
                                  {"status": 403, "method": "POST", "jobs": others[:100],
                                   "why": f"{len(others)} of the jobs are other users'"}, caller.address)
        if done:
            self.wake()
        return {"done": done, "refused": refused}

    def _cancel(self, s: Session, job: Job, caller: Caller) -> None:
        if job.state in m.WAITING_STATES:
            job.end_time = self.clock.time()
            job.held = ""
            self.store.set_state(s, job, m.CANCELLED, f"cancelled by {caller.user}", actor=caller.user)
        elif job.state in m.ACTIVE_STATES:
            job.reason = f"cancelled by {caller.user}"
            self.lifecycle.kill(s, job, "cancel")
        else:
            raise Conflict(f"job {job.id} is already {job.state}; nothing to cancel")

    def _hold(self, s: Session, job: Job, caller: Caller) -> None:
        if job.state != m.PENDING:
            raise Conflict(f"job {job.id} is {job.state}; only PENDING jobs can be held")
        kind = m.HOLD_ADMIN if caller.at_least("operator") else m.HOLD_USER
        if job.held == kind or job.held == m.HOLD_ADMIN:
            raise Conflict(f"job {job.id} is already held ({m.HOLD_REASONS[job.held]})")
        job.held = kind
        self.store.set_state(s, job, m.PENDING, m.HOLD_REASONS[kind], actor=caller.user)

    def _release(self, s: Session, job: Job, caller: Caller) -> None:
        if job.state != m.PENDING or not job.held:
            raise Conflict(f"job {job.id} is {job.state} and not held; nothing to release")
        if job.held == m.HOLD_ADMIN and not caller.at_least("operator"):
            raise Forbidden(f"job {job.id} was held by an operator (JobHeldAdmin); only an operator or "
                            "admin may release it")
        job.held = ""
        self.store.set_state(s, job, m.PENDING, "", actor=caller.user)

    def _requeue(self, s: Session, job: Job, caller: Caller) -> None:
        if job.state in m.ACTIVE_STATES:
            self.lifecycle.kill(s, job, "requeue")
        elif job.state in m.FINAL_STATES:
            job.end_time = None
            self.lifecycle.requeue(s, job, f"requeued by {caller.user}")
        else:
            raise Conflict(f"job {job.id} is {job.state}; it is already waiting to run")
