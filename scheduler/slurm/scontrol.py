"""scontrol for people on a login host: show job/node/partition/hostnames, hold, release,
requeue and update, as a client of trainyard's API (inside a job, the node's shim answers)."""

from __future__ import annotations

import os

import click

from .api import (
    EXIT_REFUSED,
    EXIT_USAGE,
    call,
    client,
    fail,
    iso,
    job_refs,
    nodelist,
    reason,
    resolve_jobs,
    slurm_state,
    time_limit,
)
from .hostlist import HostlistError, compress, expand
from .sinfo import node_state

# of an array named by its id, the tasks that a verb acts on (requeue: every task)
_ARRAY_TASKS = {"hold": lambda j: j["state"] == "PENDING" and not j.get("held"),
                "release": lambda j: bool(j.get("held"))}
_ARRAY_TASKS["uhold"] = _ARRAY_TASKS["hold"]


def _job_ids(c, text: str, array_task=None) -> list[int]:
    """The jobs `text` names (ID, ARRAY_TASK, ARRAY_[1-3], comma-separated; an array's id is
    its tasks, those for which `array_task(job)` holds when given)."""
    try:
        refs = job_refs(text)
    except click.BadParameter as e:
        fail(f"Invalid job id specified: {e.message}", EXIT_USAGE, "scontrol")
    targets, missing = resolve_jobs(c, refs, "scontrol", array_task)
    if missing:
        fail(f"Invalid job id specified: no task {', '.join(missing)}", EXIT_REFUSED, "scontrol")
    return list(targets)


def show_job(job: dict) -> str:
    """`scontrol show job`'s KEY=VALUE layout: the fields scripts grep for, in Slurm's order."""
    limit = time_limit(job.get("time_limit"))
    nodes = nodelist(job) or "(null)"
    tres = f"cpu={(job.get('cpus') or 1) * (job.get('nodes') or 1)},mem={job.get('mem') or 0}M," \
           f"node={job.get('nodes') or 1}" + (f",gres/gpu={job['gpus'] * (job.get('nodes') or 1)}"
                                             if job.get("gpus") else "")
    lines = [
        f"JobId={job['id']} JobName={job.get('name', '')}",
        f"UserId={job.get('user', '')} Account={job.get('account') or '(null)'}",
        f"Priority={job.get('priority', 0)} Nice={job.get('nice', 0)}",
        f"JobState={slurm_state(job)} Reason={reason(job)} Dependency={job.get('dependency') or '(null)'}",
        f"Requeue=1 Restarts={job.get('failures', 0)} ExitCode={job.get('exit_code') or 0}:0",
        f"TimeLimit={limit}",
        f"SubmitTime={iso(job.get('submit_time'))} StartTime={iso(job.get('start_time'))} "
        f"EndTime={iso(job.get('end_time'))}",
        f"Partition={job.get('queue', '')} NodeList={nodes}",
        f"NumNodes={job.get('nodes') or 1} NumCPUs={(job.get('cpus') or 1) * (job.get('nodes') or 1)} "
        f"NumTasks={job.get('ntasks') or job.get('nodes') or 1} "
        f"CPUs/Task={job.get('cpus_per_task') or 1}",
        f"TRES={tres}",
        f"Features={job.get('features') or '(null)'}",
        f"WorkDir={job.get('workdir') or '(null)'}",
    ]
    if job.get("array_job_id") is not None:
        lines.insert(1, f"ArrayJobId={job['array_job_id']} ArrayTaskId={job.get('array_task_id')}")
    return "\n   ".join(lines) + "\n"


def show_node(node: dict, busy: set[str]) -> str:
    labels = node.get("labels") or {}
    features = ",".join(k if not v else f"{k}={v}" for k, v in sorted(labels.items())) or "(null)"
    state = {"idle": "IDLE", "mix": "MIXED", "alloc": "ALLOCATED", "drng": "MIXED+DRAIN",
             "drain": "IDLE+DRAIN", "down": "DOWN", "boot": "POWERING_UP"}.get(node_state(node, busy), "UNKNOWN")
    gres = f"gpu:{node['gpu_model'].replace(' ', '_').lower()}:{node['gpus_total']}" \
        if node.get("gpus_total") else "(null)"
    lines = [
        f"NodeName={node['name']} CPUTot={node.get('cpus', 0)}",
        f"AvailableFeatures={features}",
        f"Gres={gres} GresUsed=gpu:{node.get('gpus_used', 0)}",
        f"NodeAddr={node.get('address', '')}",
        f"RealMemory={node.get('mem_mb', 0)}",
        f"State={state}",
    ]
    if node.get("reason"):
        lines.append(f"Reason={node['reason']}")
    return "\n   ".join(lines) + "\n"


def _update(c, pairs: tuple[str, ...]) -> None:
    fields = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq:
            fail(f"update: {pair!r} is not KEY=VALUE; e.g. `scontrol update JobId=42 Priority=10`",
                 EXIT_USAGE, "scontrol")
        fields[key.lower()] = value
    named = fields.pop("jobid", "") or fields.pop("job", "") or ""
    if not named:
        fail("update: name the job with JobId=ID", EXIT_USAGE, "scontrol")
    ids = _job_ids(c, named)
    for key, value in fields.items():
        if key == "priority":
            if not value.lstrip("-").isdigit():
                fail(f"update: Priority={value!r} is not a whole number", EXIT_USAGE, "scontrol")
            for job_id in ids:
                call(c.set_priority, job_id, int(value), prog="scontrol")
        elif key == "timelimit":
            for job_id in ids:
                limit = new_time_limit(value, lambda job_id=job_id: call(c.job, job_id, prog="scontrol"))
                call(c._call, "PATCH", f"/v1/jobs/{job_id}", json={"time_limit": limit}, prog="scontrol")
        else:
            fail(f"update: {key!r} cannot change here; trainyard updates Priority and TimeLimit",
                 EXIT_USAGE, "scontrol")


def new_time_limit(value: str, job) -> int | str:
    """The limit `TimeLimit=VALUE` asks for, in seconds or UNLIMITED: Slurm's time formats
    (rounded up to the minute), and `+TIME`/`-TIME` relative to the job's current limit."""
    from .sbatch import parse_time_limit

    text = value.strip()
    sign = text[:1] if text[:1] in "+-" and text != "-1" else ""
    try:
        seconds = parse_time_limit(text[1:] if sign else text)
    except ValueError:
        fail(f"update: Invalid time limit specified TimeLimit={value!r}; use MM, MM:SS, HH:MM:SS, "
             "D-HH[:MM[:SS]], UNLIMITED, or +/- one of them", EXIT_USAGE, "scontrol")
    if not sign:
        return "UNLIMITED" if seconds is None else seconds
    if seconds is None:
        fail(f"update: TimeLimit={value!r}: UNLIMITED cannot be added or taken away", EXIT_USAGE,
             "scontrol")
    current = job().get("time_limit")
    if current is None:
        fail(f"update: TimeLimit={value!r}: the job's limit is UNLIMITED; give an absolute limit",
             EXIT_USAGE, "scontrol")
    limit = current + seconds if sign == "+" else current - seconds
    if limit < 60:
        fail(f"update: TimeLimit={value!r} would leave {time_limit(current)} at {limit}s; a limit "
             "must stay at least one minute", EXIT_USAGE, "scontrol")
    return limit


@click.command("scontrol", context_settings={"help_option_names": ["--help"]})
@click.argument("words", nargs=-1, required=True)
def scontrol(words):
    """show job [ID]|node [NAME]|partition [NAME]|hostnames LIST|hostlist LIST; hold, release,
    requeue JOBID[,...]; update JobId=ID Priority=N TimeLimit=[+|-]TIME."""
    verb, rest = words[0].lower(), words[1:]
    if verb == "show" and rest and rest[0].lower() in ("hostnames", "hostname", "hostlist"):
        text = rest[1] if len(rest) > 1 else os.environ.get("SLURM_JOB_NODELIST", "")
        try:
            click.echo("\n".join(expand(text)) if rest[0].lower() != "hostlist"
                       else compress(text.split(",")))
        except HostlistError as e:
            fail(str(e), EXIT_USAGE, "scontrol")
        return
    c = client()
    if verb == "show" and rest and rest[0].lower() in ("job", "jobs"):
        jobs = [call(c.job, i, prog="scontrol") for i in _job_ids(c, rest[1])] if len(rest) > 1 \
            else call(c.jobs, prog="scontrol")
        click.echo("\n".join(show_job(j) for j in jobs), nl=False)
    elif verb == "show" and rest and rest[0].lower() in ("node", "nodes"):
        nodes = [call(c.node, rest[1], prog="scontrol")] if len(rest) > 1 else call(c.nodes, prog="scontrol")
        busy = {a["node"] for j in call(c.jobs, prog="scontrol") if j["state"] == "RUNNING"
                for a in j.get("allocation") or ()}
        click.echo("\n".join(show_node(n, busy) for n in nodes), nl=False)
    elif verb == "show" and rest and rest[0].lower() in ("partition", "partitions"):
        for q in call(c.queues, prog="scontrol"):
            if len(rest) > 1 and rest[1] not in [q["name"], *(q.get("aliases") or ())]:
                continue
            click.echo(f"PartitionName={q['name']}\n   Default={'YES' if q['name'] == 'default' else 'NO'} "
                       f"State={'UP' if q['state'] == 'open' else 'INACTIVE'} "
                       f"MaxTime={time_limit(q.get('max_time_limit'))} "
                       f"DefaultTime={time_limit(q.get('default_time_limit'))}\n"
                       f"   Aliases={','.join(q.get('aliases') or []) or '(null)'} "
                       f"PriorityTier={q.get('priority', 0)}\n")
    elif verb in ("hold", "uhold", "release", "requeue") and rest:
        action = "hold" if verb == "uhold" else verb
        ids = _job_ids(c, ",".join(rest), _ARRAY_TASKS.get(verb))
        refused = call(c.act_many, action, ids, prog="scontrol")["refused"] if ids else []
        for r in refused:  # each job refused says why; the others were acted on
            click.echo(f"scontrol: error: {r['detail']}", err=True)
        if refused:
            raise SystemExit(EXIT_REFUSED)
    elif verb == "update" and rest:
        _update(c, rest)
    else:
        fail(f"invalid command {' '.join(words)!r}; use show job|node|partition|hostnames, hold, "
             "release, requeue or update", EXIT_USAGE, "scontrol")
