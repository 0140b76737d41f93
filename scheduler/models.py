"""SQL tables of the control plane (sqlmodel): nodes, jobs, queues, tokens, audit events."""

from __future__ import annotations

from typing import Any

from sqlalchemy import JSON, Column, Index, Text
from sqlmodel import Field, SQLModel

SCHEMA_VERSION = 2

# Job states, in Slurm's words. CONFIGURING is the write-ahead mark (DESIGN.md boundary 2):
# the allocation is committed, the launch is in flight. A held job is PENDING with reason
# JobHeldUser or JobHeldAdmin, as in Slurm.
PENDING, CONFIGURING, RUNNING = "PENDING", "CONFIGURING", "RUNNING"
COMPLETED, FAILED, CANCELLED, TIMEOUT = "COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"
PREEMPTED, NODE_FAIL, OUT_OF_MEMORY = "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY"
JOB_STATES = (PENDING, CONFIGURING, RUNNING, COMPLETED, FAILED, CANCELLED, TIMEOUT,
              PREEMPTED, NODE_FAIL, OUT_OF_MEMORY)
ACTIVE_STATES = frozenset({CONFIGURING, RUNNING})
WAITING_STATES = frozenset({PENDING})
FINAL_STATES = frozenset({COMPLETED, FAILED, CANCELLED, TIMEOUT, NODE_FAIL, OUT_OF_MEMORY})

# Hold kinds and their pending reasons: a user may release only a hold of their own.
HOLD_USER, HOLD_ADMIN = "user", "admin"
HELD_USER, HELD_ADMIN = "JobHeldUser", "JobHeldAdmin"
HOLD_REASONS = {HOLD_USER: HELD_USER, HOLD_ADMIN: HELD_ADMIN}

# Node states.
UP, DRAINING, DRAINED, DOWN = "UP", "DRAINING", "DRAINED", "DOWN"
PROVISIONING, BOOTSTRAPPING = "PROVISIONING", "BOOTSTRAPPING"
NODE_STATES = (UP, DRAINING, DRAINED, DOWN, PROVISIONING, BOOTSTRAPPING)

ROLES = ("user", "operator", "admin")


class Meta(SQLModel, table=True):
    """Key/value facts about the database itself, such as the schema version."""

    key: str = Field(primary_key=True)
    value: str


class Node(SQLModel, table=True):
    name: str = Field(primary_key=True)
    address: str
    port: int = 22
    user: str = "trainyard"
    key_path: str | None = None  # private key; None: the daemon's own key
    agent_dir: str = ""  # where the agent keeps its files; "": its node-local default
    privilege: str = "login"  # "login": the agent runs as `user`; "sudo": `user` starts it as root
    pool: str = "default"
    provider: str = "onprem"
    gpu_model: str = ""
    gpus_total: int = 0  # declared; the agent's hello replaces it with what it sees
    cpus: int = 0
    mem_mb: int = 0
    labels: dict[str, str] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    state: str = Field(default=DOWN, index=True)
    reason: str = ""
    # the agent's own view (hello): GPU indices it sees; allocations never use others
    gpu_indices: list[int] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    simulated: bool = False
    # what the agent said of itself in hello: protocol version, fencing, runtimes
    agent_info: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    last_seen: float | None = None
    created_at: float = 0.0
    gpus_expected: int = 0  # GPUs the operator or the pool declared; the health gate wants them all
    # the health gate's last outcome: {"status", "trigger", "time", "checks": [{check, result, detail}]}
    health_checks: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))


class Job(SQLModel, table=True):
    # Job rows are kept, so every read must take a small part of a table that holds every job
    # ever run. (state, queue): the live jobs' counts and the scheduler's reads; (state, id): a
    # listing filtered by state, in id order; end_time: the history's windows (sacct, sreport,
    # the fair-share ledger at start-up); array_parent: an array's tasks (sacct -j ARRAY_ID).
    __table_args__ = (Index("ix_job_state_queue", "state", "queue"), Index("ix_job_state_id", "state", "id"),
                      Index("ix_job_end_time", "end_time"), Index("ix_job_array_parent", "array_parent"))

    id: int | None = Field(default=None, primary_key=True)
    name: str = ""
    user: str = Field(index=True)
    queue: str = "default"
    state: str = PENDING
    reason: str = ""
    # a pending job's reason in words, from the planner (e.g. which constraint no node matches)
    reason_detail: str = ""
    held: str = ""  # "", HOLD_USER or HOLD_ADMIN
    command: list[str] | None = Field(default=None, sa_column=Column(JSON))
    script: str | None = Field(default=None, sa_column=Column(Text))
    gpus: int = 0  # per node
    gpu_type: str | None = None
    nodes: int = 1
    cpus: int = 1  # per node
    mem_mb: int = 0  # per node
    time_limit_s: int | None = None
    priority: int = 0
    retries: int = 0  # how many reruns after a failure are allowed
    attempt: int = 0  # 0 for the first run; +1 per requeue of any kind
    failures: int = 0
    preemptions: int = 0  # times it was preempted and requeued (the preemption budget counts them)  # reruns used up by failures (preemption and manual requeues are free)
    dependency: str = ""  # normalised, e.g. "afterok:12:13,singleton"
    account: str = ""  # team; "" means the team the policy maps the user to
    nice: int = 0
    constraint: dict[str, str] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    exclusive: bool = False
    attained_gpu_s: float = 0.0  # GPU-seconds of earlier attempts (least-attained-service)
    array_parent: int | None = None
    array_task_id: int | None = None
    array_limit: int | None = None
    array_spec: str = ""  # as submitted (0-9%2), for SLURM_ARRAY_TASK_MIN/MAX/COUNT
    env: dict[str, str] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
    workdir: str | None = None
    submit_time: float = 0.0
    eligible_time: float = 0.0
    start_time: float | None = None
    end_time: float | None = None
    exit_code: int | None = None
    # [{"node": name, "gpus": [idx, ...]}], rank order; set when the job is STARTING
    allocation: list[dict[str, Any]] = Field(default_factory=list, sa_column=Column(JSON, nullable=False))
    # why the daemon signalled it: "cancel", "timeout", "preempt", "requeue" (decides the end state)
    kill_reason: str = ""
    kill_time: float | None = None
    kill_grace_s: float | None = None  # SIGTERM -> SIGKILL; None: the daemon's kill_grace_s
    estimated_start: float | None = None
    # Slurm's batch options (scheduler/slurm/sbatch.py gives them their meaning)
    ntasks: int | None = None  # tasks in all; None: one per node
    ntasks_per_node: int | None = None
    cpus_per_task: int | None = None
    gpus_per_task: int | None = None
    features: str = ""  # -C: an expression over node features (labels), e.g. "a100&ib"
    nodelist: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False, default=list))
    exclude: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False, default=list))
    output: str = ""  # -o pattern (%j %x %A %a %N %u %t %%); "": slurm-%j.out in the workdir
    error: str = ""  # -e pattern; "": into the output file
    input: str = ""
    open_mode: str = "truncate"  # or append
    # Slurm's model: the script runs on the first node only and srun reaches the others
    # (sbatch and salloc set it); otherwise the command runs on every node (docs/slurm.md)
    batch_step: bool = False
    submit_dir: str = ""
    submit_host: str = ""
    signal: str = ""  # --signal [B:]SIG@SECONDS
    requeue: bool = True  # --requeue/--no-requeue: whether a node failure or preemption requeues
    begin_time: float | None = None  # --begin: not eligible before this
    qos: str = ""
    comment: str = ""
    wckey: str = ""
    reservation: str = ""
    mail_type: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False, default=list))
    mail_user: str = ""
    notify_url: str = ""
    export: str = "ALL"
    # a container job: the image as submitted, pyxis-style mounts, the workdir inside, and the
    # digest the nodes actually ran (recorded from the agent's `started`)
    image: str = ""
    container_mounts: list[str] = Field(default_factory=list, sa_column=Column(JSON, nullable=False, default=list))
    container_workdir: str = ""
    image_digest: str = ""
    # options accepted and recorded where trainyard has no such thing yet (shown once as a warning)
    recorded: dict[str, str] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False, default=dict))
    signal_time: float | None = None  # when this attempt got its --signal before the time limit
    idle_opt_out: bool = False  # exempt from idle reclaim where the queue allows it
    # the run time history predicted at submit (scheduler/daemon/prediction.py), the sentence
    # that says what it was based on, and whether it is confident enough to plan with
    predicted_runtime_s: float | None = None
    prediction_basis: str = ""
    prediction_confident: bool = False


class Queue(SQLModel, table=True):
    name: str = Field(primary_key=True)
    priority: int = 0
    open: bool = True
    default_time_limit_s: int | None = None
    max_time_limit_s: int | None = None


class Token(SQLModel, table=True):
    id: int | None = Field(default=None, primary_key=True)
    user: str
    role: str
    token_hash: str = Field(index=True, unique=True)  # sha256 of the secret; the secret is never stored
    created_at: float = 0.0
    created_by: str = ""


class Event(SQLModel, table=True):
    """The audit trail and state-change stream: who did what to which target, from where."""

    id: int | None = Field(default=None, primary_key=True)
    time: float = Field(index=True)
    actor: str
    action: str
    target: str = ""
    address: str = ""
    detail: dict[str, Any] = Field(default_factory=dict, sa_column=Column(JSON, nullable=False))
