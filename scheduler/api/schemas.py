"""Request and response models of the HTTP API; request models refuse what cannot be stored."""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from ..jobspec import check_env_names
from ..planner import parse_array, parse_dependency
from ..units import parse_mem, parse_time_limit

NAME_RE = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,62}$"
MAX_ARRAY_TASKS = 10000
MAX_ID = 2**63 - 1  # the database's BIGINT; larger ids cannot exist
_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$", re.ASCII)


def storable(value: Any, where: str = "") -> None:
    """Refuse strings the database cannot store as UTF-8 text: lone surrogates and NUL."""
    if isinstance(value, str):
        if "\x00" in value:
            raise ValueError(f"{where or 'value'}: contains a NUL character, which cannot be stored")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            raise ValueError(f"{where or 'value'}: is not valid UTF-8 text (a lone surrogate?)") from None
    elif isinstance(value, dict):
        for k, v in value.items():
            storable(k, f"{where}.{k!r}" if where else repr(k))
            storable(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, list | tuple):
        for i, v in enumerate(value):
            storable(v, f"{where}[{i}]")


def check_host(address: str) -> str:
    """A host name (RFC 1123, IDNA-encodable) or an IP address."""
    try:
        ipaddress.ip_address(address.strip("[]"))
        return address.strip("[]")
    except ValueError:
        pass
    name = address.rstrip(".")
    try:
        ascii_name = name.encode("idna").decode("ascii")
    except (UnicodeError, ValueError):
        raise ValueError(f"{address!r} is neither an IP address nor a valid host name") from None
    if not ascii_name or len(ascii_name) > 253 or not all(_HOST_LABEL.match(p) for p in ascii_name.split(".")):
        raise ValueError(f"{address!r} is neither an IP address nor a valid host name")
    return address


class Strict(BaseModel):
    """Request bodies: unknown fields refused, every string storable."""

    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _storable(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for k, v in data.items():
                storable(v, str(k))
                # JSON's true/false are not numbers, nor 0/1 booleans (pydantic's lax mode mixes them)
                kinds = cls._kinds(k)
                if isinstance(v, bool) and kinds & {int, float} and bool not in kinds:
                    raise ValueError(f"{k}: expected a number, got {str(v).lower()}")
                if kinds == {bool} and not isinstance(v, bool):
                    raise ValueError(f"{k}: expected true or false, got {v!r}")
        return data

    @classmethod
    def _kinds(cls, name: str) -> frozenset:
        """The types a field's annotation admits (worked out once per model and field: every
        request body asks for each of its fields)."""
        kinds = _KINDS.get((cls, name))
        if kinds is None:
            f = cls.model_fields.get(name)
            if f is None:  # not a field (refused as such): nothing kept for it
                return frozenset()
            union = set(get_args(f.annotation)) | {f.annotation}
            kinds = _KINDS[cls, name] = frozenset({a for k in union for a in (get_args(k) or (k,))} - {type(None)})
        return kinds


_KINDS: dict[tuple[type, str], frozenset] = {}


NO_NUL = r"^[^\x00]*$"  # PostgreSQL's text cannot hold NUL
Text = Annotated[str, Field(max_length=4096, pattern=NO_NUL)]
Label = Annotated[str, Field(min_length=1, max_length=128, pattern=NO_NUL)]
ENV_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


# ---------------------------------------------------------------------------- requests
_ONE_OF_COMMAND_OR_SCRIPT = {"oneOf": [
    {"required": ["command"], "properties": {
        "command": {"type": "array", "minItems": 1, "prefixItems": [{"type": "string", "minLength": 1}]},
        "script": {"type": "null"}}},
    {"required": ["script"], "properties": {
        "script": {"type": "string", "pattern": "\\S"}, "command": {"type": "null"}}},
]}


class JobSubmit(Strict):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_ONE_OF_COMMAND_OR_SCRIPT)

    command: list[Annotated[str, Field(max_length=65536, pattern=NO_NUL)]] | None = Field(default=None,
                                                                                           max_length=4096)
    script: str | None = Field(default=None, max_length=1 << 20, pattern=NO_NUL)
    name: str | None = Field(default=None, max_length=200, pattern=NO_NUL)
    queue: str = Field(default="default", max_length=64)
    gpus: int = Field(default=0, ge=0, le=1024)
    gpu_type: str | None = Field(default=None, max_length=128, pattern=NO_NUL)
    nodes: int = Field(default=1, ge=1, le=4096)
    cpus: int = Field(default=1, ge=1, le=4096)
    mem: str | int | None = Field(default=None, description="MiB, or a size like 16G")
    time_limit: str | int | None = Field(default=None, description="seconds, or Slurm's D-HH:MM:SS forms")
    priority: int = Field(default=0, ge=-10000, le=10000)
    retries: int = Field(default=0, ge=0, le=100)
    after: int | str | None = Field(default=None, description="job id or afterok:ID[:ID], singleton, ...")
    array: str | None = Field(default=None, max_length=1024, pattern=r"^[0-9][0-9,:%-]*$",
                              description="Slurm's array syntax: 0-9, 1,3,5, 0-99:2, 0-99%10")
    constraint: dict[Label, Annotated[str, Field(max_length=128, pattern=NO_NUL)]] | str | None = None
    exclusive: bool = False
    nice: int = Field(default=0, ge=-10000, le=10000)
    account: str | None = Field(default=None, pattern=NAME_RE)
    env: dict[Annotated[str, Field(max_length=256, pattern=ENV_NAME)],
              Annotated[str, Field(max_length=65536, pattern=NO_NUL)]] = Field(default_factory=dict, max_length=1024)
    workdir: str | None = Field(default=None, max_length=4096, pattern="^/", description="absolute, on the node")
    hold: bool = False
    # Slurm's batch options, with sbatch's meaning (docs/slurm.md)
    ntasks: int | None = Field(default=None, ge=1, le=1 << 20)
    ntasks_per_node: int | None = Field(default=None, ge=1, le=4096)
    cpus_per_task: int | None = Field(default=None, ge=1, le=4096)
    gpus_per_task: int | None = Field(default=None, ge=0, le=1024)
    nodes_max: int | None = Field(default=None, ge=1, le=4096)
    features: str | None = Field(default=None, max_length=1024, pattern=NO_NUL,
                                 description="-C: node features with & | [...], e.g. a100&ib")
    nodelist: list[Annotated[str, Field(pattern=NAME_RE)]] | None = Field(default=None, max_length=4096)
    exclude: list[Annotated[str, Field(pattern=NAME_RE)]] | None = Field(default=None, max_length=4096)
    output: str | None = Field(default=None, max_length=4096, pattern=NO_NUL,
                               description="Slurm filename pattern (%j %x %A %a %N %u %t %%)")
    error: str | None = Field(default=None, max_length=4096, pattern=NO_NUL)
    input: str | None = Field(default=None, max_length=4096, pattern=NO_NUL)
    open_mode: Literal["truncate", "append"] | None = None
    batch_step: bool | None = Field(
        default=None, description="Slurm's model: the script runs once, on the first node, and srun "
                                  "in it starts tasks on every node (sbatch sets it); otherwise the "
                                  "command runs on every node")
    submit_dir: str | None = Field(default=None, max_length=4096, pattern="^/")
    submit_host: str | None = Field(default=None, max_length=253, pattern=NO_NUL)
    signal: str | None = Field(default=None, max_length=32, pattern=r"^([BR]:)?[A-Za-z0-9]{1,10}(@[0-9]{1,6})?$",
                               description="[B:]SIG[@SECONDS], e.g. USR1@60: SIG that long before the time limit "
                                           "and at the start of a preemption's grace period")
    idle_opt_out: bool | None = Field(default=None, description="exempt from idle reclaim, where the queue allows")
    image: str | None = Field(default=None, max_length=512, pattern=NO_NUL,
                              description="run in a container: [REGISTRY/]REPOSITORY[:TAG][@sha256:DIGEST]")
    container_mounts: list[Annotated[str, Field(max_length=4096, pattern=NO_NUL)]] | str | None = Field(
        default=None, description="SRC[:DST[:ro|rw]], as a list or comma-separated (pyxis)")
    container_workdir: str | None = Field(default=None, max_length=4096, pattern="^/")
    requeue: bool | None = None
    begin: float | None = Field(default=None, ge=0, le=1e11, description="epoch seconds")
    qos: str | None = Field(default=None, max_length=64, pattern=NO_NUL)
    comment: str | None = Field(default=None, max_length=1024, pattern=NO_NUL)
    wckey: str | None = Field(default=None, max_length=64, pattern=NO_NUL)
    reservation: str | None = Field(default=None, max_length=64, pattern=NO_NUL)
    mail_type: list[Annotated[str, Field(pattern=r"^[A-Z_0-9]{1,32}$")]] | None = Field(default=None, max_length=32)
    mail_user: str | None = Field(default=None, max_length=254, pattern=NO_NUL)
    notify_url: str | None = Field(default=None, max_length=2048, pattern=r"^https?://[^\x00\s]+$")
    export: str | None = Field(default=None, max_length=4096, pattern=NO_NUL)
    recorded: dict[Annotated[str, Field(max_length=64, pattern=NO_NUL)],
                   Annotated[str, Field(max_length=1024, pattern=NO_NUL)]] | None = Field(default=None, max_length=64)

    @model_validator(mode="after")
    def one_of_command_or_script(self):
        if (self.command is None) == (self.script is None):
            raise ValueError("give exactly one of 'command' (a list of arguments) or 'script' (text)")
        if self.command is not None and (not self.command or not self.command[0]):
            raise ValueError("'command' must not be empty")
        if self.script is not None and not self.script.strip():
            raise ValueError("'script' must not be empty")
        return self

    @field_validator("mem")
    @classmethod
    def _mem(cls, v):
        return None if v is None else parse_mem(v)

    @field_validator("time_limit")
    @classmethod
    def _time(cls, v):
        if v is None or (isinstance(v, str) and v.strip().upper() in ("UNLIMITED", "INFINITE")):
            return None if v is None else "UNLIMITED"
        return parse_time_limit(v, "time_limit")

    @field_validator("image")
    @classmethod
    def _image(cls, v):
        if v is not None:
            from ..containers import ContainerError, parse_image

            try:
                parse_image(v)
            except ContainerError as e:
                raise ValueError(str(e)) from None
        return v

    @field_validator("container_mounts")
    @classmethod
    def _mounts(cls, v):
        if v is None:
            return None
        from ..containers import ContainerError, parse_mounts

        try:
            mounts = parse_mounts(v)
        except ContainerError as e:
            raise ValueError(str(e)) from None
        return [f"{m['src']}:{m['dst']}" + (":ro" if m["ro"] else "") for m in mounts]

    @field_validator("signal")
    @classmethod
    def _signal(cls, v):
        if v is not None:
            from ..daemon.lifecycle import SignalSpec

            SignalSpec.parse(v)
        return v

    @field_validator("features")
    @classmethod
    def _features(cls, v):
        if v:
            from ..slurm.features import parse_constraint

            parse_constraint(v)
        return v or None

    @field_validator("env")
    @classmethod
    def _env(cls, v):
        check_env_names(v)
        return v

    @field_validator("workdir")
    @classmethod
    def _workdir(cls, v):
        if v is not None and not v.startswith("/"):
            raise ValueError(f"workdir {v!r} must be an absolute path on the node")
        return v

    @field_validator("after")
    @classmethod
    def _after(cls, v):
        if v is None:
            return None
        dep = parse_dependency(str(v))
        from ..planner import depends_on

        for job_id in depends_on(dep):
            if not 1 <= job_id <= MAX_ID:
                raise ValueError(f"job id {job_id} is out of range")
        return dep

    @field_validator("array")
    @classmethod
    def _array(cls, v):
        if v is None:
            return None
        indices, _limit = parse_array(v)
        if len(indices) > MAX_ARRAY_TASKS:
            raise ValueError(f"array {v!r} has {len(indices)} tasks; at most {MAX_ARRAY_TASKS} per request")
        return v

    @field_validator("constraint")
    @classmethod
    def _constraint(cls, v):
        if v is None or isinstance(v, dict):
            return v or None
        out = {}
        for part in v.split(","):
            k, sep, val = part.strip().partition("=")
            if not sep or not k:
                raise ValueError(f"constraint {v!r}: expected LABEL=VALUE[,LABEL=VALUE...], e.g. rack=r1")
            out[k] = val
        return out


BULK_MAX = 10_000  # jobs per bulk action (an array's tasks, scancel -u)


class JobIdList(Strict):
    """The jobs one call acts on, each acted on or refused on its own."""

    ids: list[Annotated[int, Field(ge=1, le=MAX_ID)]] = Field(min_length=1, max_length=BULK_MAX)


class Refusal(BaseModel):
    id: int
    status: int = Field(description="what the same call on this job alone would have answered (403, 404, 409)")
    detail: str


class BulkResult(BaseModel):
    done: list[int] = Field(description="the jobs acted on, in the order asked")
    refused: list[Refusal] = Field(description="the jobs left as they were, and why")


class JobPatch(Strict):
    """What `scontrol update` changes: the priority, the time limit, or both."""

    priority: int | None = Field(default=None, ge=-10000, le=10000)
    time_limit: str | int | None = Field(default=None, description=(
        "the new time limit: seconds, or Slurm's D-HH:MM:SS forms; UNLIMITED for none. Users may "
        "lower their jobs' limits; raising one needs the operator role"))

    @field_validator("time_limit")
    @classmethod
    def _time(cls, v):
        if isinstance(v, str) and v.strip().upper() in ("UNLIMITED", "INFINITE"):
            return "UNLIMITED"
        return None if v is None else parse_time_limit(v, "time_limit")

    @model_validator(mode="after")
    def _something(self):
        if self.priority is None and self.time_limit is None:
            raise ValueError("nothing to change: give priority, time_limit or both")
        return self


class NodeAdd(Strict):
    name: str = Field(pattern=NAME_RE)
    address: str = Field(min_length=1, max_length=253)
    port: int = Field(default=22, ge=1, le=65535)
    user: str = Field(default="trainyard", pattern=r"^[a-z_][a-z0-9_-]{0,31}\$?$")
    key_path: str | None = Field(default=None, max_length=4096)
    agent_dir: str = Field(default="", max_length=4096)
    accept_new_host_key: bool = False
    privilege: Literal["login", "sudo"] = Field(default="login", description=
                                                "login: the agent runs as `user`; sudo: `user` may start "
                                                "exactly the agent as root (docs/nodes.md)")
    gpus: int | None = Field(default=None, ge=0, le=64)
    gpu_model: str | None = Field(default=None, max_length=128)
    pool: str = Field(default="default", pattern=NAME_RE)
    provider: Literal["aws", "onprem"] = "onprem"
    labels: dict[Label, Annotated[str, Field(max_length=128)]] = Field(default_factory=dict, max_length=64)
    probe: bool = True  # connect once before registering

    @field_validator("address")
    @classmethod
    def _address(cls, v):
        return check_host(v)


class DrainBody(Strict):
    reason: str = Field(min_length=1, max_length=500, pattern=NO_NUL)


class FaultBody(Strict):
    gpu: int = Field(ge=0, le=63)
    kind: Literal["xid", "ecc_dbe", "temp", "off_bus", "remap_pending", "clear"]
    value: Annotated[float, Field(ge=-1e9, le=1e9)] | None = None


class BootstrapBody(Strict):
    phase: Literal["start", "done", "failed"]
    detail: str = Field(default="", max_length=2000, pattern=NO_NUL)


class TokenCreate(Strict):
    user: str = Field(pattern=NAME_RE)
    role: Literal["admin", "operator", "user"]


# ---------------------------------------------------------------------------- responses
class Open(BaseModel):
    """Response models document the shape; extra keys may be added in later versions."""

    model_config = ConfigDict(extra="allow")


class Allocation(BaseModel):
    node: str
    gpus: list[int]


class JobRead(Open):
    id: int
    name: str
    user: str
    queue: str
    state: str
    reason: str
    reason_detail: str | None = Field(default=None, description=(
        "a pending job's reason in words, e.g. which constraint no node matches"))
    held: str | None = None
    command: list[str] | None
    script: bool
    gpus: int
    gpu_type: str | None
    nodes: int
    cpus: int
    mem: int
    time_limit: int | None
    priority: int
    retries: int
    failures: int
    attempt: int
    preemptions: int = Field(default=0, description="times the job was preempted and requeued")
    dependency: str | None
    array_job_id: int | None
    array_task_id: int | None
    constraint: dict[str, str]
    exclusive: bool
    nice: int
    account: str | None
    env: dict[str, str | None] = Field(description="another user's job shows names only (values null)")
    workdir: str | None
    submit_time: float
    start_time: float | None
    end_time: float | None
    exit_code: int | None
    estimated_start: float | None
    allocation: list[Allocation]
    ntasks: int | None = None
    ntasks_per_node: int | None = None
    cpus_per_task: int | None = None
    features: str | None = None
    nodelist: list[str] = Field(default_factory=list)
    exclude: list[str] = Field(default_factory=list)
    output: str | None = None
    error: str | None = None
    signal: str | None = None
    requeue: bool = True
    begin: float | None = None
    qos: str | None = None
    comment: str | None = None
    mail_type: list[str] = Field(default_factory=list)
    mail_user: str | None = None
    recorded: dict[str, str] = Field(default_factory=dict)
    image: str | None = None
    image_digest: str | None = None
    container_mounts: list[str] = Field(default_factory=list)
    batch_step: bool = False
    predicted_runtime_s: float | None = Field(
        None, description="the run time predicted at submit from finished jobs' history")
    prediction_basis: str | None = Field(
        None, description="what the prediction was based on, e.g. \"5 past runs of user alice's jobs "
                          "named 'train'\", or the keys with too little history it fell back from")
    prediction_confident: bool = Field(
        False, description="planned with (backfill, estimated start, qssf), capped by the time limit")
    estimated_start_basis: str | None = Field(
        None, description="what estimated_start was computed from: predicted run times or time limits")


class NodeRead(Open):
    name: str
    address: str
    port: int
    user: str
    pool: str
    provider: str
    state: str
    reason: str
    connected: bool
    gpu_model: str
    gpus_total: int
    gpus_used: int
    cpus: int
    mem_mb: int
    labels: dict[str, str]
    last_seen: float | None
    simulated: bool
    agent_dir: str
    privilege: str = "login"
    fencing: dict[str, Any] | None = None
    health_checks: dict[str, Any] = Field(default_factory=dict, description="the health gate's last results")
    agent: dict[str, Any] = Field(default_factory=dict)
    telemetry: dict[str, Any]
    excluded_gpus: dict[str, str]


class ImportResult(BaseModel):
    name: str | None
    ok: bool
    error: str | None = None
    node: NodeRead | None = None


class Removed(BaseModel):
    name: str
    removed: bool


class LogChunk(Open):
    data: str
    next: int
    state: str
    node: str | None
    attempt: int | None = None
    rank: int | None = None
    size: int | None = None
    complete: bool | None = None
    source: Literal["store", "bucket", "node", "none"] | None = None


class QueueRead(Open):
    name: str
    priority: int
    state: Literal["open", "stopped"]
    default_time_limit: int | None
    max_time_limit: int | None
    aliases: list[str] = Field(default_factory=list, description="partition names that mean this queue")
    nodes: dict[str, str] = Field(default_factory=dict, description="labels a node needs to serve this queue")
    pending: int
    running: int
    gpus_used: int


class TeamRead(Open):
    name: str
    cohort: str | None
    nominal_gpus: int | None
    borrowing_limit_gpus: int | None
    lending_limit_gpus: int | None
    fairshare_shares: float
    users: list[str]
    gpus_used: int
    running: int
    pending: int
    usage_gpu_hours: float


class TokenRead(BaseModel):
    id: int
    user: str
    role: str
    created_at: float
    created_by: str


class TokenCreated(BaseModel):
    user: str
    role: str
    token: str = Field(description="shown once; only its hash is stored")


class TokenRevoked(BaseModel):
    id: int
    user: str
    revoked: bool


class EventRead(BaseModel):
    id: int
    time: float
    actor: str
    action: str
    target: str
    address: str
    detail: dict[str, Any]


class Me(BaseModel):
    user: str
    role: str


class ClusterRead(Open):
    name: str
    version: str
    nodes_total: int
    nodes_up: int
    gpus_total: int
    gpus_used: int
    jobs_running: int
    jobs_pending: int
    jobs_by_state: dict[str, int]
    problems: list[str] = Field(default_factory=list, description="what the daemon cannot do now, and why")
    role: Literal["leader", "standby"] = "leader"
    loop_lag_p99_ms: float | None = Field(
        None, description="how late the daemon's event loop ran its timers, p99 of the last minute; "
                          "null in its first 10 s (GET /v1/diag has the rest)")


class Health(Open):
    ok: bool
    role: Literal["leader", "standby"] = "leader"
    url: str = ""
    leader: str | None = None
    epoch: int | None = None
    reason: str | None = None
