"""Slurm's commands for people (sbatch, squeue, scancel, sacct; sinfo and scontrol live beside)
as clients of trainyard's API.

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

from . import sacct_fields
from .api import (
    ACTIVE,
    DAEMON_STATES,
    EXIT_REFUSED,
    EXIT_USAGE,
    SLURM_STATE,
    STATE_CODES,
    JobRefs,
    api_fields,
    call,
    client,
    fail,
    iso,
    job_refs,
    job_refs_option,
    nodelist,
    reason,
    refs_jobs,
    resolve_jobs,
    slurm_state,
    squeue_time,
    when,
)
from .hostlist import expand
from .interactive import salloc, srun
from .scontrol import scontrol
from .sdiag import sdiag
from .sinfo import sinfo

SQUEUE_DEFAULT = "%.18i %.9P %.8j %.8u %.2t %.10M %.6D %R"
SQUEUE_LONG = "%.18i %.9P %.8j %.8u %.8T %.10M %.9l %.6D %R"
SQUEUE_START = "%.18i %.9P %.8j %.8u %.2t %.19S %.6D %20Y %R"
# squeue -O/--Format's field names -> -o's letters
FORMAT_FIELDS = {
    "jobid": "i", "jobarrayid": "i", "arrayjobid": "F", "arraytaskid": "K", "partition": "P", "name": "j",
    "username": "u", "statecompact": "t", "state": "T", "timeused": "M", "timelimit": "l", "numnodes": "D",
    "numcpus": "C", "nodelist": "N", "reason": "r", "reasonlist": "R", "priority": "Q", "submittime": "V",
    "starttime": "S", "endtime": "e", "account": "a", "tres-per-node": "b", "schednodes": "Y",
}


# ----------------------------------------------------------------------------- squeue
_FIELD = re.compile(r"%(\.)?(-)?(\d*)([a-zA-Z])")


def _squeue_value(job: dict, letter: str, now: float) -> str:
    used = ((job.get("end_time") or now) - job["start_time"]) if job.get("start_time") else 0
    gpus = job.get("gpus") or 0
    array, task = job.get("array_job_id"), job.get("array_task_id")
    values = {
        "i": f"{array}_{task}" if array is not None else job["id"], "A": job["id"],
        "F": array if array is not None else job["id"], "K": task if array is not None else "N/A",
        "a": job.get("account") or "",
        "P": job.get("queue", ""), "j": job.get("name", ""), "u": job.get("user", ""),
        "t": STATE_CODES.get(job["state"], job["state"]), "T": slurm_state(job),
        "M": squeue_time(used), "l": squeue_time(job.get("time_limit") or None),
        "D": job.get("nodes", 1), "C": (job.get("cpus") or 1) * (job.get("nodes") or 1),
        "b": f"gpu:{gpus}" if gpus else "N/A", "N": nodelist(job), "r": reason(job),
        "R": nodelist(job) if job.get("allocation") else f"({reason(job)})",
        "Q": job.get("priority", 0), "V": iso(job.get("submit_time")),
        "S": iso(job.get("start_time") or job.get("estimated_start")), "Y": "(null)",
        "e": iso(job.get("end_time")),
    }
    return str(values.get(letter, ""))


def format_squeue(jobs: list[dict], fmt: str, header: bool, now: float) -> list[str]:
    """Lines of squeue output for a -o/--format string, in Slurm's field syntax (%.18i ...)."""
    headers = {"i": "JOBID", "A": "JOBID", "F": "ARRAY_JOB_ID", "K": "ARRAY_TASK_ID", "a": "ACCOUNT", "P": "PARTITION", "j": "NAME",
               "u": "USER", "t": "ST", "T": "STATE", "M": "TIME", "l": "TIME_LIMIT", "D": "NODES",
               "C": "CPUS", "b": "TRES_PER_NODE", "N": "NODELIST", "r": "REASON",
               "R": "NODELIST(REASON)", "Q": "PRIORITY", "V": "SUBMIT_TIME", "S": "START_TIME",
               "e": "END_TIME", "Y": "SCHEDNODES"}

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


def _sort_key(text: str) -> tuple:
    return (0, float(text), "") if text.lstrip("-").replace(".", "", 1).isdigit() else (1, 0.0, text)


def _states(text: str | None) -> set[str] | None:
    if not text:
        return None
    out: set[str] = set()
    for item in text.upper().split(","):
        # a code names every state that shows it (PD: PENDING, and HELD in older words)
        for state in {k for k, v in STATE_CODES.items() if v == item} or {item}:
            out.add(SLURM_STATE.get(state, state))
            out.update(k for k, v in SLURM_STATE.items() if v == state)
    return out


SQUEUE_LIMIT = 100_000  # the API's largest page


def select_jobs(c, prog: str, me: bool = False, users: str | None = None, states: str | None = None,
                refs: JobRefs | None = None, partition: str | None = None, names: str | None = None,
                accounts: str | None = None, nodelist: str | None = None) -> list[dict]:
    """The jobs squeue's (and scancel's) filters select: the live ones unless -t or -j says
    otherwise. What the daemon can filter, it does: a page holds at most SQUEUE_LIMIT jobs, and
    a busy cluster has more than the default page waiting (the filters below still apply)."""
    wanted_states = _states(states)
    all_states = wanted_states is not None and ("ALL" in wanted_states or not wanted_states <= ACTIVE)
    query: dict = {"all": all_states, "limit": SQUEUE_LIMIT}
    if me:
        query["user"] = me_user = call(c.me, prog=prog)["user"]
    elif users and "," not in users:
        query["user"] = users
    known = (wanted_states or set()) & DAEMON_STATES  # not ALL, nor the old words HELD and STARTING
    if known and "ALL" not in wanted_states:
        query["state"] = ",".join(sorted(known))
    if refs is None:
        jobs = call(c.jobs, prog=prog, **query)
    else:  # the ids a page at a time (they bound the answer: the filters apply here)
        jobs = refs_jobs(c, refs, prog)
        if not jobs and prog == "squeue":  # Slurm's answer to an id it does not know
            fail("slurm_load_jobs error: Invalid job id specified", EXIT_REFUSED, prog)
    if len(jobs) >= SQUEUE_LIMIT:
        click.echo(f"{prog}: the first {SQUEUE_LIMIT:,} jobs only; narrow it with -u, -t, -p or -j", err=True)
    if me:
        jobs = [j for j in jobs if j["user"] == me_user]
    if users:
        jobs = [j for j in jobs if j["user"] in users.split(",")]
    if wanted_states and "ALL" not in wanted_states:
        jobs = [j for j in jobs if j["state"] in wanted_states]
    elif refs is None and wanted_states is None:
        jobs = [j for j in jobs if j["state"] in ACTIVE]
    if partition:
        wanted = set(partition.split(","))
        aliases = {a: q["name"] for q in call(c.queues, prog=prog) for a in q.get("aliases") or ()}
        wanted |= {aliases[p] for p in wanted if p in aliases}
        jobs = [j for j in jobs if j.get("queue") in wanted]
    if names:
        jobs = [j for j in jobs if j.get("name") in names.split(",")]
    if accounts:
        jobs = [j for j in jobs if j.get("account") in accounts.split(",")]
    if nodelist:
        hosts = set(expand(nodelist))
        jobs = [j for j in jobs if hosts & {a["node"] for a in j.get("allocation") or ()}]
    return jobs


@click.command("squeue", context_settings={"help_option_names": ["--help"]})
@click.option("-o", "--format", "fmt", default=SQUEUE_DEFAULT, show_default=True, help="Output format.")
@click.option("--me", is_flag=True, help="Only my jobs.")
@click.option("-u", "--user", "users", help="Only these users' jobs (comma list).")
@click.option("-t", "--states", help="Only these states (PD,R,... or PENDING,RUNNING,...; ALL).")
@click.option("-j", "--jobs", "refs", callback=job_refs_option,
              help="Only these jobs (comma list: ID, ARRAY_TASK, ARRAY_[1-3]; an array's id names its tasks).")
@click.option("-p", "--partition", help="Only these partitions (comma list).")
@click.option("-h", "--noheader", is_flag=True, help="No header line.")
@click.option("-n", "--name", "names", help="Only jobs with these names (comma list).")
@click.option("-A", "--account", "accounts", help="Only jobs charged to these accounts (comma list).")
@click.option("-w", "--nodelist", help="Only jobs on these nodes (hostlist).")
@click.option("-l", "--long", "long_format", is_flag=True, help="Long format: STATE, TIME_LIMIT.")
@click.option("-S", "--sort", help="Sort by field letters, '-' for descending (e.g. -S -Q,i).")
@click.option("-r", "--array", is_flag=True, help="One line per array task (always so here).")
@click.option("-a", "--all", "all_partitions", is_flag=True, help="All partitions (always so here).")
@click.option("-O", "--Format", "long_fields", help="Fields by name, NAME[:[.]WIDTH] comma list (e.g. JobID:10,Name:30).")
@click.option("--start", is_flag=True, help="Pending jobs with their expected start time, soonest first.")
def squeue(fmt, me, users, states, refs, partition, noheader, names, accounts, nodelist, long_format,
           sort, array, all_partitions, long_fields, start):
    """Jobs in the queue, in squeue's format and state codes."""
    if long_fields:
        fmt = format_of_fields(long_fields)
    elif start and fmt == SQUEUE_DEFAULT:
        fmt = SQUEUE_START
    elif long_format and fmt == SQUEUE_DEFAULT:
        fmt = SQUEUE_LONG
    c = client()
    jobs = select_jobs(c, "squeue", me, users, states or ("PD" if start else None), refs, partition, names,
                       accounts, nodelist)
    jobs.sort(key=lambda j: j["id"])  # oldest first, whatever page the daemon gave (-S sorts on this)
    if start:  # soonest expected start first; none known last
        jobs = [j for j in jobs if j["state"] == "PENDING"]
        jobs.sort(key=lambda j: (j.get("estimated_start") is None, j.get("estimated_start") or 0))
    for key in reversed((sort or "").split(",")):
        if key.strip("-+"):
            letter = key.strip("-+")
            jobs.sort(key=lambda j, x=letter: _sort_key(_squeue_value(j, x, time.time())),
                      reverse=key.startswith("-"))
    for line in format_squeue(jobs, fmt, not noheader, time.time()):
        click.echo(line)


def format_of_fields(text: str) -> str:
    """squeue -O's `NAME[:[.]WIDTH],...` as an -o format: each field padded to WIDTH (default
    20; `.` right-justifies), no separator, as Slurm prints it."""
    parts = []
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        name, _, size = item.partition(":")
        letter = FORMAT_FIELDS.get(name.lower())
        right = size.startswith(".")
        size = size.lstrip(".") or "20"
        if letter is None or not size.isdigit():
            raise click.BadParameter(f"Invalid job format specification: {item!r}; fields are "
                                     f"{', '.join(sorted(FORMAT_FIELDS))}", param_hint="'-O' / '--Format'")
        parts.append(f"%{'.' if right else '-'}{size}{letter}")
    if not parts:
        raise click.BadParameter("no field named", param_hint="'-O' / '--Format'")
    return "".join(parts)


# ----------------------------------------------------------------------------- scancel
@click.command("scancel", context_settings={"help_option_names": ["--help"]})
@click.argument("job_ids", nargs=-1)
@click.option("--me", is_flag=True, help="Only my jobs.")
@click.option("-u", "--user", "users", help="Only this user's jobs (comma list).")
@click.option("-t", "--state", "states", help="Only jobs in these states (PENDING/PD, RUNNING/R; comma list).")
@click.option("-n", "--name", "--jobname", "names", help="Only jobs with these names (comma list).")
@click.option("-p", "--partition", help="Only jobs in these partitions (comma list).")
@click.option("-A", "--account", "accounts", help="Only jobs charged to these accounts (comma list).")
@click.option("-w", "--nodelist", help="Only jobs on these nodes (hostlist).")
@click.option("-s", "--signal", "signal_name", help="Not supported here: scancel cancels (SIGTERM, then SIGKILL).")
@click.option("-f", "--full", is_flag=True, hidden=True)
@click.option("-b", "--batch", is_flag=True, hidden=True)
@click.option("-H", "--hurry", is_flag=True, hidden=True)
@click.option("-Q", "--quiet", is_flag=True, help="No error for jobs that have already ended.")
@click.option("-v", "--verbose", is_flag=True, hidden=True)
def scancel(job_ids, me, users, states, names, partition, accounts, nodelist, signal_name, full, batch, hurry,
            quiet, verbose):
    """Cancel jobs, silent on success as scancel is: ID cancels that job, or every unfinished task
    of the array ID; ID_TASK and ID_[1-3,7] cancel those tasks of the array ID. With filters
    (--me, -u, -t, -n, -p, -A, -w) and no ids, every live job they select; with ids, those
    among them."""
    if signal_name:
        fail(f"--signal={signal_name}: not supported: trainyard's API has no call that sends a running job a "
             "signal of the caller's choice (a job's own sbatch --signal is sent before its time limit)",
             EXIT_USAGE, "scancel")
    filtered = any((me, users, states, names, partition, accounts, nodelist))
    if not job_ids and not filtered:
        fail("No job identification provided: give job ids, or filters such as --me, -u, -n, -t", EXIT_REFUSED,
             "scancel")
    try:
        refs = job_refs(",".join(job_ids)) if job_ids else None
    except click.BadParameter as e:
        fail(e.message, EXIT_USAGE, "scancel")
    c = client()
    if refs is not None:
        targets, missing = resolve_jobs(c, refs, "scancel", lambda j: j["state"] in ACTIVE)
    else:
        targets, missing = {}, []
    if filtered:  # the live jobs the filters select, among the ids when there are any
        chosen = select_jobs(c, "scancel", me, users, states, refs, partition, names, accounts, nodelist)
        live = {j["id"] for j in chosen if j["state"] in ACTIVE}
        targets = ({k: v for k, v in targets.items() if k in live} if refs is not None
                   else {j: str(j) for j in sorted(live)})
    failed = False
    for name in missing:
        click.echo(f"scancel: error: Kill job error on job id {name}: Invalid job id specified", err=True)
        failed = True
    # one call for them all (an array's 5,000 tasks were 5,000 requests); each refused one says why
    refused = call(c.act_many, "cancel", list(targets), prog="scancel")["refused"] if targets else []
    for r in refused:
        if quiet and r["status"] == 409:
            continue
        click.echo(f"scancel: error: Kill job error on job id {targets.get(r['id'], r['id'])}: {r['detail']}",
                   err=True)
        failed = True
    if failed:
        sys.exit(EXIT_REFUSED)


# ----------------------------------------------------------------------------- sbatch
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
            fail(f"Unable to open file {script_path}: {e.strerror}", EXIT_USAGE, "sbatch")
    try:
        spec = parse(text, options, default_name=Path(script_path).name if script_path else None)
    except SbatchError as e:
        fail(str(e), EXIT_USAGE, "sbatch")
    if text is None and not spec.wrap:
        fail("a batch script is required: `sbatch [OPTIONS] SCRIPT` or --wrap=COMMAND", EXIT_USAGE, "sbatch")
    if text is not None and not text.startswith("#!"):
        fail("This does not look like a batch script.  The first line must start with #! followed by "
              "the path to an interpreter.", EXIT_USAGE, "sbatch")
    if spec.warning():
        click.echo(spec.warning(), err=True)
    c = client()
    body = spec.to_submit_body(text)
    known = api_fields(c.url)
    if known is not None:
        dropped = sorted(k for k in body if k not in known)
        if dropped:
            click.echo(f"sbatch: warning: this daemon does not take yet: {', '.join(dropped)}", err=True)
            body = {k: v for k, v in body.items() if k in known}
    job = call(c.submit, body, prog="sbatch")
    click.echo(str(job["id"]) if spec.parsable else f"Submitted batch job {job['id']}")


# ----------------------------------------------------------------------------- sacct
def accounting_jobs(c, start: float | None, end: float | None, user: str | None,
                    ids: str | None = None) -> list[dict]:
    """Jobs that existed in [start, end) from /v1/accounting/jobs (with `ids`: those jobs and the
    tasks of the arrays among them, at any time unless `start` is given), with what each asked
    for (CPUs, memory, time limit) beside its record: one request, whatever the history's size."""
    params = {k: v for k, v in (("start", start), ("end", end), ("user", user), ("ids", ids)) if v is not None}
    records = call(c._call, "GET", "/v1/accounting/jobs", params=params, prog="sacct")["jobs"]
    return [{**r, "submit_time": r.get("submit"), "start_time": r.get("start"), "end_time": r.get("end"),
             "nodes": len(r.get("allocation") or []) or r.get("nodes") or 1} for r in records]


@click.command("sacct", context_settings={"help_option_names": ["--help"]})
@click.option("-o", "--format", "fields", help="Fields, comma list; any prefix of a name, NAME%WIDTH, ALL "
              f"[default: $SACCT_FORMAT, else {sacct_fields.DEFAULT}].")
@click.option("-e", "--helpformat", is_flag=True, help="List the fields --format takes.")
@click.option("-j", "--jobs", "refs", callback=job_refs_option,
              help="Only these jobs, at any time (comma list: ID, ARRAY_TASK, ARRAY_[1-3], ID.batch).")
@click.option("-S", "--starttime", help="Jobs that ended after this time [default: 00:00 today].")
@click.option("-E", "--endtime", help="Jobs that started before this time [default: now].")
@click.option("-s", "--state", "states", help="Only these states (CD,F,CA,... or COMPLETED,...).")
@click.option("-p", "--parsable", is_flag=True, help="'|' between fields and at the end of each line.")
@click.option("-P", "--parsable2", is_flag=True, help="'|' between fields.")
@click.option("-n", "--noheader", is_flag=True, help="No header.")
@click.option("-u", "--user", "users", help="Only these users.")
@click.option("-a", "--allusers", is_flag=True, help="Every user's jobs (operators).")
@click.option("-X", "--allocations", is_flag=True, help="Allocations only (trainyard has no steps).")
@click.option("-b", "--brief", is_flag=True, help="JobID, State and ExitCode.")
@click.option("-l", "--long", "long_format", is_flag=True, help="Every field trainyard has.")
@click.option("--name", "names", help="Only jobs with these names (comma list).")
@click.option("-A", "--accounts", help="Only jobs charged to these accounts (comma list).")
@click.option("-r", "--partition", help="Only jobs in these partitions (comma list).")
@click.option("--delimiter", default="|", show_default=True, help="Between fields with -p/-P.")
@click.option("-D", "--duplicates", is_flag=True, hidden=True)
@click.option("--noconvert", is_flag=True, hidden=True)
@click.option("--units", hidden=True)
def sacct(fields, helpformat, refs, starttime, endtime, states, parsable, parsable2, noheader, users, allusers,
          allocations, brief, long_format, names, accounts, partition, delimiter, duplicates, noconvert, units):
    """Accounting of jobs, in sacct's fields and layout."""
    if helpformat:
        click.echo(sacct_fields.help_text())
        return
    # as Slurm: -o's fields, then -b's, then -l's; with none of them, $SACCT_FORMAT or the default
    spec = ",".join(x for x in (fields, sacct_fields.BRIEF if brief else None,
                                sacct_fields.LONG if long_format else None) if x) \
        or os.environ.get("SACCT_FORMAT") or sacct_fields.DEFAULT
    try:
        columns = sacct_fields.resolve(spec)
    except ValueError as e:
        fail(str(e), EXIT_REFUSED, "sacct")
    c = client()
    until = when(endtime) if endtime else None
    if refs is not None:  # at any time unless -S is given, every user's that the caller may read (as Slurm)
        since = when(starttime) if starttime else None
        jobs = [j for ids in refs.pages() for j in accounting_jobs(c, since, until, None, ids) if refs.wants(j)]
    else:
        since = when(starttime) if starttime else time.mktime(time.localtime()[:3] + (0, 0, 0, 0, 0, -1))
        one_user = users if users and "," not in users else None
        if not users and not allusers:
            one_user = call(c.me, prog="sacct")["user"]
        jobs = accounting_jobs(c, since, until, one_user)
    if users:
        jobs = [j for j in jobs if j["user"] in users.split(",")]
    wanted = _states(states)
    if wanted:
        jobs = [j for j in jobs if j["state"] in wanted]
    for key, text in (("name", names), ("account", accounts), ("queue", partition)):
        if text:
            jobs = [j for j in jobs if (j.get(key) or "") in text.split(",")]
    delimiter = delimiter if parsable or parsable2 else None
    for line in sacct_fields.render(jobs, columns, not noheader, delimiter, ending=parsable):
        click.echo(line)


@click.group("slurm")
def slurm():
    """Slurm's commands, speaking to trainyard: sbatch, squeue, scancel, sacct, sinfo, scontrol,
    salloc, srun --pty and sdiag."""


for _cmd in (sbatch, squeue, scancel, sacct, sinfo, scontrol, salloc, srun, sdiag):
    slurm.add_command(_cmd)


def main() -> None:
    """Entry point of `ty-<command>`: the command named by the program's name."""
    prog = os.path.basename(sys.argv[0]).removeprefix("ty-")
    command = slurm.commands.get(prog)
    if command is None:
        fail(f"unknown command {prog!r}; use one of {', '.join(sorted(slurm.commands))}", EXIT_USAGE)
    command(prog_name=prog)
