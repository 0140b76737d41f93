"""Typed models of every table of trainyard.toml, and their conversion into the planner's types.

Each table is a pydantic model that forbids unknown keys and refuses values of the wrong type
(no "1" for 1, no 1 for true). `Settings.load(path)` raises `SettingsError`, whose message
names every bad key by its path (`queues.high.preempts[0]: unknown queue 'x'`) with its value.
The planner stays free of pydantic: `to_policy()` and `to_health()` build its frozen types.
"""

from __future__ import annotations

import re
import tomllib
from collections.abc import Mapping
from dataclasses import replace
from itertools import pairwise
from pathlib import Path
from types import MappingProxyType
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .containers import DEFAULT_HIGH_WATER_GB, DEFAULT_PULL_TIMEOUT_S
from .health import ACTIONS, DRAIN_NODE, FATAL_XIDS, HealthRules
from .jobdirs import DEFAULT_KEEP_S
from .planner.policy import ORDERS, PRESETS, QUEUEINGS, PolicyConfig, QueuePolicy, TeamQuota
from .settings_messages import describe, short
from .units import UnitError, format_duration, parse_duration, parse_listen

POLICIES = PRESETS
# trainyard user names as the API accepts them; Unix account names as useradd accepts them
USER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,62}")
UNIX_ACCOUNT = re.compile(r"[a-z_][a-z0-9_-]{0,31}")
MAX_GPUS = 1_000_000  # a bound far above any cluster, well inside a 64-bit column


class SettingsError(ValueError):
    """trainyard.toml (or a table of it) is not valid; `problems` holds one line per bad key."""

    def __init__(self, problems: list[str], source: str = ""):
        self.problems = problems
        self.source = source
        prefix = f"{source}: " if source else ""
        super().__init__("\n".join(prefix + p for p in problems))


# ------------------------------------------------------------------------------ value types
def _seconds(value: object) -> float:
    try:
        return parse_duration(value, key="")
    except UnitError as e:
        raise ValueError(e.problem) from None


def _names(value: object) -> object:
    """One name or a list of names (TOML arrays arrive as lists; a lone string is one name)."""
    return [value] if isinstance(value, str) else value


def _nonempty(value: str) -> str:
    if not value:
        raise ValueError("expected a non-empty name")
    return value


def _unix_account(value: str) -> str:
    if value == "root":
        raise ValueError("jobs never run as 'root'; map the user to their own Unix account")
    if not UNIX_ACCOUNT.fullmatch(value):
        raise ValueError(f"{value!r} is not a Unix account name (lower case letters, digits, _ "
                         "and -, starting with a letter or _, at most 32 characters)")
    return value


def _user_name(value: str) -> str:
    if value == "*":  # every user without an entry of their own (sites without per-user accounts)
        return value
    if not USER_NAME.fullmatch(value):
        raise ValueError(f"{value!r} is not a trainyard user name (letters, digits, '.', '_', '-')")
    return value


def _agent_dir(value: str) -> str:
    if value and not value.startswith("/"):
        raise ValueError(f"{value!r} must be an absolute path on the node's own disk, "
                         "e.g. /var/lib/trainyard (or \"\" for the default)")
    return value


def _listen(value: str) -> str:
    try:
        parse_listen(value)
    except ValueError:
        raise ValueError(f"expected HOST:PORT, e.g. 127.0.0.1:8471, got {value!r}") from None
    return value


Seconds = Annotated[float, BeforeValidator(_seconds)]
PositiveSeconds = Annotated[float, BeforeValidator(_seconds), Field(gt=0)]
Name = Annotated[str, AfterValidator(_nonempty)]
Names = Annotated[list[Name], BeforeValidator(_names)]
Gpus = Annotated[int, Field(ge=0, le=MAX_GPUS)]
Weight = Annotated[float, Field(ge=0)]
UserName = Annotated[str, AfterValidator(_user_name)]
UnixAccount = Annotated[str, AfterValidator(_unix_account)]


class _Table(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)


# ------------------------------------------------------------------------------ the tables
class DaemonSettings(_Table):
    """[daemon]: where the daemon listens, its database, and its timings."""

    listen: Annotated[str, AfterValidator(_listen)] = "127.0.0.1:8471"
    db: str = ""  # default: a SQLite file under TRAINYARD_HOME
    cluster_name: Name = "trainyard"
    node_grace_s: Seconds = 60.0  # unreachable this long: node DOWN, its jobs NODE_FAIL
    connect_timeout_s: PositiveSeconds = 10.0
    keepalive_interval_s: Seconds = 3.0  # 0: no SSH keepalives
    keepalive_count_max: int = Field(3, ge=1, le=1000)
    reconnect_max_backoff_s: PositiveSeconds = 10.0
    connect_concurrency: int = Field(32, ge=1, le=10_000)  # nodes in the SSH handshake at once
    hello_timeout_s: PositiveSeconds = 60.0  # an agent started that has not said hello by then: retried
    kill_grace_s: Seconds = 10.0  # SIGTERM -> SIGKILL for cancel, timeout and preemption
    schedule_interval_s: PositiveSeconds = 1.0
    telemetry_interval_s: PositiveSeconds = 2.0
    # each user's share of the daemon's long reads (job listings, sacct, event pages), in
    # seconds of CPU per second; a user past it gets 429 with Retry-After. 0: no limit
    read_share: float = Field(0.25, ge=0, le=64)
    read_burst_s: PositiveSeconds = 1.0  # what a user may spend at once before the share applies
    # processes that build long job listings and sacct windows beside the daemon (0: its read
    # threads do it)
    read_processes: int = Field(2, ge=0, le=64)


class PriorityWeightsSettings(_Table):
    """[scheduler.priority_weights]: Slurm's PriorityWeight*; unset keys keep the preset's."""

    age: Weight | None = None
    fairshare: Weight | None = None
    job_size: Weight | None = None
    queue: Weight | None = None
    max_age: PositiveSeconds | None = None
    favor_small: bool | None = None


class SchedulerSettings(_Table):
    """[scheduler]: a named policy (preset) and the keys that refine it; unset keys keep it."""

    policy: str = "backfill"
    order: str | None = None
    backfill: bool | None = None
    # backfill and estimated starts plan with confident run-time predictions (the time limit is
    # still enforced); qssf's preset turns it on
    backfill_on_prediction: bool | None = None
    queueing: str | None = None
    preemption: bool | None = None
    max_preemptors_per_pass: int | None = Field(None, ge=0, le=1_000_000)
    max_preemptions_per_job: int | None = Field(None, ge=0, le=1_000_000)  # a job is then left to run
    las_preempt_once_per_level: bool | None = None  # las: at most one preemption per level reached
    queue_depth: int | None = Field(None, ge=1, le=1_000_000)  # jobs tried per queue per pass
    grace_period: Seconds | None = None
    default_time: Seconds | None = None
    fairshare_half_life: PositiveSeconds | None = None
    las_thresholds_gpu_hours: list[Weight] | None = None
    topology_keys: Names | None = None
    priority_weights: PriorityWeightsSettings | None = None

    @field_validator("policy", "order", "queueing")
    @classmethod
    def _choice(cls, value: str | None, info: ValidationInfo) -> str | None:
        choices, what = {"policy": (POLICIES, "policy"), "order": (ORDERS, "order"),
                         "queueing": (QUEUEINGS, "strategy")}[info.field_name]
        if value == "oracle" and info.field_name == "policy":
            raise ValueError("'oracle' knows every job's true run time: it exists only in `trainyard "
                             "simulate --policy oracle`, as the yardstick; choose one of " + ", ".join(choices))
        if value is not None and value not in choices:
            raise ValueError(f"unknown {what} {value!r}; choose one of {', '.join(choices)}")
        return value

    @field_validator("las_thresholds_gpu_hours")
    @classmethod
    def _increasing(cls, hours: list[float] | None) -> list[float] | None:
        if hours is not None and any(a >= b for a, b in pairwise(hours)):
            raise ValueError(f"thresholds must be strictly increasing, got {hours!r}")
        return hours


class QueueSettings(_Table):
    """[queues.NAME]: a queue (Slurm partition + QOS)."""

    priority: int = Field(0, ge=-1_000_000, le=1_000_000)
    state: Literal["open", "stopped"] = "open"
    default_time: Seconds | None = None
    max_time: Seconds | None = None
    preempts: Names = []  # queues whose running jobs this queue's jobs may preempt
    grace_period: Seconds | None = None  # for this queue's jobs when preempted
    nodes: dict[str, str] = {}  # labels a node needs to serve this queue
    aliases: Names = []  # partition names that resolve to this queue (sbatch -p)
    # idle reclaim: a job whose GPUs stay under idle_util_pct for idle_minutes is warned, then
    # after idle_grace_minutes cancelled or requeued (docs/gpu.md); unset idle_minutes: never
    idle_util_pct: float = Field(5.0, ge=0, le=100)
    idle_minutes: float | None = Field(None, gt=0, le=525_600)
    idle_grace_minutes: float = Field(10.0, ge=0, le=525_600)
    idle_action: Literal["cancel", "requeue"] = "cancel"
    allow_opt_out: bool = False

    @field_validator("max_time")
    @classmethod
    def _max_covers_default(cls, max_time: float | None, info: ValidationInfo) -> float | None:
        default = info.data.get("default_time")
        if max_time is not None and default is not None and default > max_time:
            raise ValueError(f"{format_duration(max_time)} is less than default_time "
                             f"{format_duration(default)}; raise max_time or lower default_time")
        return max_time


class TeamSettings(_Table):
    """[teams.NAME]: a team's GPU quota in its cohort (Kueue) and fair-share shares (Slurm)."""

    nominal_gpus: Gpus | None = None  # unset: no quota
    borrowing_limit_gpus: Gpus | None = None  # unset: may borrow all the cohort lends
    lending_limit_gpus: Gpus | None = None  # unset: lends all of its unused quota
    cohort: Name | None = None
    fairshare: float = Field(1.0, gt=0)
    users: Names = []  # jobs of these users without --account charge this team

    @field_validator("borrowing_limit_gpus", "lending_limit_gpus")
    @classmethod
    def _limits_need_nominal(cls, limit: int | None, info: ValidationInfo) -> int | None:
        nominal = info.data.get("nominal_gpus")
        if limit is not None and nominal is None:
            raise ValueError(f"{limit} needs nominal_gpus: a team without a quota has no limits")
        if info.field_name == "lending_limit_gpus" and limit is not None and nominal is not None \
                and limit > nominal:
            raise ValueError(f"{limit} exceeds nominal_gpus {nominal}")
        return limit


Action = Literal[ACTIONS]  # drain_node | exclude_gpu | off


class HealthSettings(_Table):
    """[health]: which GPU telemetry drains a node or takes a GPU out (docs/gpu.md)."""

    xid: Action = DRAIN_NODE
    fatal_xids: list[Annotated[int, Field(gt=0, le=100_000)]] = sorted(FATAL_XIDS)
    ecc_dbe: Action = DRAIN_NODE
    remap_failure: Action = DRAIN_NODE
    off_bus: Action = DRAIN_NODE
    temp: Action = DRAIN_NODE
    temp_c: float = Field(90.0, ge=1, le=1000)
    temp_period_s: Seconds = 60.0
    history_samples: int = Field(300, ge=2, le=1_000_000)


class GateSettings(_Table):
    """[gate]: the checks a node passes before it takes work (docs/gpu.md)."""

    nvml: bool = True  # expected GPUs present, no pending row remap or uncorrected ECC, sane clocks
    dcgm: Literal["auto", "off"] = "auto"  # auto: `dcgmi diag -r LEVEL` where dcgmi is installed
    dcgm_level: int = Field(1, ge=1, le=4)
    test_command: list[Annotated[str, AfterValidator(_nonempty)]] = []  # a GPU test; exit 0 passes
    check_timeout: PositiveSeconds = 600.0
    telemetry_timeout: PositiveSeconds = 30.0
    period: Seconds = 0.0  # re-check idle nodes this often; 0: only when a node enters service
    user: UnixAccount = "nobody"  # runs the checks where the agent starts jobs as their owners
    resume_wait: Seconds = 8.0  # `node resume` answers with the outcome when it comes this soon


class NodesSettings(_Table):
    """[nodes]: how the agent runs on every node."""

    agent_dir: Annotated[str, AfterValidator(_agent_dir)] = ""  # "": the node-local default
    min_uid: int = Field(1000, ge=1, le=2**31 - 1)  # jobs never run as an account below this
    # a TOML file, mode 0600: ["REGISTRY[:PORT]"] username = ..., password = ... — sent to a node
    # for an image pull only, never stored with jobs, events or logs
    registry_credentials: str = ""
    # container images: a pull running longer than this fails its job (the agent's
    # --pull-timeout); a node's image cache past this many GB evicts the least recently used
    # images (--image-cache-gb)
    pull_timeout: PositiveSeconds = DEFAULT_PULL_TIMEOUT_S
    image_cache_gb: float = Field(DEFAULT_HIGH_WATER_GB, gt=0, le=1_000_000)
    # an ended job's directory on its node (its files, the node's copy of its output, its default
    # working directory) is removed this long after its end and all of its output are stored
    job_dir_retention: Seconds = DEFAULT_KEEP_S


BUCKET_URL = re.compile(r"s3://([a-z0-9][a-z0-9.-]{1,61}[a-z0-9])(?:/(.*))?")


def parse_bucket_url(url: str) -> tuple[str, str]:
    """`s3://BUCKET/PREFIX` -> (BUCKET, PREFIX without slashes at its ends); ValueError otherwise."""
    m = BUCKET_URL.fullmatch(url)
    if not m:
        raise ValueError(f"expected s3://BUCKET or s3://BUCKET/PREFIX (a bucket name of 3 to 63 lower "
                         f"case letters, digits, '.' and '-'), got {short(url)}")
    prefix = (m.group(2) or "").strip("/")
    if prefix and any(part in ("", ".", "..") for part in prefix.split("/")):
        raise ValueError(f"the prefix of {short(url)} has an empty, '.' or '..' part; write it as a/b/c")
    return m.group(1), prefix


def _bucket_url(value: str) -> str:
    if value:
        parse_bucket_url(value)
    return value


def _endpoint_url(value: str) -> str:
    return _http_url(value) if value else value


def _region(value: str) -> str:
    if not re.fullmatch(r"[a-z0-9-]{0,64}", value):
        raise ValueError(f"expected a region name such as eu-west-1 (lower case letters, digits and -), "
                         f"got {short(value)}")
    return value


class LogsSettings(_Table):
    """[logs]: where the daemon keeps jobs' output (per job attempt and rank) and for how long."""

    dir: str = ""  # "": TRAINYARD_HOME/logs; with a bucket, the spool of output not shipped yet
    retention_days: float = Field(30.0, gt=0, le=36500)
    max_bytes_per_job: int = Field(1 << 30, ge=4096, le=1 << 50)  # all ranks of one attempt
    # an S3-compatible bucket for finished output: "s3://BUCKET/PREFIX"; "": the files only
    bucket: Annotated[str, AfterValidator(_bucket_url)] = ""
    endpoint_url: Annotated[str, AfterValidator(_endpoint_url)] = ""  # "": AWS S3 itself
    region: Annotated[str, AfterValidator(_region)] = ""  # "": us-east-1
    # AWS's shared-credentials format, mode 0600; "": boto3's own chain (e.g. the instance role).
    # Never logged, never in the API's answers or events.
    credentials_file: str = ""

    @model_validator(mode="after")
    def _bucket_settings_need_a_bucket(self) -> LogsSettings:
        extra = [k for k in ("endpoint_url", "region", "credentials_file") if getattr(self, k)]
        if extra and not self.bucket:
            raise ValueError(f"{', '.join(extra)} set without logs.bucket; add bucket = "
                             "\"s3://BUCKET/PREFIX\" or remove them")
        return self


def _http_url(value: str) -> str:
    if not re.fullmatch(r"https?://[^\s/]+(/\S*)?", value):
        raise ValueError(f"expected an http:// or https:// URL, got {short(value)}")
    return value


def _mail_types(value: object) -> object:
    from .notify import parse_mail_type  # noqa: PLC0415 - notify imports httpx; only when used

    names = [n.strip() for n in value.split(",")] if isinstance(value, str) else value
    if isinstance(names, list) and all(isinstance(n, str) for n in names):
        parse_mail_type(names)  # names the known types when one is unknown
    return names


MailTypes = Annotated[list[str], BeforeValidator(_mail_types)]


class SmtpSettings(_Table):
    """[notify.smtp]: the mail server notifications go through."""

    host: Name
    port: int = Field(25, ge=1, le=65535)
    sender: str = "trainyard@localhost"
    user: str = ""
    password: str = ""
    starttls: bool = False
    ssl: bool = False  # SMTPS, usually port 465


class NotifySettings(_Table):
    """[notify]: cluster-wide webhooks (Slack-compatible) and mail, and how deliveries are tried."""

    webhooks: list[Annotated[str, AfterValidator(_http_url)]] = []
    webhook_types: MailTypes = ["FAIL", "REQUEUE", "TIME_LIMIT", "DRAIN", "DOWN"]
    mail_to: list[Name] = []
    mail_types: MailTypes = ["DRAIN", "DOWN"]
    smtp: SmtpSettings | None = None
    timeout_s: PositiveSeconds = 5.0
    retries: int = Field(3, ge=0, le=100)
    backoff_s: PositiveSeconds = 1.0
    max_backoff_s: PositiveSeconds = 60.0
    queue_max: int = Field(1000, ge=1, le=1_000_000)
    workers: int = Field(4, ge=1, le=64)


Price = Annotated[float, Field(ge=0)]


class InstancePrice(_Table):
    """[accounting.instances."TYPE"]: an AWS instance type's price per hour, and its GPUs."""

    on_demand: Price
    spot: Price | None = None
    gpus: int = Field(ge=1, le=1024)


class PoolPrice(_Table):
    """[accounting.pools.NAME]: what a GPU-hour in that pool costs."""

    kind: Literal["aws", "onprem"]
    instance_type: str = ""  # aws
    spot: bool = False  # aws
    gpu_hour: Price | None = None  # onprem

    @model_validator(mode="after")
    def _priced(self) -> PoolPrice:
        if self.kind == "onprem" and self.gpu_hour is None:
            raise ValueError("an onprem pool needs gpu_hour, its price per GPU-hour")
        if self.kind == "aws" and not self.instance_type:
            raise ValueError("an aws pool needs instance_type, priced in [accounting.instances]")
        return self


class AccountingSettings(_Table):
    """[accounting]: prices per pool, and what counts as an idle (wasted) GPU."""

    currency: Name = "USD"
    idle_threshold_pct: float = Field(5.0, ge=0, le=100)
    max_sample_gap_s: PositiveSeconds = 300.0  # telemetry older than this says nothing
    util_history_days: float = Field(35.0, gt=0, le=3660)
    # slurmdbd's PurgeJobAfter / PurgeEventAfter: finished jobs and audit events older than this
    # are removed (never, when unset, as in Slurm); daemon/retention.py says what always stays
    purge_jobs_after_days: float | None = Field(None, gt=0, le=36500)
    purge_events_after_days: float | None = Field(None, gt=0, le=36500)
    instances: dict[Name, InstancePrice] = {}
    pools: dict[Name, PoolPrice] = {}

    @model_validator(mode="after")
    def _instances_known(self) -> AccountingSettings:
        problems = []
        for name, p in self.pools.items():
            inst = self.instances.get(p.instance_type)
            if p.kind != "aws":
                continue
            if inst is None:
                problems.append(f"pools.{name}.instance_type: {p.instance_type!r} has no price; add "
                                f"[accounting.instances.\"{p.instance_type}\"] with on_demand and gpus")
            elif p.spot and inst.spot is None:
                problems.append(f"pools.{name}.spot: instances.\"{p.instance_type}\" has no spot "
                                "price; add spot = PRICE there")
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def price_book(self):
        """The pure accounting's PriceBook (per-pool price of a GPU-hour)."""
        from .accounting import PriceBook  # noqa: PLC0415

        doc = self.model_dump(exclude_none=True)
        return PriceBook.from_dict(doc)


class InfraSettings(_Table):
    """[infra]: the Pulumi project and stack whose pools the daemon scales (docs/infra.md)."""

    project_dir: str = ""  # "": the directory holding Pulumi.yaml (the checkout)
    stack: str = ""  # "": the stack selected there
    autoscale_interval: PositiveSeconds = 30.0  # how often [autoscale] pools are looked at
    # pin a new node's host key on first contact: the daemon created it at the address Pulumi gave
    accept_new_host_keys: bool = True


class AutoscalePoolSettings(_Table):
    """[autoscale.POOL]: the bounds and timings of an AWS pool that follows the queue."""

    min: int = Field(0, ge=0, le=512)
    max: int = Field(ge=0, le=512)
    idle_minutes: float = Field(30.0, gt=0, le=525_600)  # idle this long: drained and removed
    cooldown_minutes: float = Field(5.0, ge=0, le=1440)  # between two operations on the pool

    @model_validator(mode="after")
    def _bounds(self) -> AutoscalePoolSettings:
        if self.min > self.max:
            raise ValueError(f"min = {self.min} is above max = {self.max}; set min <= max")
        return self


class Settings(_Table):
    """The whole of trainyard.toml."""

    daemon: DaemonSettings = DaemonSettings()
    scheduler: SchedulerSettings = SchedulerSettings()
    queues: dict[Name, QueueSettings] = {}
    teams: dict[Name, TeamSettings] = {}
    health: HealthSettings = HealthSettings()
    users: dict[UserName, UnixAccount] = {}  # trainyard user -> Unix account on the nodes
    nodes: NodesSettings = NodesSettings()
    logs: LogsSettings = LogsSettings()
    notify: NotifySettings = NotifySettings()
    accounting: AccountingSettings = AccountingSettings()
    gate: GateSettings = GateSettings()
    infra: InfraSettings = InfraSettings()
    autoscale: dict[Name, AutoscalePoolSettings] = {}

    @model_validator(mode="after")
    def _references(self) -> Settings:
        problems = []
        partitions = {name: f"queues.{name}" for name in self.queues}
        for name, q in self.queues.items():
            for i, victim in enumerate(q.preempts):
                where = f"queues.{name}.preempts[{i}]"
                if victim == name:
                    problems.append(f"{where}: a queue cannot preempt itself ({victim!r})")
                elif victim not in self.queues:
                    problems.append(f"{where}: unknown queue {victim!r}; configured queues: "
                                    f"{', '.join(sorted(self.queues))}")
            for i, alias in enumerate(q.aliases):
                if alias in partitions:
                    problems.append(f"queues.{name}.aliases[{i}]: {alias!r} already names "
                                    f"{partitions[alias]}")
                partitions[alias] = f"queues.{name}"
        team_of: dict[str, str] = {}
        for name, t in self.teams.items():
            for i, user in enumerate(t.users):
                if user in team_of:
                    problems.append(f"teams.{name}.users[{i}]: user {user!r} is already in team "
                                    f"{team_of[user]!r}")
                team_of[user] = name
        if problems:
            raise ValueError("\n".join(problems))
        return self

    # -------------------------------------------------------------------------- reading
    @classmethod
    def from_toml(cls, document: Mapping[str, Any], source: str = "") -> Settings:
        """Validate a parsed trainyard.toml; SettingsError names every bad key and its value."""
        try:
            return cls.model_validate(document)
        except ValidationError as e:
            raise SettingsError(describe(e, Settings), source) from None

    @classmethod
    def load(cls, path: str | Path) -> Settings:
        return cls.from_toml(read_toml(path), str(Path(path).expanduser()))

    # -------------------------------------------------------------------------- the edge
    def to_policy(self) -> PolicyConfig:
        """The planner's frozen PolicyConfig: the named preset, refined by the keys set here."""
        s = self.scheduler
        base = _preset(s.policy)
        kw: dict[str, Any] = {k: v for k, v in (
            ("order", s.order), ("backfill", s.backfill), ("queueing", s.queueing),
            ("preemption", s.preemption), ("max_preemptors_per_pass", s.max_preemptors_per_pass),
            ("queue_depth", s.queue_depth), ("backfill_on_prediction", s.backfill_on_prediction),
            ("max_preemptions_per_job", s.max_preemptions_per_job),
            ("las_preempt_once_per_level", s.las_preempt_once_per_level),
            ("grace_period_s", s.grace_period), ("default_time_limit_s", s.default_time),
            ("fairshare_half_life_s", s.fairshare_half_life),
        ) if v is not None}
        if s.las_thresholds_gpu_hours is not None:
            kw["las_thresholds_gpu_s"] = tuple(h * 3600.0 for h in s.las_thresholds_gpu_hours)
        if s.topology_keys is not None:
            kw["topology_keys"] = tuple(s.topology_keys)
        if s.priority_weights is not None:
            w = s.priority_weights
            kw["weights"] = replace(base.weights, **{k: v for k, v in (
                ("age", w.age), ("fairshare", w.fairshare), ("job_size", w.job_size),
                ("queue", w.queue), ("max_age_s", w.max_age), ("favor_small", w.favor_small),
            ) if v is not None})
        queues = {name: QueuePolicy(
            name=name, priority=q.priority, open=q.state == "open",
            default_time_limit_s=q.default_time, max_time_limit_s=q.max_time,
            preempts=tuple(q.preempts), grace_period_s=q.grace_period,
            node_selector=MappingProxyType(dict(q.nodes)),
        ) for name, q in self.queues.items()}
        teams = {name: TeamQuota(
            name, t.nominal_gpus, t.borrowing_limit_gpus, t.lending_limit_gpus, t.cohort,
            float(t.fairshare), tuple(t.users),
        ) for name, t in self.teams.items()}
        return replace(base, **kw, queues=MappingProxyType(queues), teams=MappingProxyType(teams))

    def to_health(self) -> HealthRules:
        """The health rules that scheduler.health.evaluate applies."""
        h = self.health
        return HealthRules(
            xid=h.xid, fatal_xids=frozenset(h.fatal_xids), ecc_dbe=h.ecc_dbe,
            remap_failure=h.remap_failure, off_bus=h.off_bus, temp=h.temp, temp_c=h.temp_c,
            temp_period_s=h.temp_period_s, history_samples=h.history_samples,
        )

    def queue_aliases(self) -> dict[str, str]:
        """Partition name -> queue, for every alias and every queue's own name."""
        out = {name: name for name in self.queues}
        out.update({alias: name for name, q in self.queues.items() for alias in q.aliases})
        return out


def _preset(name: str) -> PolicyConfig:
    return PolicyConfig.preset(name)


def read_toml(path: str | Path) -> dict[str, Any]:
    """A TOML file as a dict; SettingsError says in one line why it cannot be read."""
    p = Path(path).expanduser()
    try:
        return tomllib.loads(p.read_text())
    except FileNotFoundError:
        raise SettingsError([f"config file {str(p)!r} does not exist"]) from None
    except (OSError, UnicodeDecodeError) as e:
        raise SettingsError([f"cannot read config file {str(p)!r}: {e}"]) from None
    except tomllib.TOMLDecodeError as e:
        raise SettingsError([f"config file {str(p)!r} is not valid TOML: {e}"]) from None
