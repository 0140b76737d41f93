"""Slurm's commands for people (sbatch, squeue, scancel, sacct) as clients of trainyard's API.

Each is a click command, reachable as `trainyard slurm squeue ...` and as a standalone entry
point (`ty-squeue`, ...), so that installing trainyard never shadows a real Slurm on the host.
Output formats are Slurm's defaults, so scripts that parse squeue and sacct keep working.
"""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import click

from .hostlist import compress

EXIT_REFUSED, EXIT_USAGE, EXIT_UNREACHABLE = 1, 2, 3

# trainyard's job states (today's and Slurm's words) -> squeue's compact codes
STATE_CODES = {
    "PENDING": "PD", "HELD": "PD", "STARTING": "CF", "CONFIGURING": "CF", "RUNNING": "R",
    "COMPLETING": "CG", "COMPLETED": "CD", "FAILED": "F", "CANCELLED": "CA", "TIMEOUT": "TO",
    "PREEMPTED": "PR", "NODE_FAIL": "NF", "OUT_OF_MEMORY": "OOM",
}
SLURM_STATE = {"HELD": "PENDING", "STARTING": "CONFIGURING"}  # today's words in Slurm's
ACTIVE = {"PENDING", "HELD", "STARTING", "CONFIGURING", "RUNNING", "COMPLETING"}
SQUEUE_DEFAULT = "%.18i %.9P %.8j %.8u %.2t %.10M %.6D %R"
SACCT_DEFAULT = "JobID,JobName,Partition,Account,AllocCPUS,State,ExitCode"


def _client():
    from ..client import Client, NotConfigured

    try:
        return Client.from_env()
    except NotConfigured as e:
        _fail(str(e), EXIT_UNREACHABLE)


def _fail(message: str, code: int = EXIT_REFUSED, prog: str = "slurm") -> None:
    click.echo(f"{prog}: error: {message}", err=True)
    sys.exit(code)


def _call(fn: Callable, *args, prog: str = "slurm", **kwargs):
    from ..client import ApiError, Unreachable

    try:
        return fn(*args, **kwargs)
    except ApiError as e:
        _fail(e.detail, EXIT_REFUSED, prog)
    except Unreachable as e:
        _fail(str(e), EXIT_UNREACHABLE, prog)


def slurm_state(job: dict) -> str:
    return SLURM_STATE.get(job["state"], job["state"])


def reason(job: dict) -> str:
    if job["state"] == "HELD":
        return job.get("reason") or "JobHeldUser"
    return job.get("reason") or "None"


def _duration(seconds: float | None) -> str:
    from ..units import format_duration

    return format_duration(seconds) if seconds is not None else "0:00"


def _nodelist(job: dict) -> str:
    return compress([a["node"] for a in job.get("allocation") or []])


# ----------------------------------------------------------------------------- squeue
_FIELD = re.compile(r"%(\.)?(-)?(\d*)([a-zA-Z])")


def _squeue_value(job: dict, letter: str, now: float) -> str:
    used = ((job.get("end_time") or now) - job["start_time"]) if job.get("start_time") else 0
    gpus = job.get("gpus") or 0
    values = {
        "i": job["id"], "A": job.get("array_job_id") or job["id"], "a": job.get("account") or "",
        "P": job.get("queue", ""), "j": job.get("name", ""), "u": job.get("user", ""),
        "t": STATE_CODES.get(job["state"], job["state"]), "T": slurm_state(job),
        "M": _duration(used), "l": _duration(job.get("time_limit")) if job.get("time_limit") else "UNLIMITED",
        "D": job.get("nodes", 1), "C": (job.get("cpus") or 1) * (job.get("nodes") or 1),
        "b": f"gpu:{gpus}" if gpus else "N/A", "N": _nodelist(job), "r": reason(job),
        "R": _nodelist(job) if job.get("allocation") else f"({reason(job)})",
        "Q": job.get("priority", 0), "V": _iso(job.get("submit_time")), "S": _iso(job.get("start_time")),
        "e": _iso(job.get("end_time")),
    }
    return str(values.get(letter, ""))


def _iso(ts: float | None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(ts)) if ts else "N/A"


def format_squeue(jobs: list[dict], fmt: str, header: bool, now: float) -> list[str]:
    """Lines of squeue output for a -o/--format string, in Slurm's field syntax (%.18i ...)."""
    headers = {"i": "JOBID", "A": "ARRAY_JOB_ID", "a": "ACCOUNT", "P": "PARTITION", "j": "NAME",
               "u": "USER", "t": "ST", "T": "STATE", "M": "TIME", "l": "TIME_LIMIT", "D": "NODES",
               "C": "CPUS", "b": "TRES_PER_NODE", "N": "NODELIST", "r": "REASON",
               "R": "NODELIST(REASON)", "Q": "PRIORITY", "V": "SUBMIT_TIME", "S": "START_TIME",
               "e": "END_TIME"}

    def render(value_of: Callable[[str], str]) -> str:
        def one(m: re.Match) -> str:
            right, _left, width, letter = m.groups()
            text = value_of(letter)
            if width:
                w = int(width)
                text = text[:w]
                text = text.rjust(w) if right else text.ljust(w)
            return text

        return _FIELD.sub(one, fmt).rstrip()

    lines = [render(lambda letter: headers.get(letter, letter.upper()))] if header else []
    lines += [render(lambda letter, j=j: _squeue_value(j, letter, now)) for j in jobs]
    return lines


def _states(text: str | None) -> set[str] | None:
    if not text:
        return None
    by_code = {v: k for k, v in STATE_CODES.items()}
    out: set[str] = set()
    for item in text.upper().split(","):
        state = by_code.get(item, item)
        out.add(state)
        out.update(k for k, v in SLURM_STATE.items() if v == state)
    return out


@click.command("squeue", context_settings={"help_option_names": ["--help"]})
@click.option("-o", "--format", "fmt", default=SQUEUE_DEFAULT, show_default=True, help="Output format.")
@click.option("--me", is_flag=True, help="Only my jobs.")
@click.option("-u", "--user", "users", help="Only these users' jobs (comma list).")
@click.option("-t", "--states", help="Only these states (PD,R,... or PENDING,RUNNING,...; ALL).")
@click.option("-j", "--jobs", "job_ids", help="Only these job ids (comma list).")
@click.option("-p", "--partition", help="Only these partitions (comma list).")
@click.option("-h", "--noheader", is_flag=True, help="No header line.")
def squeue(fmt, me, users, states, job_ids, partition, noheader):
    """Jobs in the queue, in squeue's format and state codes."""
    c = _client()
    wanted_states = _states(states)
    all_states = wanted_states is not None and ("ALL" in wanted_states or not wanted_states <= ACTIVE)
    jobs = _call(c.jobs, all=all_states or bool(job_ids), prog="squeue")
    if me:
        me_user = _call(c.me, prog="squeue")["user"]
        jobs = [j for j in jobs if j["user"] == me_user]
    if users:
        jobs = [j for j in jobs if j["user"] in users.split(",")]
    if wanted_states and "ALL" not in wanted_states:
        jobs = [j for j in jobs if j["state"] in wanted_states]
    elif not job_ids and wanted_states is None:
        jobs = [j for j in jobs if j["state"] in ACTIVE]
    if job_ids:
        ids = {int(x) for x in job_ids.split(",") if x.strip().isdigit()}
        jobs = [j for j in jobs if j["id"] in ids or j.get("array_job_id") in ids]
    if partition:
        jobs = [j for j in jobs if j.get("queue") in partition.split(",")]
    for line in format_squeue(jobs, fmt, not noheader, time.time()):
        click.echo(line)


# ----------------------------------------------------------------------------- scancel
@click.command("scancel", context_settings={"help_option_names": ["--help"]})
@click.argument("job_ids", nargs=-1, required=True)
def scancel(job_ids):
    """Cancel jobs (silent on success, as scancel is)."""
    from ..client import ApiError

    c = _client()
    failed = False
    for raw in job_ids:
        job_id = raw.split("_", 1)[0]
        if not job_id.isdigit():
            _fail(f"Invalid job id {raw}", EXIT_USAGE, "scancel")
        try:
            c.cancel(int(job_id))
        except ApiError as e:
            click.echo(f"scancel: error: Kill job error on job id {raw}: {e.detail}", err=True)
            failed = True
    if failed:
        sys.exit(EXIT_REFUSED)


# ----------------------------------------------------------------------------- sbatch
def _api_fields(url: str) -> set[str] | None:
    """The job submit fields the daemon declares in its OpenAPI schema (None if it cannot tell)."""
    import httpx

    try:
        schema = httpx.get(f"{url.rstrip('/')}/openapi.json", timeout=10).json()
        for name, model in schema.get("components", {}).get("schemas", {}).items():
            if name == "JobSubmit":
                return set(model.get("properties", {}))
    except (httpx.HTTPError, ValueError):
        return None
    return None


@click.command("sbatch", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False,
                                           "help_option_names": ["--help"]})
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def sbatch(args):
    """Submit a batch script with Slurm's options: `sbatch [OPTIONS] SCRIPT [ARGS...]`."""
    from .sbatch import SbatchError, parse, split_argv

    options, script_path, _script_args = split_argv(list(args))
    text = None
    if script_path is not None:
        try:
            text = Path(script_path).read_text()
        except OSError as e:
            _fail(f"Unable to open file {script_path}: {e.strerror}", EXIT_USAGE, "sbatch")
    try:
        spec = parse(text, options, default_name=Path(script_path).name if script_path else None)
    except SbatchError as e:
        _fail(str(e), EXIT_USAGE, "sbatch")
    if text is None and not spec.wrap:
        _fail("a batch script is required: `sbatch [OPTIONS] SCRIPT` or --wrap=COMMAND", EXIT_USAGE, "sbatch")
    if text is not None and not text.startswith("#!"):
        _fail("This does not look like a batch script.  The first line must start with #! followed by "
              "the path to an interpreter.", EXIT_USAGE, "sbatch")
    if spec.warning():
        click.echo(spec.warning(), err=True)
    c = _client()
    body = spec.to_submit_body(text)
    known = _api_fields(c.url)
    if known is not None:
        dropped = sorted(k for k in body if k not in known)
        if dropped:
            click.echo(f"sbatch: warning: this daemon does not take yet: {', '.join(dropped)}", err=True)
            body = {k: v for k, v in body.items() if k in known}
    job = _call(c.submit, body, prog="sbatch")
    click.echo(str(job["id"]) if spec.parsable else f"Submitted batch job {job['id']}")


# ----------------------------------------------------------------------------- sacct
def _sacct_value(job: dict, field: str) -> str:
    exit_code = job.get("exit_code")
    values = {
        "jobid": job["id"], "jobname": job.get("name", ""), "partition": job.get("queue", ""),
        "account": job.get("account") or "", "alloccpus": (job.get("cpus") or 1) * (job.get("nodes") or 1),
        "state": slurm_state(job), "exitcode": f"{exit_code if exit_code is not None else 0}:0",
        "user": job.get("user", ""), "nnodes": job.get("nodes", 1), "nodelist": _nodelist(job) or "None assigned",
        "submit": _iso(job.get("submit_time")), "start": _iso(job.get("start_time")) if job.get("start_time")
        else "Unknown", "end": _iso(job.get("end_time")) if job.get("end_time") else "Unknown",
        "elapsed": _duration(((job.get("end_time") or time.time()) - job["start_time"])
                             if job.get("start_time") else 0),
        "timelimit": _duration(job.get("time_limit")) if job.get("time_limit") else "UNLIMITED",
        "reqmem": f"{job.get('mem') or 0}M", "allocgres": f"gpu:{job.get('gpus') or 0}",
        "reason": reason(job),
    }
    return str(values.get(field.lower(), ""))


def _when(text: str) -> float:
    from datetime import datetime

    for fmt in ("%Y-%m-%dT%H:%M:%S", "%Y-%m-%dT%H:%M", "%Y-%m-%d", "%m/%d/%y"):
        try:
            return datetime.strptime(text, fmt).timestamp()
        except ValueError:
            pass
    raise click.BadParameter(f"{text!r} is not a time; use YYYY-MM-DD[THH:MM[:SS]]")


@click.command("sacct", context_settings={"help_option_names": ["--help"]})
@click.option("-o", "--format", "fields", default=SACCT_DEFAULT, show_default=True, help="Fields, comma list.")
@click.option("-j", "--jobs", "job_ids", help="Only these job ids.")
@click.option("-S", "--starttime", help="Jobs that ended after this time [default: 00:00 today].")
@click.option("-E", "--endtime", help="Jobs that started before this time.")
@click.option("-p", "--parsable", is_flag=True, help="'|' between fields and at the end of each line.")
@click.option("-P", "--parsable2", is_flag=True, help="'|' between fields.")
@click.option("-n", "--noheader", is_flag=True, help="No header.")
@click.option("-u", "--user", "users", help="Only these users.")
def sacct(fields, job_ids, starttime, endtime, parsable, parsable2, noheader, users):
    """Accounting of jobs, in sacct's fields and layout."""
    c = _client()
    jobs = sorted(_call(c.jobs, all=True, prog="sacct"), key=lambda j: j["id"])
    if job_ids:
        ids = {int(x.split("_")[0]) for x in job_ids.split(",") if x.split("_")[0].isdigit()}
        jobs = [j for j in jobs if j["id"] in ids or j.get("array_job_id") in ids]
    else:
        since = _when(starttime) if starttime else time.mktime(time.localtime()[:3] + (0, 0, 0, 0, 0, -1))
        jobs = [j for j in jobs if (j.get("end_time") or time.time()) >= since]
    if endtime:
        until = _when(endtime)
        jobs = [j for j in jobs if (j.get("start_time") or j.get("submit_time") or 0) <= until]
    if users:
        jobs = [j for j in jobs if j["user"] in users.split(",")]
    names = [f.strip() for f in fields.split(",") if f.strip()]
    widths = [int(n.split("%")[1]) if "%" in n else 10 for n in names]
    names = [n.split("%")[0] for n in names]
    rows = [[_sacct_value(j, n) for n in names] for j in jobs]
    if parsable or parsable2:
        end = "|" if parsable else ""
        if not noheader:
            click.echo("|".join(names) + end)
        for r in rows:
            click.echo("|".join(r) + end)
        return
    if not noheader:
        click.echo(" ".join(n[:w].rjust(w) for n, w in zip(names, widths, strict=True)))
        click.echo(" ".join("-" * w for w in widths))
    for r in rows:
        click.echo(" ".join(v[:w - 1] + "+" if len(v) > w else v.rjust(w) for v, w in zip(r, widths, strict=True)))


@click.group("slurm")
def slurm():
    """Slurm's commands, speaking to trainyard: sbatch, squeue, scancel, sacct."""


for _cmd in (sbatch, squeue, scancel, sacct):
    slurm.add_command(_cmd)


def main() -> None:
    """Entry point of `ty-<command>`: the command named by the program's name."""
    prog = os.path.basename(sys.argv[0]).removeprefix("ty-")
    command = slurm.commands.get(prog)
    if command is None:
        _fail(f"unknown command {prog!r}; use one of {', '.join(sorted(slurm.commands))}", EXIT_USAGE)
    command(prog_name=prog)
