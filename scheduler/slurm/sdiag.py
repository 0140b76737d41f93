"""sdiag: the daemon's load in the layout of Slurm's sdiag (its lines that have a meaning here),
from GET /v1/diag. `trainyard diag` shows the same in trainyard's own words."""

from __future__ import annotations

import json
import time

import click

from .api import call, client


def _stamp(ts: float) -> str:
    return f"{time.strftime('%a %b %d %H:%M:%S %Y', time.localtime(ts))} ({int(ts)})"


def _us(ms: float) -> int:
    return round(ms * 1000)


def render(d: dict) -> list[str]:
    """sdiag's text: the header, the job counters, the main scheduler's cycles in microseconds;
    then what Slurm has no line for (the event loop's lag) and the requests by user."""
    jobs, cycles, lag, agents, api = d["jobs"], d["scheduler"], d["loop"], d["agents"], d["api"]
    now = jobs["now"]
    out = [
        "*" * 55,
        f"sdiag output at {_stamp(d['time'])}",
        f"Data since      {_stamp(d['since'])}",
        "*" * 55,
        f"Server thread count:  1 (one event loop; trainyard daemon {d['role']}, {d['database']})",
        f"Agent count:          {agents['connected']} of {agents['nodes']} nodes connected",
        f"Agent messages:       {agents['messages']} ({agents['messages_per_s']}/s)",
        "",
        f"Jobs submitted: {jobs['submitted']}",
        f"Jobs started:   {jobs['started']}",
        f"Jobs completed: {jobs['completed']}",
        f"Jobs canceled:  {jobs['cancelled']}",
        f"Jobs failed:    {jobs['failed'] + jobs['timeout']}",
        "",
        f"Job states ts:  {_stamp(d['time'])}",
        f"Jobs pending:   {now['pending']}",
        f"Jobs running:   {now['running']}",
        "",
        "Main schedule statistics (microseconds):",
        f"\tLast cycle:   {_us(cycles['last_ms'])}",
        f"\tMax cycle:    {_us(cycles['max_ms'])}",
        f"\tTotal cycles: {cycles['cycles']}",
        f"\tMean cycle:   {_us(cycles['mean_ms'])}",
        f"\tLast queue length: {cycles['last_queue_length']}",
        "",
        "Event loop lag (microseconds):",
        f"\tLast:         {_us(lag['last_ms'])}",
        f"\tMean:         {_us(lag['mean_ms'])}",
        f"\tp99 (last minute): {_us(lag['p99_ms'])}",
        f"\tMax:          {_us(lag['max_ms'])}",
        f"\tSamples:      {lag['samples']} (every {lag['every_ms']:g} ms)",
        "",
        f"Remote Procedure Call statistics: {api['requests']} requests ({api['requests_per_s']}/s), "
        f"{api['reads_throttled']} reads throttled",
    ]
    if "by_user" in api:
        out.append("Remote Procedure Call statistics by user")
        out += [f"\t{u['user']:<15} count:{u['requests']:<8} reads:{u['reads']:<8} "
                f"read_cpu_time:{round(u['read_cpu_s'] * 1e6)} throttled:{u['reads_throttled']}"
                for u in api["by_user"]]
    return out


@click.command("sdiag")
@click.option("-r", "--reset", is_flag=True, help="Start the counters again from now (operators).")
@click.option("--json", "as_json", is_flag=True, help="GET /v1/diag as it is, for scripts.")
@click.option("-a", "--all", "all_", is_flag=True, hidden=True)  # Slurm's default already
def sdiag(reset, as_json, all_):
    """The daemon's load: job counters, scheduling cycles, event loop lag, requests by user."""
    d = call(client().diag, reset, prog="sdiag")
    if reset and not as_json:
        click.echo("Reset scheduling statistics")
        return
    if as_json:
        click.echo(json.dumps(d, indent=2))
        return
    for line in render(d):
        click.echo(line)
