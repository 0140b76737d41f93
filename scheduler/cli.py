"""The `trainyard` command line: a thin client of the daemon's API (imports lazily for speed).

Exit codes (scheduler.exitcodes): 0 ok, 1 the daemon refused (message on stderr), 2 usage
error, 3 daemon unreachable.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import NoReturn

import click
from click.core import ParameterSource

from .exitcodes import REFUSED, UNREACHABLE, USAGE

# Subcommands that live in their own modules, imported only when invoked so that
# `trainyard jobs` does not pay for Pulumi, Ansible, Textual or the daemon.
LAZY_COMMANDS = {
    "infra": ("infra.cli", "infra"),
    "bootstrap": ("scheduler.bootstrap", "bootstrap"),
    "simulate": ("scheduler.simulate", "simulate"),
    "tui": ("tui.cli", "tui"),
    "slurm": ("scheduler.slurm.commands", "slurm"),
}


class LazyGroup(click.Group):
    def list_commands(self, ctx):
        return sorted([*super().list_commands(ctx), *LAZY_COMMANDS])

    def get_command(self, ctx, name):
        if name in LAZY_COMMANDS:
            module, attr = LAZY_COMMANDS[name]
            try:
                return getattr(importlib.import_module(module), attr)
            except (ImportError, AttributeError) as e:
                raise click.ClickException(f"`trainyard {name}` is not available in this install: {e}") from None
        return super().get_command(ctx, name)


def fail(message: str, code: int = REFUSED) -> NoReturn:
    """Say what went wrong, one problem a line, and exit with `code`."""
    for line in str(message).splitlines() or [""]:
        click.echo(f"trainyard: error: {line}", err=True)
    sys.exit(code)


def client():
    from .client import BadSettings, Client, NotConfigured

    try:
        return Client.from_env()
    except BadSettings as e:
        fail(str(e), USAGE)
    except NotConfigured as e:
        fail(str(e), UNREACHABLE)


def api(call: Callable, *args, **kwargs):
    """Run one client call, turning the daemon's refusals into exit codes and one-line messages."""
    from .client import ApiError, Unreachable

    try:
        return call(*args, **kwargs)
    except ApiError as e:
        fail(e.detail, REFUSED)
    except Unreachable as e:
        fail(f"{e}; is `trainyard daemon` running? (TRAINYARD_URL)", UNREACHABLE)


def print_json(data) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False))


def table(headers: list[str], rows: Iterable[list]) -> None:
    """An squeue-style table: a header line, then one line per row, columns two spaces apart.

    Cells are plain text (never rich markup); lines are never cut or wrapped when stdout is a
    pipe, so `grep` and `awk` see every row whole.
    """
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    tty = sys.stdout.isatty()
    console = Console(width=None if tty else 1_000_000, highlight=False, soft_wrap=not tty)
    t = Table(box=None, show_edge=False, pad_edge=False, padding=(0, 2, 0, 0),
              header_style="bold" if tty else "")
    for h in headers:
        t.add_column(h, no_wrap=not tty)
    for r in rows:
        t.add_row(*(Text("" if c is None else str(c)) for c in r))
    with console.capture() as captured:
        console.print(t)
    click.echo("\n".join(line.rstrip() for line in captured.get().splitlines()))


def fmt_duration(seconds: float | None) -> str:
    from .units import format_duration

    return format_duration(seconds)


def fmt_time(ts: float | None) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(ts)) if ts else "-"


def json_option(f):
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for scripts.")(f)


@click.group(cls=LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(package_name="trainyard")
def cli():
    """trainyard: GPU training cluster manager.

    \b
    Start here:  trainyard demo            a self-contained cluster on this machine
    Then:        trainyard submit --gpus 2 -- python train.py
                 trainyard jobs | nodes | queues | tui

    Client settings come from TRAINYARD_URL and TRAINYARD_TOKEN, else
    ~/.config/trainyard/client.toml (written by the daemon's first start).
    Exit codes: 0 ok, 1 refused by the daemon, 2 usage error, 3 daemon unreachable.
    """


# ------------------------------------------------------------------------------ daemon, demo
def daemon_status(as_json: bool = False) -> None:
    """One line per configured daemon: its URL and role (leader, with how many of its nodes are
    connected; or standby, and why). With `as_json`, a list of each daemon's `/healthz` (and
    `problems`, `url`; `error` for one that did not answer)."""
    import httpx

    from .client import NotConfigured, load_settings, split_urls

    try:
        url, _token = load_settings()
    except NotConfigured as e:
        fail(str(e), USAGE)
    leaders = 0
    seen = []
    for one in split_urls(url):
        try:
            h = httpx.get(one.rstrip("/") + "/healthz", timeout=5).json()
        except (httpx.HTTPError, ValueError) as e:
            seen.append({"url": one, "role": None, "error": f"unreachable ({type(e).__name__})"})
            if not as_json:
                click.echo(f"{one}  unreachable ({type(e).__name__})")
            continue
        role = h.get("role", "leader")
        leaders += role == "leader"
        problems = []
        if role == "leader" and _token:  # what the daemon itself cannot do now (e.g. store logs)
            try:
                r = httpx.get(one.rstrip("/") + "/v1/cluster", timeout=5,
                              headers={"Authorization": f"Bearer {_token}"})
                problems = list(r.json().get("problems") or ()) if r.status_code == 200 else []
            except (httpx.HTTPError, ValueError):
                pass
        seen.append({**h, "url": one, "role": role, "problems": problems})
        if as_json:
            continue
        if role != "leader":
            why = f" ({h['reason']}; leader: {h.get('leader') or 'none yet'})"
        else:
            why = f" ({h['nodes_connected']} of {h['nodes']} nodes connected)" if "nodes" in h else ""
        click.echo(f"{one}  {role}{why}")
        for problem in problems:
            click.echo(f"  problem: {problem}")
    if as_json:
        print_json(seen)
    if not leaders:
        fail("no configured daemon leads now", UNREACHABLE)


@cli.command()
@click.option("--config", "config_path", type=click.Path(dir_okay=False), help="trainyard.toml with [daemon] settings.")
@click.option("--listen", help="HOST:PORT to serve the API on [default: 127.0.0.1:8471].")
@click.option("--db", help="Database: a SQLite path or postgresql://user@host/db [default: $TRAINYARD_HOME/trainyard.db].")
@click.option("-v", "--verbose", is_flag=True, help="Log more.")
@click.option("--status", is_flag=True,
              help="Say which of the configured daemons (TRAINYARD_URL, comma-separated) leads, and exit.")
@click.option("--json", "as_json", is_flag=True, help="With --status: print JSON for scripts.")
def daemon(config_path, listen, db, verbose, status, as_json):
    """Run the scheduler daemon: API, scheduling loop and node sessions.

    With PostgreSQL, start it on two hosts (or twice, on other ports): one leads, the others
    stand by and take over when it dies; clients given every URL follow the leader."""
    import asyncio
    import logging
    import signal

    if status:
        daemon_status(as_json)
        return
    if as_json:
        fail("--json goes with --status", USAGE)

    from .config import home
    from .daemon_config import DaemonConfig

    try:
        config = DaemonConfig.load(config_path)
    except ValueError as e:
        fail(str(e), USAGE)
    if listen is not None:
        try:
            config.listen = listen
        except ValueError:
            fail(f"--listen {listen!r}: expected HOST:PORT, e.g. 127.0.0.1:8471", USAGE)
    if db is not None:
        config.db = db

    from .daemon import Daemon
    from .daemon.leadership import AlreadyServed
    from .server import bind, raise_nofile_limit, run, serve
    from .store import SchemaError

    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    raise_nofile_limit()
    try:
        d = Daemon(config, home())
    except ValueError as e:  # a bad [scheduler], [queues], [teams] or [health] table
        fail(f"{config_path}: {e}", USAGE)
    try:
        d.prepare()
    except (SchemaError, AlreadyServed) as e:
        fail(str(e))
    except Exception as e:  # the database refused: say which and why
        fail(f"cannot open the database {config.db or d.db_url!r}: {type(e).__name__}: {str(e).splitlines()[0]}")

    try:
        sock = bind(config.listen)
    except ValueError as e:
        fail(str(e), USAGE)
    except OSError as e:
        fail(str(e))

    def ready(dm: Daemon) -> None:
        token = dm.bootstrap_admin(dm.url)
        click.echo(f"trainyard daemon listening on {dm.url} (state in {dm.home})", err=True)
        if token:
            from .config import client_config_path

            click.echo(f"first start: admin token for this user written to {client_config_path()}", err=True)

    async def main():
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await serve(d, sock, ready, stop)

    run(main())


@cli.command()
@click.option("--nodes", default=4, show_default=True, type=click.IntRange(1, 256), help="Simulated nodes.")
@click.option("--gpus-per-node", default=8, show_default=True, type=click.IntRange(0, 16))
@click.option("--no-tui", is_flag=True, help="Run headless; print TRAINYARD_URL/TRAINYARD_TOKEN and wait.")
@click.option("--listen", default="127.0.0.1:0", show_default=True, help="HOST:PORT for the API (0: any free port).")
@click.option("--dir", "workdir", type=click.Path(file_okay=False), help="Where to keep the demo's state [default: a new temp dir].")
@click.option("--idle", is_flag=True, help="No workload of its own: the cluster waits for your jobs.")
@click.option("--until-ready", is_flag=True, hidden=True, help="Stop once every node is UP (make demo-ready).")
def demo(nodes, gpus_per_node, no_tui, listen, workdir, idle, until_ready):
    """A self-contained cluster: the daemon on SQLite plus simulated SSH nodes on loopback,
    busy with a replay of a real GPU cluster's trace (Philly) unless --idle."""
    from .demo import run_demo

    run_demo(nodes=nodes, gpus=gpus_per_node, tui=not no_tui, listen=listen, workdir=workdir,
             idle=idle, until_ready=until_ready)


# ------------------------------------------------------------------------------ jobs
@cli.command(context_settings={"ignore_unknown_options": False})
@click.option("--name", "-J", help="Job name [default: the command's name].")
@click.option("--queue", "-p", help="Queue (partition) [default: default].")
@click.option("--gpus", "-G", type=click.IntRange(0), help="GPUs per node.")
@click.option("--gpu-type", help="Only nodes whose GPU model contains this, e.g. H100.")
@click.option("--nodes", "-N", type=click.IntRange(1), help="Nodes, all started together (gang).")
@click.option("--cpus", "-c", type=click.IntRange(1), help="CPUs per node.")
@click.option("--mem", help="Memory per node, e.g. 64G.")
@click.option("--time", "-t", "time_limit", help="Time limit: MM, HH:MM:SS or D-HH:MM:SS.")
@click.option("--priority", type=int, help="Priority (raising above 0 needs the operator role).")
@click.option("--retries", type=click.IntRange(0, 100), help="Rerun a failed job up to N times.")
@click.option("--after", help="Start after job ID ended (afterany), or afterok|afternotok|afterany:ID[:ID], singleton.")
@click.option("--array", help="Job array, e.g. 0-9 or 0-99%10.")
@click.option("--env", "-e", multiple=True, help="K=V for the job's environment (repeatable).")
@click.option("--workdir", "-D", help="Working directory on the node [default: the job's own directory].")
@click.option("--constraint", "-C", help="Node labels the job needs (rack=r1,fabric=ib), or Slurm node "
                                         "features (a100&ib, [a|b]).")
@click.option("--image", help="Run in this container image (docker/podman reference; pyxis's too).")
@click.option("--container-mounts", help="SRC[:DST[:ro]],... bind mounts into the container.")
@click.option("--container-workdir", help="Working directory inside the container.")
@click.option("--signal", help="[B:]SIG[@SECONDS]: SIG that long before the time limit and at a preemption.")
@click.option("--output", "-o", help="Output file pattern on the node (%j %x %A %a %N %u %t), in --workdir.")
@click.option("--error", help="Error file pattern (default: with the output).")
@click.option("--exclusive", is_flag=True, default=None, help="Whole nodes only: share them with no other job.")
@click.option("--nice", type=int, help="Lower your job's priority by N (negative needs an operator).")
@click.option("--account", "-A", help="Team to charge [default: the team the daemon maps you to].")
@click.option("--hold", is_flag=True, help="Submit held; `trainyard release` starts it.")
@click.option("--parsable", is_flag=True, help="Print only the job id.")
@json_option
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
@click.pass_context
def submit(ctx, args, parsable, as_json, **opts):
    """Queue a job: `trainyard submit [OPTIONS] -- COMMAND...` or `trainyard submit [OPTIONS] SCRIPT`.

    A SCRIPT's #SBATCH lines are read as defaults (job name, nodes, gpus, time, mem, ...);
    options given here win.
    """
    from .jobspec import parse_env
    from .slurm.sbatch import SbatchError, parse
    from .units import parse_mem, parse_time_limit

    if not args:
        raise click.UsageError("nothing to run: give `-- COMMAND...` or a SCRIPT file")
    spec: dict = {}
    if _after_dashdash(args):
        spec["command"] = list(args)
    else:
        script_path = Path(args[0])
        if len(args) > 1:
            raise click.UsageError(
                f"{' '.join(args)!r}: to run a command, put it after `--` "
                f"(trainyard submit [OPTIONS] -- {' '.join(args)}); without `--` give one SCRIPT file")
        if not script_path.is_file():
            what = "is a directory" if script_path.is_dir() else "does not exist"
            raise click.UsageError(f"script {args[0]!r} {what}; to run a command instead, put it after "
                                   f"`--`: trainyard submit -- {args[0]}")
        try:
            script = script_path.read_text()
        except (OSError, UnicodeDecodeError) as e:
            raise click.UsageError(f"cannot read script {args[0]!r}: {e}") from None
        try:  # sbatch's own reading of the #SBATCH lines (scheduler/slurm/sbatch.py)
            batch = parse(script, (), default_name=script_path.name, submit_dir=os.getcwd())
        except SbatchError as e:
            raise click.UsageError(f"{args[0]}: {e}") from None
        if batch.warning():
            click.echo(batch.warning(), err=True)
        body = batch.to_submit_body(script)
        if body.get("workdir") == os.getcwd():
            # no -D/--chdir: trainyard's default working directory (the job's own, on the node)
            # rather than sbatch's (this directory, which the node may not have); `ty-sbatch`
            # keeps Slurm's and writes slurm-%j.out there
            body.pop("workdir")
            body.pop("submit_dir", None)
        spec.update(body)
    for key, value in opts.items():
        if ctx.get_parameter_source(key) == ParameterSource.COMMANDLINE or (key not in spec and value not in (None, (), False)):
            spec[key] = value
    constraint = spec.get("constraint")
    if isinstance(constraint, str) and "=" not in constraint:  # Slurm's -C a100&ib: node features
        spec["features"] = spec.pop("constraint")
    if spec.get("container_mounts") and isinstance(spec["container_mounts"], str):
        spec["container_mounts"] = [m for m in spec["container_mounts"].split(",") if m]
    try:
        if "nice" in spec:
            spec["nice"] = int(spec["nice"])
        if "time_limit" in spec:
            parse_time_limit(spec["time_limit"], "--time")
        if "mem" in spec:
            parse_mem(spec["mem"], "--mem")
        spec["env"] = parse_env(spec.get("env", ()))
    except ValueError as e:
        raise click.UsageError(str(e)) from None
    job = api(client().submit, spec)
    if as_json:
        print_json(job)
    elif parsable:
        click.echo(job["id"])
    else:
        what = f"array job {job['id']} ({spec['array']})" if spec.get("array") else f"job {job['id']}"
        held = job["state"] == "HELD" or str(job.get("reason") or "").startswith("JobHeld")
        click.echo(f"Submitted {what}" + (" (held)" if held else ""))


def _after_dashdash(args: tuple[str, ...]) -> bool:
    """Whether ARGS came after `--` on the command line (a COMMAND, not a SCRIPT path)."""
    argv = sys.argv[1:]
    return any(a == "--" and argv[i + 1:] == list(args) for i, a in enumerate(argv))


@cli.command()
@click.option("--all", "-a", "all_", is_flag=True, help="Include finished jobs.")
@click.option("--state", "-t", help="Only jobs in these states (comma-separated).")
@click.option("--user", "-u", help="Only this user's jobs.")
@click.option("--queue", "-p", help="Only this queue.")
@click.option("--limit", "-n", type=click.IntRange(1, 100_000), default=5000, show_default=True,
              help="At most this many jobs (the oldest live ones first; with --all the newest first).")
@json_option
def jobs(all_, state, user, queue, limit, as_json):
    """List jobs (pending and running; --all for finished too), like squeue."""
    rows = api(client().jobs, all=all_, state=state, user=user, queue=queue, limit=limit)
    if as_json:
        print_json(rows)
        return
    if len(rows) >= limit:
        click.echo(f"the first {limit:,} jobs only: narrow them with -t, -u or -p, or raise --limit", err=True)
    now = time.time()
    table(
        ["JOBID", "NAME", "USER", "QUEUE", "STATE", "GPUS", "NODES", "TIME", "NODELIST(REASON)"],
        [[j["id"], j["name"][:24], j["user"], j["queue"], j["state"], j["gpus"], j["nodes"],
          fmt_duration(((j["end_time"] or now) - j["start_time"]) if j["start_time"] else None),
          ",".join(a["node"] for a in j["allocation"]) if j["allocation"] else f"({j['reason'] or '-'})"]
         for j in rows],
    )


@cli.command("job")
@click.argument("job_id", type=int)
@json_option
def job_cmd(job_id, as_json):
    """Show one job in full, like `scontrol show job` (with its estimated start when pending)."""
    j = api(client().job, job_id)
    if as_json:
        print_json(j)
        return
    alloc = "; ".join(f"{a['node']}:gpus={','.join(map(str, a['gpus']))}" for a in j["allocation"]) or "-"
    fields = [
        ("JobId", j["id"]), ("Name", j["name"]), ("User", j["user"]), ("Queue", j["queue"]),
        ("State", j["state"]), ("Reason", (j["reason"] or "-") + (f" ({j['reason_detail']})" if j.get("reason_detail") else "")), ("Priority", j["priority"]),
        ("Command", " ".join(j["command"]) if j["command"] else "(script)"),
        ("Gpus", f"{j['gpus']} per node"), ("Nodes", j["nodes"]), ("Cpus", j["cpus"]),
        ("Mem", f"{j['mem']}M" if j["mem"] else "-"), ("TimeLimit", fmt_duration(j["time_limit"])),
        ("Retries", f"{j['failures']}/{j['retries']} used"), ("Attempt", j["attempt"]),
        ("Dependency", j["dependency"] or "-"), ("SubmitTime", fmt_time(j["submit_time"])),
        ("StartTime", fmt_time(j["start_time"])), ("EndTime", fmt_time(j["end_time"])),
        ("EstimatedStart", _estimated_start(j)), ("PredictedRunTime", _predicted_runtime(j)),
        ("ExitCode", j["exit_code"]),
        ("Allocation", alloc), ("WorkDir", j["workdir"] or "(job directory on the node)"),
    ]
    for k, v in fields:
        click.echo(f"{k:>15}: {'-' if v is None else v}")


def _estimated_start(j: dict) -> str:
    if not j.get("estimated_start"):
        return "-"
    basis = j.get("estimated_start_basis")
    return fmt_time(j["estimated_start"]) + (f" (from {basis})" if basis else "")


def _predicted_runtime(j: dict) -> str | None:
    """The run time history predicts and what it is based on (`prediction_basis`)."""
    basis = j.get("prediction_basis")
    if basis and j.get("predicted_runtime_s") is not None and not j.get("prediction_confident"):
        basis += "; not confident: planned with its time limit"
    return basis


def _job_action(action: str, ids: tuple[int, ...], as_json: bool) -> None:
    """One job: its own call. Several: one bulk call per 10,000 (each job acted on or refused as
    its own call would be), then their states in pages of client.IDS_MAX; printed in the order given."""
    from .client import ApiError, Unreachable, id_pages

    c = client()
    try:
        if len(ids) == 1:
            try:
                jobs, errors = {ids[0]: getattr(c, action)(ids[0])}, {}
            except ApiError as e:
                jobs, errors = {}, {ids[0]: e.detail}
        else:
            answer = c.act_many(action, ids)
            errors = {r["id"]: r["detail"] for r in answer["refused"]}
            done = answer["done"]
            wanted = set(done)
            jobs = {j["id"]: j for page in id_pages(done) for j in c.jobs(all=True, ids=page, limit=100_000)
                    if j["id"] in wanted}  # (an array's id also lists its tasks)
    except ApiError as e:  # the bulk call itself refused (a bad list): nothing was done
        fail(e.detail, REFUSED)
    except Unreachable as e:
        fail(str(e), UNREACHABLE)
    results = []
    for job_id in dict.fromkeys(ids):
        if job_id in errors:
            click.echo(f"trainyard: error: {errors[job_id]}", err=True)
            continue
        j = jobs.get(job_id)
        if j is None:
            continue
        results.append(j)
        if not as_json:
            click.echo(f"job {j['id']}: {j['state']}" + (" (stopping)" if action in ("cancel", "requeue")
                                                         and j["state"] in ("RUNNING", "STARTING") else ""))
    if as_json:
        print_json(results)
    if errors:
        sys.exit(REFUSED)


def _make_action(action: str, doc: str):
    @click.argument("ids", nargs=-1, type=int, required=True)
    @json_option
    def command(ids, as_json):
        _job_action(action, ids, as_json)

    command.__doc__ = doc
    return cli.command(action)(command)


_make_action("cancel", "Cancel jobs: pending ones at once, running ones with SIGTERM then SIGKILL.")
_make_action("hold", "Hold pending jobs so they do not start.")
_make_action("release", "Release held jobs.")
_make_action("requeue", "Put jobs back in the queue (a running one is stopped first).")


def _get(c, path: str, **params):
    """GET one /v1 resource with query parameters (None ones left out)."""
    return api(c._call, "GET", path, params={k: v for k, v in params.items() if v is not None})


@cli.command()
@click.argument("job_id", type=int)
@click.option("--follow", "-f", is_flag=True, help="Keep printing as the job writes, until it ends.")
@click.option("--rank", default=0, show_default=True, type=click.IntRange(0), help="Node rank of a multi-node job.")
@click.option("--attempt", type=click.IntRange(0), help="Which run of a requeued job [default: the latest].")
@json_option
def logs(job_id, follow, rank, attempt, as_json):
    """Print a job's output (stdout and stderr), as the daemon keeps it: also once its node is gone."""
    c = client()
    path = f"/v1/jobs/{job_id}/log"
    if as_json:
        r = _get(c, path, offset=0, rank=rank, attempt=attempt, limit=4 * 2**20)
        print_json({"job": job_id, **r})
        return
    offset = waited = 0
    final = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED"}
    while True:
        r = _get(c, path, offset=offset, rank=rank, attempt=attempt, limit=1 << 20)
        if r["data"]:
            sys.stdout.write(r["data"])
            sys.stdout.flush()
        got = r["next"] > offset
        offset = r["next"]
        if got:
            continue
        # a finished job's output may still be on its way from the node: wait for all of it
        ended = r["state"] in final
        waited = waited + 1 if ended else 0
        # ... for at most 10 s: a node that left before sending the end of it will not send more
        if not follow or r.get("complete") or (ended and (r.get("source") not in ("store", "bucket") or waited > 20)):
            return
        time.sleep(0.5)


def _job_refs(ctx, param, value):
    """-j/--jobs as Slurm's commands read it (scheduler/slurm/api.py)."""
    from .slurm.api import job_refs_option  # noqa: PLC0415 (the Slurm commands' parser, loaded when asked)

    return job_refs_option(ctx, param, value)


@cli.command()
@click.option("-S", "--starttime", help="Window start [default: 24 hours ago]; YYYY-MM-DD[THH:MM[:SS]] or now-7days.")
@click.option("-E", "--endtime", help="Window end [default: now].")
@click.option("-u", "--user", help="Only this user's jobs (operators; users see their own).")
@click.option("-s", "--state", help="Only jobs in these states, comma-separated.")
@click.option("-j", "--jobs", "refs", callback=_job_refs,
              help="Only these jobs, at any time unless -S is given: comma-separated ids (an array's id names "
              "its tasks), ARRAY_TASK or ARRAY_[1-3].")
@click.option("-o", "--format", "fmt", default=None, help="Fields, e.g. JobID,User%12,GPUHours [default: "
              "JobID,JobName,Partition,Account,AllocGPUS,State,ExitCode].")
@click.option("-P", "--parsable2", "parsable", is_flag=True, help="'|' between fields.")
@click.option("--csv", "as_csv", is_flag=True, help="CSV with a header line.")
@json_option
def sacct(starttime, endtime, user, state, refs, fmt, parsable, as_csv, as_json):
    """Job accounting, like Slurm's sacct: jobs that existed in the window, in sacct's fields."""
    from . import accounting as acct
    from .daemon.accounting import record_from_json

    start, end = _window(starttime, endtime)
    fmt = fmt or acct.SACCT_DEFAULT
    try:
        acct.parse_format(fmt)
    except ValueError as e:
        fail(str(e), USAGE)
    c = client()
    if refs is None:
        r = _get(c, "/v1/accounting/jobs", start=start, end=end, user=user, state=state)
        found = r["jobs"]
    else:  # a page of ids at a time
        pages = [_get(c, "/v1/accounting/jobs", start=start, end=end, user=user, state=state, ids=ids)
                 for ids in refs.pages()]
        r, found = pages[-1], [j for p in pages for j in p["jobs"] if refs.wants(j)]
    records = [record_from_json(j) for j in found]
    output = "json" if as_json else "csv" if as_csv else "parsable" if parsable else "text"
    click.echo(acct.render_sacct(records, fmt, output, now=r["now"]), nl=False)


def _window(starttime: str | None, endtime: str | None) -> tuple[float | None, float | None]:
    from .accounting import slurm_when

    now = time.time()
    try:
        return (slurm_when(starttime, now) if starttime else None,
                slurm_when(endtime, now) if endtime else None)
    except ValueError as e:
        fail(str(e), USAGE)


@cli.command()
@click.option("--by", type=click.Choice(["account", "user", "queue"]), default="account", show_default=True,
              help="Group by team (account), user or queue.")
@click.option("-S", "--starttime", help="Window start [default: 24 hours ago]; YYYY-MM-DD[THH:MM[:SS]] or now-30days.")
@click.option("-E", "--endtime", help="Window end [default: now].")
@click.option("--csv", "as_csv", is_flag=True, help="CSV with a header line.")
@json_option
def report(by, starttime, endtime, as_csv, as_json):
    """GPU usage like sreport: allocated and idle GPU-hours and cost per team, user or queue."""
    from . import accounting as acct

    start, end = _window(starttime, endtime)
    r = _get(client(), "/v1/accounting/report", by=by, start=start, end=end)
    if as_json:
        print_json(r)
        return
    fields = ("key", "jobs", "gpu_hours", "idle_gpu_hours", "cost", "unpriced_gpu_hours")
    rows = [acct.Usage(**{f: row[f] for f in fields}) for row in r["rows"]]
    output = "csv" if as_csv else "text"
    click.echo(acct.render_report(rows, by, (r["start"], r["end"]), output, r["currency"]), nl=False)


# ------------------------------------------------------------------------------ nodes
@cli.command()
@click.option("--gpus", "per_gpu", is_flag=True, help="One row per GPU: utilisation, memory, temperature, power, health.")
@json_option
def nodes(per_gpu, as_json):
    """List nodes: state, GPUs used/total, model, pool, container runtime and why a node is not UP."""
    rows = api(client().nodes)
    if as_json:
        print_json(rows)
        return
    if per_gpu:
        from .dcgm import format_gpu_rows

        headers, gpu_rows = format_gpu_rows(rows)
        table(headers, gpu_rows)
        return
    from .containers import runtime_word

    table(
        ["NAME", "STATE", "GPUS", "MODEL", "POOL", "ADDRESS", "FENCE", "RUNTIME", "REASON"],
        [[n["name"], n["state"], f"{n['gpus_used']}/{n['gpus_total']}", n["gpu_model"] or "-", n["pool"],
          f"{n['address']}:{n['port']}", fence_word(n.get("fencing")), runtime_word(n.get("agent")),
          n["reason"] or ""] for n in rows],
    )


def fence_word(fencing: dict | None) -> str:
    """How a node isolates jobs, in a word or two: `v1 dev+mem+cpu`, `none` (why: --json)."""
    if not fencing:
        return "-"
    parts = [name for key, name in (("devices", "dev"), ("memory", "mem"), ("cpu", "cpu"), ("pids", "pids"))
             if fencing.get(key)]
    cgroup = fencing.get("cgroup") or "none"
    return f"{cgroup} {'+'.join(parts)}" if parts else "none"


@cli.group()
def node():
    """Register, drain, resume and remove nodes."""


def _labels(items: tuple[str, ...]) -> dict[str, str]:
    out = {}
    for item in items:
        k, sep, v = item.partition("=")
        if not sep or not k:
            raise click.BadParameter(f"{item!r}: expected KEY=VALUE", param_hint="--label")
        out[k] = v
    return out


@node.command("add")
@click.argument("name")
@click.option("--address", required=True, help="Host name or IP the daemon reaches over SSH.")
@click.option("--port", default=22, show_default=True, type=click.IntRange(1, 65535))
@click.option("--user", default="trainyard", show_default=True, help="SSH user on the node.")
@click.option("--key", "key_path", type=click.Path(exists=True, dir_okay=False, resolve_path=True),
              help="Private key [default: the daemon's own key, $TRAINYARD_HOME/ssh/id_ed25519].")
@click.option("--accept-new-host-key", is_flag=True, help="Pin the node's host key on this first contact.")
@click.option("--gpus", type=click.IntRange(0, 64), help="GPUs to assume when the node has no NVML.")
@click.option("--gpu-model", help="GPU model to assume when the node has no NVML.")
@click.option("--pool", default="default", show_default=True)
@click.option("--label", multiple=True, help="KEY=VALUE node label (repeatable), e.g. rack=r12.")
@click.option("--agent-dir", default="",
              help="Agent's directory on the node's own disk [default: /var/lib/trainyard as root].")
@click.option("--privilege", type=click.Choice(["login", "sudo"]), default="login", show_default=True,
              help="login: the agent runs as --user (root on GPU nodes); sudo: --user may start exactly "
                   "the agent as root through the rule `trainyard bootstrap` installs (docs/nodes.md).")
@json_option
def node_add(name, address, port, user, key_path, accept_new_host_key, gpus, gpu_model, pool, label,
             agent_dir, privilege, as_json):
    """Register a node: pin its host key, check SSH and python3, then connect its agent."""
    spec = {"name": name, "address": address, "port": port, "user": user, "key_path": key_path,
            "accept_new_host_key": accept_new_host_key, "gpus": gpus, "gpu_model": gpu_model,
            "pool": pool, "labels": _labels(label), "agent_dir": agent_dir, "privilege": privilege}
    n = api(client().add_node, spec)
    if as_json:
        print_json(n)
    else:
        click.echo(f"node {n['name']} added ({n['address']}:{n['port']}); its agent is connecting")


@node.command("import")
@click.argument("inventory", type=click.File("r"))
@click.option("--accept-new-host-key", is_flag=True, help="Pin the host keys of these nodes on first contact.")
@json_option
def node_import(inventory, accept_new_host_key, as_json):
    """Register every node of an inventory document (JSON; `-` for stdin), e.g. from `trainyard infra outputs`."""
    try:
        doc = json.load(inventory)
    except ValueError as e:
        raise click.BadParameter(f"not JSON: {e}", param_hint="INVENTORY") from None
    if isinstance(doc, dict) and "inventory" in doc:
        doc = doc["inventory"]
    if not isinstance(doc, list):
        raise click.BadParameter("expected a JSON list of nodes", param_hint="INVENTORY")
    for item in doc:
        if isinstance(item, dict) and accept_new_host_key:
            item["accept_new_host_key"] = True
    results = api(client().import_nodes, doc)
    if as_json:
        print_json(results)
    else:
        for r in results:
            click.echo(f"{r['name']}: " + ("added" if r["ok"] else f"FAILED: {r['error']}"))
    if not all(r["ok"] for r in results):
        sys.exit(REFUSED)


@node.command("show")
@click.argument("name")
@json_option
def node_show(name, as_json):
    """One node in full: state and why, fencing, health checks, and its cached container images."""
    from .client import ApiError

    c = client()
    n = api(c.node, name)
    try:
        n["images"] = c.node_images(name)
    except ApiError as e:  # the node is not connected: say so, show the rest
        n["images"] = {"error": e.detail}
    if as_json:
        print_json(n)
        return
    click.echo(f"node {n['name']}: {n['state']}{' (' + n['reason'] + ')' if n['reason'] else ''}")
    click.echo(f"  address {n['address']}:{n['port']} as {n['user']} ({n.get('privilege', 'login')}), "
               f"pool {n['pool']}, GPUs {n['gpus_used']}/{n['gpus_total']} {n['gpu_model'] or ''}")
    click.echo(f"  fencing: {fence_word(n.get('fencing'))}"
               + (f" ({n['fencing'].get('reason')})" if (n.get("fencing") or {}).get("reason") else ""))
    checks = n.get("health_checks") or {}
    if checks:
        click.echo(f"  health gate: {checks.get('status', '-')}"
                   + "".join(f"; {c.get('check')}: {c.get('result')}" + (f" ({c['detail']})" if c.get("detail") else "")
                             for c in checks.get("checks") or ()))
    images = n["images"]
    if images.get("error"):
        click.echo(f"  images: unknown ({images['error']})")
    elif images.get("runtime"):
        rows = [[(i.get("refs") or ["-"])[0], (i.get("digest") or "-")[:19], _size(i.get("size")),
                 _ago(i.get("last_used"))] for i in images.get("images", [])]
        click.echo(f"  images ({images['runtime']}, cache limit {_size(images.get('high_water'))}):")
        table(["IMAGE", "DIGEST", "SIZE", "USED"], rows) if rows else click.echo("    none cached")
    else:
        click.echo("  images: no container runtime on this node")
    cont = (n.get("agent") or {}).get("containers") or {}
    if cont.get("runtime"):
        how = (f"by CDI name ({cont.get('cdi_spec')})" if cont.get("cdi")
               else "by device node" + (f" ({cont['cdi_note']})" if cont.get("cdi_note") else ""))
        click.echo(f"  GPUs to containers: {how}")
        if cont.get("init_note"):
            click.echo(f"  containers: {cont['init_note']}")


def _size(n) -> str:
    if not n:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return "-"


def _ago(t) -> str:
    import time as _t

    if not t:
        return "-"
    s = max(0, _t.time() - float(t))
    return f"{s:.0f}s ago" if s < 120 else f"{s / 60:.0f}m ago" if s < 7200 else f"{s / 3600:.0f}h ago"


@node.command("drain")
@click.argument("name")
@click.option("--reason", required=True, help="Why (shown in `trainyard nodes`).")
@json_option
def node_drain(name, reason, as_json):
    """Stop new work on a node; running jobs finish (DRAINING, then DRAINED)."""
    n = api(client().drain_node, name, reason)
    print_json(n) if as_json else click.echo(f"node {n['name']}: {n['state']} ({n['reason']})")


@node.command("resume")
@click.argument("name")
@click.option("--force", is_flag=True, help="Skip the health gate's checks (audited).")
@json_option
def node_resume(name, force, as_json):
    """Return a drained or down node to service, once the health gate's checks pass."""
    n = api(client().resume_node, name, force)
    print_json(n) if as_json else click.echo(f"node {n['name']}: {n['state']}")


@node.command("fault")
@click.argument("name")
@click.option("--gpu", required=True, type=click.IntRange(0, 63), help="GPU index on the node.")
@click.option("--xid", type=click.IntRange(1, 999), help="Raise this XID error (e.g. 79: fell off the bus).")
@click.option("--ecc-dbe", is_flag=True, help="Add a double-bit ECC error.")
@click.option("--temp", type=click.IntRange(0, 150), help="Hold the temperature at this many °C.")
@click.option("--off-bus", is_flag=True, help="Make the GPU fall off the bus.")
@click.option("--remap-pending", is_flag=True, help="Report a pending row remap (fails the health gate).")
@click.option("--clear", is_flag=True, help="Clear the GPU's injected faults.")
def node_fault(name, gpu, xid, ecc_dbe, temp, off_bus, remap_pending, clear):
    """Inject a GPU fault on a demo node (simulated GPUs only) to watch the health rules act."""
    chosen = [(k, v) for k, v, on in (("xid", xid, xid is not None), ("ecc_dbe", None, ecc_dbe),
                                       ("temp", temp, temp is not None), ("off_bus", None, off_bus),
                                       ("remap_pending", None, remap_pending), ("clear", None, clear)) if on]
    if len(chosen) != 1:
        raise click.UsageError("give exactly one of --xid N, --ecc-dbe, --temp C, --off-bus, --remap-pending, "
                               "--clear")
    kind, value = chosen[0]
    api(client().fault_node, name, gpu, kind, value)
    click.echo(f"node {name} GPU {gpu}: {kind.replace('_', '-')}{'' if value is None else ' ' + str(value)} injected")


@node.command("remove")
@click.argument("name")
@click.option("--force", is_flag=True, help="Remove even while jobs run there (they are lost to the daemon).")
def node_remove(name, force):
    """Forget a node and unpin its host key (add it again with --accept-new-host-key)."""
    api(client().remove_node, name, force)
    click.echo(f"node {name} removed")


# ------------------------------------------------------------------------------ queues, tokens
@cli.command()
@json_option
def queues(as_json):
    """List queues with their pending and running jobs and GPUs in use."""
    rows = api(client().queues)
    if as_json:
        print_json(rows)
        return
    table(["QUEUE", "STATE", "PRIORITY", "PENDING", "RUNNING", "GPUS", "DEFAULT_TIME", "MAX_TIME"],
          [[q["name"], q["state"], q["priority"], q["pending"], q["running"], q["gpus_used"],
            fmt_duration(q["default_time_limit"]), fmt_duration(q["max_time_limit"])] for q in rows])


@cli.command()
@json_option
def teams(as_json):
    """Teams: GPU quota (nominal/borrowing/lending), GPUs in use, decayed fair-share usage, jobs."""
    rows = api(client().teams)
    if as_json:
        print_json(rows)
        return

    def q(v):
        return "-" if v is None else v

    table(["TEAM", "COHORT", "GPUS", "NOMINAL", "BORROW", "LEND", "SHARES", "USAGE_GPU_H", "RUNNING", "PENDING"],
          [[t["name"], q(t["cohort"]), t["gpus_used"], q(t["nominal_gpus"]), q(t["borrowing_limit_gpus"]),
            q(t["lending_limit_gpus"]), t["fairshare_shares"], t["usage_gpu_hours"], t["running"], t["pending"]]
           for t in rows])


@cli.group()
def token():
    """API tokens."""


@token.command("create")
@click.argument("user")
@click.option("--role", required=True, type=click.Choice(["admin", "operator", "user"]))
@json_option
def token_create(user, role, as_json):
    """Create a token for USER (shown once; only its hash is stored)."""
    t = api(client().create_token, user, role)
    if as_json:
        print_json(t)
    else:
        click.echo(t["token"])
        click.echo(f"token for {t['user']} ({t['role']}); it is shown only now", err=True)


@token.command("list")
@json_option
def token_list(as_json):
    """List tokens: id, user, role, when and by whom created (never the secrets)."""
    rows = api(client().tokens)
    if as_json:
        print_json(rows)
        return
    table(["ID", "USER", "ROLE", "CREATED", "BY"],
          [[t["id"], t["user"], t["role"], fmt_time(t["created_at"]), t["created_by"]] for t in rows])


@token.command("revoke")
@click.argument("token_id", type=int)
def token_revoke(token_id):
    """Revoke a token by its id (see `trainyard token list`); it is refused from then on."""
    t = api(client().revoke_token, token_id)
    click.echo(f"token {t['id']} of {t['user']} revoked")


@cli.command()
@click.option("--since", type=click.IntRange(0), help="Events after this id (0: from the start of the trail).")
@click.option("-n", "--limit", default=50, show_default=True, type=click.IntRange(1, 10000))
@click.option("-f", "--follow", is_flag=True, help="Keep printing new events as they happen.")
@json_option
def events(since, limit, follow, as_json):
    """The audit trail: who did what to which job or node, when, and why."""
    import time as _time

    def line(e: dict) -> str:
        d = e.get("detail") or {}
        why = d.get("reason") or d.get("state") or d.get("error") or ""
        when = _time.strftime("%Y-%m-%d %H:%M:%S", _time.localtime(e["time"]))
        return f"{e['id']:>7}  {when}  {e['actor'] or '-':<12} {e['action']:<20} {e['target']:<14} {why}".rstrip()

    c = client()
    last = since or 0
    for e in api(c.events, since, limit):
        click.echo(json.dumps(e) if as_json else line(e))
        last = max(last, e["id"])
    if follow:
        try:
            for e in c.stream_events(since=last):
                if e["id"] > last:
                    last = e["id"]
                    click.echo(json.dumps(e) if as_json else line(e))
        except KeyboardInterrupt:
            return


@cli.command()
@click.option("--reset", is_flag=True, help="Start the counts and worst cases again from now (operators).")
@json_option
def diag(reset, as_json):
    """The daemon's own load, as Slurm's sdiag: how late its event loop runs (every request and
    agent report waits that long), its scheduling cycles, the jobs it took in and ended, the
    agents' messages and the API's requests (by user, for operators) since it started or the
    last --reset."""
    d = api(client().diag, reset)
    if as_json:
        print_json(d)
        return
    lag, cyc, jobs, agents, req = d["loop"], d["scheduler"], d["jobs"], d["agents"], d["api"]

    def n(count: int, word: str) -> str:  # "1 cycle", "2 cycles"
        return f"{count:,} {word}{'' if count == 1 else 's'}"

    ended = ", ".join(f"{k} {v:,}" for k, v in jobs.items() if k not in ("submitted", "started", "now"))
    now = ", ".join(f"{k} {v:,}" for k, v in jobs["now"].items())
    slow_key = next(k for k in lag if k.startswith("over_"))
    rows = [
        ["daemon", f"{d['role']} ({d['database']}), pid {d['pid']}, up {fmt_duration(d['uptime_s'])}"
                   + (f"; {d['reason']}" if d.get("reason") else "")],
        ["since", f"{fmt_time(d['since'])} ({fmt_duration(d['window_s'])})" + ("; reset now" if reset else "")],
        ["event loop lag", f"last {lag['last_ms']:.1f} ms, mean {lag['mean_ms']:.1f} ms, p99 {lag['p99_ms']:.1f} ms "
                           f"(last {n(lag['window_samples'], 'sample')}), max {lag['max_ms']:.1f} ms; "
                           f"{lag[slow_key]:,} of {n(lag['samples'], 'sample')} over {slow_key.removeprefix('over_')}"],
        ["scheduling", f"{n(cyc['cycles'], 'cycle')}, last {cyc['last_ms']:.1f} ms, mean {cyc['mean_ms']:.1f} ms, "
                       f"max {cyc['max_ms']:.1f} ms; last queue length {cyc['last_queue_length']:,}; "
                       f"{n(cyc['jobs_started'], 'job')} started"],
        ["jobs", f"submitted {jobs['submitted']:,}, started {jobs['started']:,}; ended: {ended}"],
        ["jobs now", now or "none"],
        ["agents", f"{agents['connected']} of {n(agents['nodes'], 'node')} connected; "
                   f"{n(agents['messages'], 'message')} ({agents['messages_per_s']:,}/s)"],
        ["api", f"{n(req['requests'], 'request')} ({req['requests_per_s']:,}/s) from {n(req['users'], 'user')}; "
                f"{n(req['reads'], 'read')} of jobs, events or accounting took {req['read_cpu_s']:.2f} s of CPU, "
                f"{req['reads_throttled']:,} refused (429)"],
    ]
    rows += [["  " + u["user"], f"{n(u['requests'], 'request')}, {n(u['reads'], 'read')} "
                                f"({u['read_cpu_s']:.2f} s of CPU), {u['reads_throttled']:,} refused"]
             for u in req.get("by_user", [])]
    width = max(len(r[0]) for r in rows)
    for label, text in rows:
        click.echo(f"{label:<{width}}  {text}")


@cli.command()
@json_option
def whoami(as_json):
    """Show who the configured token belongs to, and its role."""
    me = api(client().me)
    print_json(me) if as_json else click.echo(f"{me['user']} ({me['role']})")


def main() -> None:
    cli()


if __name__ == "__main__":
    main()
