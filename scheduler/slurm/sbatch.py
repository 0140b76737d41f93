"""sbatch's options: read `#SBATCH` lines and command-line arguments as Slurm does.

`parse_script(text, argv)` returns a `BatchSpec`: what Slurm would allocate (nodes, tasks,
CPUs, memory and GPUs per node, time limit, array, output files, ...) plus every option that
trainyard records but does not act on yet. `BatchSpec.to_submit_body()` is the JSON body of
POST /v1/jobs. Slurm's parsing rules, followed here:

* directives are lines that start with `#SBATCH` in column one; the first line that is
  neither blank nor a comment ends them (an indented `#SBATCH` is a plain comment);
* one line may carry several options; `--opt value`, `--opt=value`, `-N2` and `-N 2` all
  work; quotes group and are removed; a `#` outside quotes starts a comment;
* long options may be shortened to any unique prefix (getopt_long);
* the command line is read after the script, so its options win.
"""

from __future__ import annotations

import math
import os
import re
import signal as _signal
import socket
import time as _time
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from ..containers import ContainerError, parse_image, parse_mounts
from ..units import UnitError, parse_duration, parse_mem
from .features import ConstraintError, parse_constraint
from .hostlist import HostlistError, expand

DIRECTIVE = "#SBATCH"
DEFAULT_OUTPUT = "slurm-%j.out"
DEFAULT_ARRAY_OUTPUT = "slurm-%A_%a.out"

MAIL_TYPES = frozenset({
    "NONE", "BEGIN", "END", "FAIL", "REQUEUE", "ALL", "INVALID_DEPEND", "STAGE_OUT",
    "TIME_LIMIT", "TIME_LIMIT_90", "TIME_LIMIT_80", "TIME_LIMIT_50", "ARRAY_TASKS",
})


class SbatchError(ValueError):
    """An option Slurm itself refuses; the message names the option, its origin and the meaning."""


@dataclass(frozen=True)
class Origin:
    """Where an option came from: a script line (number and text) or the command line."""

    line: int | None = None
    text: str = ""

    def __str__(self) -> str:
        if self.line is None:
            return f"command line {self.text}".rstrip()
        return f"script line {self.line}: {self.text}"


@dataclass(frozen=True)
class Option:
    long: str
    short: str | None
    arg: str  # "required", "none" or "optional" (optional values only as --opt=value)
    meaning: str


# The option table. `meaning` is what Slurm means, quoted in refusals.
_OPTIONS = [
    Option("job-name", "J", "required", "the job's name"),
    Option("nodes", "N", "required", "the number of nodes: N or MIN-MAX, e.g. --nodes=2"),
    Option("ntasks", "n", "required", "the number of tasks (processes) of the job, e.g. --ntasks=8"),
    Option("ntasks-per-node", None, "required", "tasks on each node, e.g. --ntasks-per-node=4"),
    Option("cpus-per-task", "c", "required", "CPUs for each task, e.g. --cpus-per-task=8"),
    Option("cpus-per-gpu", None, "required", "CPUs for each allocated GPU"),
    Option("mem", None, "required", "memory per node, e.g. --mem=64G (0: all of each node's memory)"),
    Option("mem-per-cpu", None, "required", "memory per allocated CPU, e.g. --mem-per-cpu=4G"),
    Option("mem-per-gpu", None, "required", "memory per allocated GPU, e.g. --mem-per-gpu=40G"),
    Option("gpus", "G", "required", "GPUs for the whole job, [TYPE:]COUNT, e.g. --gpus=a100:8"),
    Option("gpus-per-node", None, "required", "GPUs on each node, [TYPE:]COUNT, e.g. --gpus-per-node=4"),
    Option("gpus-per-task", None, "required", "GPUs for each task, [TYPE:]COUNT"),
    Option("gres", None, "required", "generic resources per node, e.g. --gres=gpu:a100:4"),
    Option("time", "t", "required",
           "the time limit: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM, D-HH:MM:SS or UNLIMITED"),
    Option("time-min", None, "required", "the least time limit the job accepts"),
    Option("partition", "p", "required", "the partition (trainyard queue), or a comma list of them"),
    Option("account", "A", "required", "the account (trainyard team) to charge"),
    Option("qos", "q", "required", "the quality of service"),
    Option("constraint", "C", "required", "node features, e.g. -C 'gpu&(a100|h100)'"),
    Option("exclusive", None, "optional", "whole nodes only (optionally =user, =mcs or =topo)"),
    Option("oversubscribe", "s", "none", "share nodes with other jobs"),
    Option("nodelist", "w", "required", "nodes the job must use, as a hostlist, e.g. gpu-[01-04]"),
    Option("exclude", "x", "required", "nodes the job must not use, as a hostlist"),
    Option("array", "a", "required", "a job array: indices like 0-15, 1,3,5 or 0-99:2, with %LIMIT"),
    Option("dependency", "d", "required", "dependencies, e.g. afterok:123:124 or singleton"),
    Option("output", "o", "required", "the file for the job's standard output (patterns %j %x %A %a ...)"),
    Option("error", "e", "required", "the file for the job's standard error (patterns %j %x %A %a ...)"),
    Option("input", "i", "required", "the file for the job's standard input"),
    Option("open-mode", None, "required", "append or truncate the output files"),
    Option("chdir", "D", "required", "the job's working directory"),
    Option("signal", None, "required", "[{R|B}:]SIG[@SECONDS]: signal the job before its time limit"),
    Option("requeue", None, "none", "the job may be requeued"),
    Option("no-requeue", None, "none", "the job must never be requeued"),
    Option("mail-type", None, "required", "events to mail about: BEGIN, END, FAIL, ALL, ..."),
    Option("mail-user", None, "required", "who gets the mail"),
    Option("export", None, "required", "environment to export: ALL, NONE, or [ALL,]VAR[=VALUE],..."),
    Option("hold", "H", "none", "submit the job held"),
    Option("begin", "b", "required", "start no earlier than this time, e.g. now+1hour or 16:00"),
    Option("comment", None, "required", "a comment on the job"),
    Option("wckey", None, "required", "the workload characterization key"),
    Option("reservation", None, "required", "the reservation to run in"),
    Option("nice", None, "optional", "lower the job's priority by N"),
    Option("priority", None, "required", "the job's priority"),
    Option("parsable", None, "none", "print only the job id"),
    Option("wait", "W", "none", "wait for the job to end"),
    Option("wrap", None, "required", "a command string to run as the batch script"),
    Option("verbose", "v", "none", "more messages"),
    Option("quiet", "Q", "none", "fewer messages"),
    Option("kill-on-invalid-dep", None, "required", "cancel when a dependency can never be met"),
    # read and recorded; Slurm's placement and binding details trainyard leaves to the node
    Option("hint", None, "required", "task binding hint, e.g. nomultithread"),
    Option("distribution", "m", "required", "task distribution, e.g. block:cyclic"),
    Option("ntasks-per-socket", None, "required", "tasks per socket"),
    Option("ntasks-per-core", None, "required", "tasks per core"),
    Option("ntasks-per-gpu", None, "required", "tasks per GPU"),
    Option("sockets-per-node", None, "required", "sockets per node"),
    Option("cores-per-socket", None, "required", "cores per socket"),
    Option("threads-per-core", None, "required", "threads per core"),
    Option("extra-node-info", "B", "required", "sockets:cores:threads"),
    Option("mem-bind", None, "required", "memory binding"),
    Option("cpu-bind", None, "required", "CPU binding"),
    Option("gpu-bind", None, "required", "GPU binding"),
    Option("gpu-freq", None, "required", "GPU frequency"),
    Option("cpu-freq", None, "required", "CPU frequency"),
    Option("gres-flags", None, "required", "GRES placement flags"),
    Option("tmp", None, "required", "temporary disk per node"),
    Option("licenses", "L", "required", "licenses"),
    Option("mincpus", None, "required", "minimum CPUs per node"),
    Option("contiguous", None, "none", "contiguous nodes"),
    Option("switches", None, "required", "maximum leaf switches"),
    Option("overcommit", "O", "none", "overcommit resources"),
    Option("no-kill", "k", "optional", "do not kill the job when a node fails"),
    Option("spread-job", None, "none", "spread the job over as many nodes as possible"),
    Option("use-min-nodes", None, "none", "prefer the smaller node count of a range"),
    Option("core-spec", "S", "required", "specialized cores"),
    Option("thread-spec", None, "required", "specialized threads"),
    Option("acctg-freq", None, "required", "accounting sampling intervals"),
    Option("profile", None, "required", "profiling"),
    Option("propagate", None, "optional", "resource limits to propagate"),
    Option("get-user-env", None, "optional", "load the user's login environment"),
    Option("wait-all-nodes", None, "required", "wait for all nodes to boot"),
    Option("reboot", None, "none", "reboot nodes first"),
    Option("network", None, "required", "network settings"),
    Option("clusters", "M", "required", "clusters"),
    Option("deadline", None, "required", "deadline"),
    Option("delay-boot", None, "required", "delay boot"),
    Option("mcs-label", None, "required", "MCS label"),
    Option("power", None, "required", "power management"),
    Option("prefer", None, "required", "preferred node features"),
    Option("container", None, "required", "OCI container bundle"),
    Option("uid", None, "required", "user to run as"),
    Option("gid", None, "required", "group to run as"),
    Option("umask", None, "required", "umask of the batch script"),
    Option("immediate", "I", "optional", "start now or fail"),
    Option("test-only", None, "none", "validate only"),
    Option("ignore-pbs", None, "none", "ignore #PBS lines"),
    Option("export-file", None, "required", "environment from a file"),
    Option("bb", None, "required", "burst buffer"),
    Option("bbf", None, "required", "burst buffer file"),
    Option("tres-per-task", None, "required", "trackable resources per task"),
    Option("tres-bind", None, "required", "trackable resource binding"),
    Option("segment", None, "required", "segment size"),
    Option("nodefile", "F", "required", "file with the node list"),
    Option("checkpoint", None, "required", "checkpoint interval (old Slurm)"),
    # options of widely deployed SPANK plugins: pyxis (NVIDIA containers) and shifter (NERSC)
    Option("container-image", None, "required", "pyxis: the container image"),
    Option("container-mounts", None, "required", "pyxis: bind mounts"),
    Option("container-workdir", None, "required", "pyxis: working directory in the container"),
    Option("container-name", None, "required", "pyxis: a named container"),
    Option("container-writable", None, "none", "pyxis: writable container"),
    Option("container-mount-home", None, "none", "pyxis: mount the home directory"),
    Option("no-container-mount-home", None, "none", "pyxis: do not mount the home directory"),
    Option("container-env", None, "required", "pyxis: environment kept from the host"),
    Option("container-remap-root", None, "none", "pyxis: run as root in the container"),
    Option("image", None, "required", "shifter: the container image"),
    Option("module", None, "required", "shifter: modules"),
]
OPTIONS = {o.long: o for o in _OPTIONS}
_SHORT = {o.short: o for o in _OPTIONS if o.short}
# Slurm's own second names for options (getopt_long matches prefixes of these too).
_ALIASES = {"tasks-per-node": "ntasks-per-node", "workdir": "chdir", "share": "oversubscribe"}

# Options that change nothing in trainyard (yet): read, checked, recorded, and named in the one
# warning line. Everything else is acted on or sent in the submit body.
# (--signal, --begin, --nodelist, --exclude, --mail-type and --mail-user are acted on: the
# time-limit warning and preemption signals, BeginTime, placement, notifications.)
NOT_ACTED_ON = frozenset({
    "qos", "wckey", "reservation", "time-min", "requeue", "no-requeue", "kill-on-invalid-dep", "oversubscribe",
    "hint", "distribution", "ntasks-per-socket", "ntasks-per-core", "ntasks-per-gpu",
    "sockets-per-node", "cores-per-socket", "threads-per-core", "extra-node-info", "mem-bind",
    "cpu-bind", "gpu-bind", "gpu-freq", "cpu-freq", "gres-flags", "tmp", "licenses", "mincpus",
    "contiguous", "switches", "overcommit", "no-kill", "spread-job", "use-min-nodes", "core-spec",
    "thread-spec", "acctg-freq", "profile", "propagate", "get-user-env", "wait-all-nodes",
    "reboot", "network", "clusters", "deadline", "delay-boot", "mcs-label", "power", "prefer",
    "container", "umask", "immediate", "export-file", "bb", "bbf", "tres-per-task", "tres-bind",
    "segment", "checkpoint", "priority", "container-name", "container-writable",
    "container-mount-home", "no-container-mount-home", "container-env", "container-remap-root",
    "module",
})
# Options that only change what the submitting command does, not the job.
CLIENT_ONLY = frozenset({"parsable", "wait", "verbose", "quiet", "test-only", "ignore-pbs", "wrap"})
# Options Slurm reads but trainyard cannot honour at all: refused with the reason.
REFUSED = {
    "uid": "trainyard runs a job as the user whose token submitted it; submit with that user's token",
    "gid": "trainyard runs a job with its owner's groups",
    "nodefile": "give the nodes with --nodelist HOSTLIST",
}


@dataclass(frozen=True)
class GpuRequest:
    count: int
    type: str | None = None


@dataclass(frozen=True)
class Signal:
    """--signal: send `number` `seconds` before the time limit; to the batch shell only if batch_only."""

    number: int
    name: str
    seconds: int = 60
    batch_only: bool = False
    reservation: bool = False  # R: also when a reservation ends

    def __str__(self) -> str:
        flags = ("B" if self.batch_only else "") + ("R" if self.reservation else "")
        return f"{flags + ':' if flags else ''}{self.name}@{self.seconds}"


@dataclass
class BatchSpec:
    """What one sbatch call asks for, in Slurm's terms, resolved to trainyard's allocation."""

    # the allocation (per node, as trainyard allocates)
    nodes: int = 1
    nodes_max: int | None = None
    ntasks: int = 1
    ntasks_per_node: int = 1
    cpus_per_task: int = 1
    cpus_per_node: int = 1
    mem_per_node_mb: int | None = None  # None: the cluster's default; 0: all of each node's memory
    gpus_per_node: int = 0
    gpu_type: str | None = None
    gpus_per_task: int | None = None
    time_limit_s: int | None = None  # None: the partition's default (UNLIMITED: the maximum)
    time_unlimited: bool = False
    exclusive: bool = False
    # identity and placement
    name: str | None = None
    partitions: list[str] = field(default_factory=list)
    account: str | None = None
    qos: str | None = None
    constraint: str | None = None
    nodelist: list[str] = field(default_factory=list)
    exclude: list[str] = field(default_factory=list)
    array: str | None = None
    dependency: str | None = None
    hold: bool = False
    begin: float | None = None
    nice: int | None = None
    # files and environment
    output: str = DEFAULT_OUTPUT
    error: str | None = None  # None: standard error goes to the output file
    input: str | None = None
    open_mode: str | None = None  # None: truncate (the cluster default)
    workdir: str = ""
    submit_dir: str = ""
    submit_host: str = ""
    export: str = "ALL"
    env: dict[str, str] = field(default_factory=dict)
    # the container (pyxis: --container-image, --container-mounts, --container-workdir)
    image: str | None = None
    container_mounts: list[str] = field(default_factory=list)
    container_workdir: str | None = None
    # recorded
    signal: Signal | None = None
    requeue: bool | None = None
    mail_type: list[str] = field(default_factory=list)
    mail_user: str | None = None
    comment: str | None = None
    wckey: str | None = None
    reservation: str | None = None
    wrap: str | None = None
    parsable: bool = False
    recorded: dict[str, str] = field(default_factory=dict)  # options with no trainyard effect
    origins: dict[str, Origin] = field(default_factory=dict)  # option -> where it was given
    notes: list[str] = field(default_factory=list)  # how a Slurm request was mapped

    @property
    def gpus_total(self) -> int:
        return self.gpus_per_node * self.nodes

    @property
    def partition(self) -> str | None:
        return self.partitions[0] if self.partitions else None

    def warning(self) -> str | None:
        """The one line naming the options trainyard records but does not act on, if any."""
        if not self.recorded:
            return None
        names = ", ".join(f"--{k}" for k in self.recorded)
        return f"sbatch: warning: recorded but not acted on by trainyard: {names}"

    def to_submit_body(self, script: str | None = None, command: list[str] | None = None) -> dict[str, Any]:
        """The JSON body of POST /v1/jobs; fields beyond today's API are listed in the README."""
        body: dict[str, Any] = {}
        if command is not None:
            body["command"] = command
        else:
            body["script"] = script if script is not None else _wrap_script(self.wrap or "")
        body.update({
            "name": self.name or "sbatch", "nodes": self.nodes, "gpus": self.gpus_per_node,
            "cpus": self.cpus_per_node, "ntasks": self.ntasks, "ntasks_per_node": self.ntasks_per_node,
            "cpus_per_task": self.cpus_per_task, "output": self.output, "workdir": self.workdir,
            "submit_dir": self.submit_dir, "submit_host": self.submit_host, "hold": self.hold,
            "exclusive": self.exclusive, "batch_step": True,
        })
        optional = {
            "gpu_type": self.gpu_type, "gpus_per_task": self.gpus_per_task,
            "mem": None if self.mem_per_node_mb is None else f"{self.mem_per_node_mb}M",
            "time_limit": self.time_limit_s, "queue": self.partition, "account": self.account,
            "qos": self.qos, "features": self.constraint, "array": self.array,
            "after": self.dependency, "error": self.error, "input": self.input,
            "open_mode": self.open_mode, "begin": self.begin, "nice": self.nice,
            "signal": str(self.signal) if self.signal else None, "requeue": self.requeue,
            "mail_user": self.mail_user, "comment": self.comment, "wckey": self.wckey,
            "reservation": self.reservation, "nodes_max": self.nodes_max, "image": self.image,
            "container_workdir": self.container_workdir,
        }
        body.update({k: v for k, v in optional.items() if v is not None})
        if self.time_unlimited:
            body["time_limit"] = "UNLIMITED"
        if self.nodelist:
            body["nodelist"] = self.nodelist
        if self.exclude:
            body["exclude"] = self.exclude
        if self.container_mounts:
            body["container_mounts"] = list(self.container_mounts)
        if self.mail_type:
            body["mail_type"] = self.mail_type
        if self.env:
            body["env"] = dict(self.env)
        if self.export != "ALL":
            body["export"] = self.export
        if self.recorded:
            body["recorded"] = dict(self.recorded)
        return body


def shifter_image(text: str) -> str:
    """Shifter's `--image=docker:REPOSITORY:TAG` as an image reference (`REPOSITORY:TAG`)."""
    return text[len("docker:"):] if text.startswith("docker:") else text


def _wrap_script(command: str) -> str:
    return f"#!/bin/sh\n# This script was generated by sbatch --wrap.\n\n{command}\n"


# ----------------------------------------------------------------------------- tokenizing
def split_directive(text: str) -> list[str]:
    """The arguments of one `#SBATCH` line: whitespace splits, quotes group, `#` ends the line."""
    args: list[str] = []
    current: list[str] = []
    quote: str | None = None
    started = False
    for ch in text:
        if quote:
            if ch == quote:
                quote = None
            else:
                current.append(ch)
        elif ch in "\"'":
            quote, started = ch, True
        elif ch.isspace():
            if started:
                args.append("".join(current))
                current, started = [], False
        elif ch == "#" and not started:
            break
        else:
            current.append(ch)
            started = True
    if started:
        args.append("".join(current))
    return args


def directive_lines(script: str) -> list[tuple[int, str, list[str]]]:
    """(line number, line, arguments) of each #SBATCH line before the first command."""
    out = []
    for lineno, raw in enumerate(script.splitlines(), 1):
        if raw.startswith(DIRECTIVE):
            out.append((lineno, raw.rstrip(), split_directive(raw[len(DIRECTIVE):])))
            continue
        stripped = raw.strip()
        if stripped and not stripped.startswith("#"):
            break
    return out


def _lookup_long(name: str, origin: Origin) -> Option:
    name = _ALIASES.get(name, name)
    if name in OPTIONS:
        return OPTIONS[name]
    names = {**{long: long for long in OPTIONS}, **_ALIASES}
    matches = list({id(OPTIONS[target]): OPTIONS[target] for long, target in names.items()
                    if long.startswith(name)}.values())
    if len(matches) == 1:
        return matches[0]
    if matches:
        names = ", ".join(f"--{o.long}" for o in matches)
        raise SbatchError(f"{origin}: option '--{name}' is ambiguous ({names})")
    raise SbatchError(f"{origin}: unrecognized option '--{name}'; `man sbatch` lists Slurm's options")


def getopt(args: list[str], origin: Origin) -> list[tuple[Option, str | None]]:
    """Slurm's getopt_long over one argument list (one #SBATCH line, or the command line)."""
    out: list[tuple[Option, str | None]] = []
    i = 0
    while i < len(args):
        arg = args[i]
        i += 1
        if arg.startswith("--") and len(arg) > 2:
            name, eq, value = arg[2:].partition("=")
            opt = _lookup_long(name, origin)
            if opt.arg == "none":
                if eq:
                    raise SbatchError(f"{origin}: option '--{opt.long}' doesn't allow an argument")
                out.append((opt, None))
            elif opt.arg == "optional":
                out.append((opt, value if eq else None))
            elif eq:
                out.append((opt, value))
            elif i < len(args):
                out.append((opt, args[i]))
                i += 1
            else:
                raise SbatchError(f"{origin}: option '--{opt.long}' requires an argument ({opt.meaning})")
        elif arg.startswith("-") and len(arg) > 1:
            j = 1
            while j < len(arg):
                letter = arg[j]
                opt = _SHORT.get(letter)
                if opt is None:
                    raise SbatchError(f"{origin}: invalid option -- '{letter}'")
                rest = arg[j + 1:]
                if opt.arg == "none":
                    out.append((opt, None))
                    j += 1
                    continue
                if opt.arg == "optional":
                    out.append((opt, rest or None))
                elif rest:
                    out.append((opt, rest.removeprefix("=")))
                elif i < len(args):
                    out.append((opt, args[i]))
                    i += 1
                else:
                    raise SbatchError(f"{origin}: option requires an argument -- '{letter}' ({opt.meaning})")
                break
        else:
            raise SbatchError(f"{origin}: {arg!r} is not an option; #SBATCH lines hold only options")
    return out


def split_argv(argv: list[str]) -> tuple[list[str], str | None, list[str]]:
    """sbatch's command line: (options, script path or None, the script's own arguments)."""
    i = 0
    while i < len(argv):
        arg = argv[i]
        if not arg.startswith("-") or arg == "-":
            return argv[:i], arg, argv[i + 1:]
        if arg.startswith("--"):
            name = arg[2:].partition("=")[0]
            opt = OPTIONS.get(_ALIASES.get(name, name))
            takes_next = opt is not None and opt.arg == "required" and "=" not in arg
        else:
            opt = _SHORT.get(arg[1:2])
            takes_next = opt is not None and opt.arg == "required" and len(arg) == 2
        i += 2 if takes_next else 1
    return argv, None, []


# ----------------------------------------------------------------------------- values
_INT = re.compile(r"\d+")
_NODES = re.compile(r"(\d+)(?:-(\d+))?")
_SLURM_TIME = re.compile(r"\d+(?:-\d+)?(?::\d+){0,2}")


def _refuse(origin: Origin, opt: Option, value: str | None, problem: str) -> SbatchError:
    shown = f"--{opt.long}" + (f"={value}" if value is not None else "")
    return SbatchError(f"{origin}: {shown}: {problem} (--{opt.long} is {opt.meaning})")


def _positive(origin: Origin, opt: Option, value: str, zero_ok: bool = False) -> int:
    if not _INT.fullmatch(value) or (int(value) == 0 and not zero_ok):
        raise _refuse(origin, opt, value, f"invalid numeric value {value!r}")
    return int(value)


def parse_gpu_count(text: str) -> GpuRequest:
    """'4', 'a100:4' or 'a100' (one GPU of that type), as --gpus and --gpus-per-node take them."""
    kind, sep, count = text.rpartition(":")
    if not sep:
        return GpuRequest(int(text)) if _INT.fullmatch(text) else GpuRequest(1, text or None)
    if not _INT.fullmatch(count):
        return GpuRequest(1, text)  # 'nvidia:a100' style: a type with a colon, count 1
    return GpuRequest(int(count), kind or None)


def parse_gres(text: str) -> tuple[GpuRequest | None, list[str]]:
    """--gres=gpu[:TYPE][:COUNT][,other...]: the GPU request and the other resources named."""
    gpu: GpuRequest | None = None
    others = []
    for item in text.split(","):
        item = item.strip().split("(", 1)[0]  # gpu:2(S:0-1) socket hints
        if not item or item.lower() == "none":
            continue
        name, _, rest = item.partition(":")
        if name != "gpu":
            others.append(item)
            continue
        gpu = parse_gpu_count(rest) if rest else GpuRequest(1)
    return gpu, others


def parse_time_limit(text: str) -> int | None:
    """Slurm's time limit in seconds, rounded up to whole minutes; None for UNLIMITED/INFINITE."""
    value = text.strip()
    if value.upper() in ("UNLIMITED", "INFINITE", "-1"):
        return None
    if not _SLURM_TIME.fullmatch(value):
        raise ValueError(f"invalid time limit {text!r}")
    seconds = parse_duration(value, "time")
    if seconds == 0:
        return None  # Slurm: a time limit of zero means no limit
    return int(math.ceil(seconds / 60) * 60)


def parse_signal(text: str) -> Signal:
    """[{R|B}:]SIG[@SECONDS], SIG a name (USR1, SIGUSR1) or a number; 60 seconds by default."""
    flags, sep, rest = text.partition(":")
    if not sep:
        flags, rest = "", text
    if set(flags.upper()) - {"R", "B"}:
        raise ValueError(f"invalid signal flags {flags!r}; use B (batch shell only) or R")
    sig, at, seconds = rest.partition("@")
    if sig.isdigit():
        number = int(sig)
        try:
            name = _signal.Signals(number).name.removeprefix("SIG")
        except ValueError:
            raise ValueError(f"invalid signal number {sig!r}") from None
    else:
        name = sig.upper().removeprefix("SIG")
        try:
            number = int(_signal.Signals[f"SIG{name}"])
        except KeyError:
            raise ValueError(f"invalid signal name {sig!r}") from None
    if at and (not _INT.fullmatch(seconds) or int(seconds) > 65535):
        raise ValueError(f"invalid signal time {seconds!r}; use 0-65535 seconds")
    return Signal(number, name, int(seconds) if at else 60, "B" in flags.upper(), "R" in flags.upper())


_RELATIVE = re.compile(r"now(?:\+(\d+)(seconds?|minutes?|hours?|days?|weeks?)?)?", re.IGNORECASE)
_UNIT_S = {"second": 1, "minute": 60, "hour": 3600, "day": 86400, "week": 604800}


def parse_begin(text: str, now: float) -> float:
    """--begin: now+N[units], HH:MM[:SS], YYYY-MM-DD[THH:MM[:SS]], midnight, noon, teatime,
    today, tomorrow, as an epoch time (local time zone, as Slurm reads it)."""
    value = text.strip()
    base = datetime.fromtimestamp(now)
    if m := _RELATIVE.fullmatch(value):
        count, unit = m.groups()
        return now + int(count or 0) * _UNIT_S[(unit or "seconds").lower().rstrip("s")]
    words = {"midnight": (0, 0), "noon": (12, 0), "fika": (15, 0), "teatime": (16, 0)}
    if value.lower() in words:
        h, mi = words[value.lower()]
        t = base.replace(hour=h, minute=mi, second=0, microsecond=0)
        return (t if t > base else t + timedelta(days=1)).timestamp()
    if value.lower() in ("today", "tomorrow"):
        day = base.replace(hour=0, minute=0, second=0, microsecond=0)
        return (day + timedelta(days=1 if value.lower() == "tomorrow" else 0)).timestamp()
    for fmt in ("%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M", "%Y-%m-%d"):
        try:
            return datetime.strptime(value, fmt).timestamp()
        except ValueError:
            pass
    for fmt in ("%H:%M:%S", "%H:%M"):
        try:
            t = datetime.strptime(value, fmt)
        except ValueError:
            continue
        at = base.replace(hour=t.hour, minute=t.minute, second=t.second, microsecond=0)
        return (at if at > base else at + timedelta(days=1)).timestamp()
    raise ValueError(f"invalid time specification {text!r}; use e.g. now+1hour, 16:00 or "
                     "2025-01-31T08:00:00")


def parse_export(text: str) -> tuple[str, dict[str, str]]:
    """--export: ('ALL'|'NONE'|'NIL'|'VARS', {VAR: VALUE} set explicitly)."""
    mode, env, names = "VARS", {}, []
    for item in text.split(","):
        item = item.strip()
        if item.upper() in ("ALL", "NONE", "NIL"):
            mode = item.upper()
        elif "=" in item:
            k, _, v = item.partition("=")
            env[k] = v
        elif item:
            names.append(item)
    if mode == "VARS" and not names and env:
        mode = "NONE"  # only VAR=VALUE given: Slurm exports just those (plus SLURM_*)
    return (mode if not names else f"{mode}:{','.join(names)}"), env


# ----------------------------------------------------------------------------- building
class _Request:
    """The raw option values, last one winning, before they are resolved to an allocation."""

    def __init__(self) -> None:
        self.values: dict[str, tuple[str | None, Origin]] = {}
        self.mail_types: list[str] = []

    def set(self, opt: Option, value: str | None, origin: Origin) -> None:
        if opt.long == "requeue":
            self.values.pop("no-requeue", None)
        if opt.long == "no-requeue":
            self.values.pop("requeue", None)
        self.values[opt.long] = (value, origin)


def _check(opt: Option, value: str | None, origin: Origin, now: float) -> None:
    """Refuse a value Slurm itself refuses, at the line that gave it."""
    long = opt.long
    if long in REFUSED:
        raise _refuse(origin, opt, value, f"not supported: {REFUSED[long]}")
    try:
        if long == "nodes":
            if not _NODES.fullmatch(value or "") or int(_NODES.fullmatch(value).group(1)) == 0:
                raise _refuse(origin, opt, value, f"invalid node count {value!r}")
        elif long in ("ntasks", "ntasks-per-node", "cpus-per-task", "cpus-per-gpu", "mincpus"):
            _positive(origin, opt, value or "")
        elif long in ("mem", "mem-per-cpu", "mem-per-gpu", "tmp"):
            parse_mem(value or "", long)
        elif long in ("gpus", "gpus-per-node", "gpus-per-task"):
            req = parse_gpu_count(value or "")
            if req.count == 0 and long != "gpus":
                raise _refuse(origin, opt, value, "the GPU count must be at least 1")
        elif long in ("time", "time-min"):
            parse_time_limit(value or "")
        elif long == "constraint":
            parse_constraint(value or "")
        elif long in ("nodelist", "exclude"):
            if "/" in (value or ""):
                raise _refuse(origin, opt, value, "node files are not supported; give a hostlist")
            expand(value or "")
        elif long == "exclusive" and value is not None and value.lower() not in ("user", "mcs", "topo"):
            raise _refuse(origin, opt, value, f"invalid exclusive option {value!r}; use user, mcs or topo")
        elif long == "signal":
            parse_signal(value or "")
        elif long == "begin":
            parse_begin(value or "", now)
        elif long == "mail-type":
            bad = [t for t in (value or "").upper().split(",") if t not in MAIL_TYPES]
            if bad:
                raise _refuse(origin, opt, value, f"invalid mail type {', '.join(bad)}; use "
                                                  "BEGIN, END, FAIL, REQUEUE, ALL, TIME_LIMIT_90 ...")
        elif long == "open-mode" and (value or " ")[0].lower() not in "at":
            raise _refuse(origin, opt, value, "use append or truncate")
        elif long == "array":
            from ..planner.arrays import parse_array

            parse_array(value or "")
        elif long == "nice" and value is not None and not re.fullmatch(r"[+-]?\d+", value):
            raise _refuse(origin, opt, value, f"invalid nice value {value!r}")
        elif long == "chdir" and not value:
            raise _refuse(origin, opt, value, "the directory must not be empty")
        elif long in ("container-image", "image"):
            parse_image(shifter_image(value or "") if long == "image" else value or "")
        elif long == "container-mounts":
            parse_mounts(value or "")
        elif long == "container-workdir" and not (value or "").startswith("/"):
            raise _refuse(origin, opt, value, "give an absolute path inside the image, e.g. /workspace")
    except (UnitError, ValueError, ConstraintError, HostlistError, ContainerError) as e:
        if isinstance(e, SbatchError):
            raise
        raise _refuse(origin, opt, value, str(e)) from None


def parse(script: str | None = None, argv: list[str] | tuple[str, ...] = (), *,
          submit_dir: str | None = None, submit_host: str | None = None, now: float | None = None,
          default_name: str | None = None) -> BatchSpec:
    """Read a batch script's #SBATCH lines, then `argv` (options only), into a BatchSpec."""
    now = _time.time() if now is None else now
    req = _Request()
    for lineno, line, args in directive_lines(script or ""):
        origin = Origin(lineno, line)
        for opt, value in getopt(args, origin):
            _check(opt, value, origin, now)
            req.set(opt, value, origin)
    for opt, value in getopt(list(argv), Origin(None, "")):
        origin = Origin(None, f"--{opt.long}" + (f"={value}" if value is not None else ""))
        _check(opt, value, origin, now)
        req.set(opt, value, origin)
    spec = resolve(req, submit_dir=submit_dir or os.getcwd(),
                   submit_host=submit_host or socket.gethostname(), now=now)
    if spec.name is None:
        spec.name = default_name or ("wrap" if spec.wrap else "sbatch")
    return spec


def resolve(req: _Request, *, submit_dir: str, submit_host: str, now: float) -> BatchSpec:
    """Slurm's meaning of the options together: tasks, CPUs, memory and GPUs per node."""
    v = {k: val for k, (val, _o) in req.values.items()}
    spec = BatchSpec(submit_dir=submit_dir, submit_host=submit_host)
    spec.origins = {k: o for k, (_v, o) in req.values.items()}

    def refuse(a: str, b: str, why: str) -> SbatchError:
        return SbatchError(f"{spec.origins[a]} and {spec.origins[b]}: {why}")

    mems = [k for k in ("mem", "mem-per-cpu", "mem-per-gpu") if k in v]
    if len(mems) > 1:
        raise refuse(mems[0], mems[1], "--mem, --mem-per-cpu, and --mem-per-gpu are mutually exclusive")

    # nodes and tasks
    nodes_given = "nodes" in v
    if nodes_given:
        m = _NODES.fullmatch(v["nodes"])
        spec.nodes = int(m.group(1))
        spec.nodes_max = int(m.group(2)) if m.group(2) else None
        if spec.nodes_max is not None and spec.nodes_max < spec.nodes:
            raise SbatchError(f"{spec.origins['nodes']}: the maximum node count is below the minimum")
        if spec.nodes_max == spec.nodes:
            spec.nodes_max = None
        elif spec.nodes_max is not None:
            spec.notes.append(f"--nodes={v['nodes']}: trainyard allocates the minimum, {spec.nodes}")
    ntasks = int(v["ntasks"]) if "ntasks" in v else None
    per_node = int(v["ntasks-per-node"]) if "ntasks-per-node" in v else None
    if not nodes_given and ntasks and per_node:
        spec.nodes = math.ceil(ntasks / per_node)
    if per_node is not None:
        spec.ntasks_per_node = per_node
        spec.ntasks = ntasks if ntasks is not None else per_node * spec.nodes
        if ntasks is not None and ntasks > per_node * spec.nodes:
            raise refuse("ntasks", "ntasks-per-node",
                         f"{ntasks} tasks do not fit {spec.nodes} node(s) x {per_node} tasks per node")
    elif ntasks is not None:
        if ntasks < spec.nodes:
            spec.notes.append(f"--ntasks={ntasks} is fewer than {spec.nodes} nodes: one task per node")
            ntasks = spec.nodes
        spec.ntasks = ntasks
        spec.ntasks_per_node = math.ceil(ntasks / spec.nodes)
    else:
        spec.ntasks, spec.ntasks_per_node = spec.nodes, 1

    # GPUs: per node, whichever form asked for them
    gpu_sources = [k for k in ("gpus", "gpus-per-node", "gpus-per-task", "gres") if k in v]
    gpu: GpuRequest | None = None
    for key in gpu_sources:
        if key == "gres":
            req_gpu, others = parse_gres(v["gres"])
            if others:
                spec.recorded["gres"] = ",".join(others)
            if req_gpu is None:
                continue
            per = req_gpu
        else:
            per = parse_gpu_count(v[key])
        if key == "gpus":
            if per.count and per.count < spec.nodes:
                raise SbatchError(f"{spec.origins['gpus']}: {per.count} GPUs cannot cover {spec.nodes} nodes")
            count = math.ceil(per.count / spec.nodes) if per.count else 0
            if per.count % spec.nodes:
                spec.notes.append(f"--gpus={v['gpus']} over {spec.nodes} nodes: {count} per node")
        elif key == "gpus-per-task":
            spec.gpus_per_task = per.count
            count = per.count * spec.ntasks_per_node
        else:
            count = per.count
        if gpu is not None and key != gpu_sources[0]:
            spec.notes.append(f"--{key} and --{gpu_sources[0]} both ask for GPUs: the larger count wins")
            count = max(count, gpu.count)
        gpu = GpuRequest(count, per.type or (gpu.type if gpu else None))
    if gpu is not None:
        spec.gpus_per_node, spec.gpu_type = gpu.count, gpu.type

    # CPUs and memory per node
    spec.cpus_per_task = int(v["cpus-per-task"]) if "cpus-per-task" in v else 1
    spec.cpus_per_node = spec.cpus_per_task * spec.ntasks_per_node
    if "cpus-per-gpu" in v and spec.gpus_per_node:
        spec.cpus_per_node = max(spec.cpus_per_node, int(v["cpus-per-gpu"]) * spec.gpus_per_node)
    if "mem" in v:
        spec.mem_per_node_mb = parse_mem(v["mem"], "mem")
    elif "mem-per-cpu" in v:
        spec.mem_per_node_mb = parse_mem(v["mem-per-cpu"], "mem-per-cpu") * spec.cpus_per_node
    elif "mem-per-gpu" in v:
        if not spec.gpus_per_node:
            raise SbatchError(f"{spec.origins['mem-per-gpu']}: --mem-per-gpu needs GPUs "
                              "(--gpus, --gpus-per-node or --gres=gpu:N)")
        spec.mem_per_node_mb = parse_mem(v["mem-per-gpu"], "mem-per-gpu") * spec.gpus_per_node

    if "time" in v:
        spec.time_limit_s = parse_time_limit(v["time"])
        spec.time_unlimited = spec.time_limit_s is None
    spec.exclusive = "exclusive" in v and v["exclusive"] is None
    if v.get("exclusive"):  # =user, =mcs, =topo: sharing rules trainyard does not have
        spec.recorded["exclusive"] = v["exclusive"]
    spec.name = v.get("job-name")
    if "partition" in v:
        spec.partitions = [p for p in v["partition"].split(",") if p]
        if len(spec.partitions) > 1:
            spec.notes.append(f"--partition={v['partition']}: trainyard submits to the first, "
                              f"{spec.partitions[0]}")
    spec.account, spec.qos = v.get("account"), v.get("qos")
    if "constraint" in v:
        c = parse_constraint(v["constraint"])
        spec.constraint = str(c)
        if c.counts_dropped:
            spec.notes.append(f"node counts in --constraint are not enforced: {', '.join(c.counts_dropped)}")
    spec.nodelist = expand(v["nodelist"]) if "nodelist" in v else []
    spec.exclude = expand(v["exclude"]) if "exclude" in v else []
    spec.array = v.get("array")
    spec.dependency = v.get("dependency")
    spec.hold = "hold" in v
    spec.begin = parse_begin(v["begin"], now) if "begin" in v else None
    if "nice" in v:
        spec.nice = int(v["nice"]) if v["nice"] is not None else 100
    # files
    spec.output = v.get("output") or (DEFAULT_ARRAY_OUTPUT if spec.array else DEFAULT_OUTPUT)
    spec.error = v.get("error")
    spec.input = v.get("input")
    if "open-mode" in v:
        spec.open_mode = "append" if v["open-mode"][0].lower() == "a" else "truncate"
    workdir = v.get("chdir") or submit_dir
    spec.workdir = workdir if workdir.startswith("/") else os.path.normpath(os.path.join(submit_dir, workdir))
    if "export" in v:
        spec.export, spec.env = parse_export(v["export"])
    # the container
    images = [k for k in ("container-image", "image") if k in v]
    if len(images) > 1 and v["container-image"] != shifter_image(v["image"]):
        raise refuse("container-image", "image", "two different images; give one")
    if images:
        spec.image = v["container-image"] if "container-image" in v else shifter_image(v["image"])
    elif "container-mounts" in v or "container-workdir" in v:
        given = "container-mounts" if "container-mounts" in v else "container-workdir"
        raise SbatchError(f"{spec.origins[given]}: --{given} needs an image to run in; add "
                          "#SBATCH --container-image=IMAGE")
    spec.container_mounts = [m for m in (v.get("container-mounts") or "").split(",") if m]
    spec.container_workdir = v.get("container-workdir")
    # recorded
    spec.signal = parse_signal(v["signal"]) if "signal" in v else None
    spec.requeue = True if "requeue" in v else False if "no-requeue" in v else None
    spec.mail_type = (v["mail-type"] or "").upper().split(",") if "mail-type" in v else []
    spec.mail_user = v.get("mail-user")
    spec.comment, spec.wckey, spec.reservation = v.get("comment"), v.get("wckey"), v.get("reservation")
    spec.wrap, spec.parsable = v.get("wrap"), "parsable" in v
    for key, value in v.items():
        if key in NOT_ACTED_ON:
            spec.recorded[key] = "" if value is None else value
    return spec
