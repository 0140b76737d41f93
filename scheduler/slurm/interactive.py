"""salloc and `srun --pty` for people: hold an allocation and open a terminal in it, through the
daemon (its WebSocket route /v1/jobs/{id}/pty relays over the node's link; no SSH to the node).

`salloc [sbatch options] [CMD...]` submits a job whose step only holds the allocation, waits
until it runs ("Granted job allocation ID"), runs CMD (default: the owner's shell) on the job's
first node in a terminal, and cancels the job when CMD ends ("Relinquishing job allocation ID").
`srun --pty CMD` does the same for CMD, or opens CMD in the allocation `SLURM_JOB_ID` (or
`--jobid`) names. The local terminal is in raw mode while the remote one runs; window size
changes follow (SIGWINCH); the exit status is the remote command's.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import sys
import threading
import time
from pathlib import Path
from urllib.parse import urlencode

import click

from .api import EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_USAGE, api_fields, call, client, fail

# the step of an allocation: it holds the job's nodes, GPUs and cgroups until the job is cancelled
HOLDER = ["sleep", "infinity"]
WAITING = {"PENDING", "HELD", "CONFIGURING", "STARTING"}
POLL_S = 0.5


# ----------------------------------------------------------------------------- the terminal
def _size(fd: int) -> tuple[int, int]:
    try:
        size = os.get_terminal_size(fd)
    except OSError:
        return 24, 80
    return (size.lines or 24), (size.columns or 80)  # a new pty says 0 x 0


def pty_url(base: str, job_id: int, argv: list[str] | None, rows: int, cols: int, rank: int = 0,
            cwd: str | None = None) -> str:
    params: list[tuple[str, object]] = [("rank", rank), ("rows", rows), ("cols", cols)]
    if cwd:
        params.append(("cwd", cwd))
    term = os.environ.get("TERM", "")
    if term and all(ch.isalnum() or ch in "._+-" for ch in term):
        params.append(("term", term))
    params += [("argv", a) for a in argv or ()]
    ws = "wss" + base[len("https"):] if base.startswith("https") else "ws" + base[len("http"):]
    return f"{ws.rstrip('/')}/v1/jobs/{job_id}/pty?{urlencode(params)}"


def run_terminal(prog: str, base: str, token: str, job_id: int, argv: list[str] | None,
                 cwd: str | None = None, rank: int = 0) -> int:
    """Open a terminal in the job and copy it to and from this one; the remote exit status.
    `cwd`: where the command starts when the node has it (else in the job's directory)."""
    import termios
    import tty

    from websockets.exceptions import ConnectionClosed, InvalidStatus, InvalidURI
    from websockets.sync.client import connect

    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()
    rows, cols = _size(stdout if os.isatty(stdout) else stdin)
    try:
        ws = connect(pty_url(base, job_id, argv, rows, cols, rank, cwd),
                     additional_headers={"Authorization": f"Bearer {token}"}, open_timeout=30,
                     max_size=2**22)
    except InvalidStatus as e:
        try:
            detail = json.loads(e.response.body or b"{}").get("detail") or str(e)
        except ValueError:
            detail = str(e)
        fail(detail, EXIT_REFUSED, prog)
    except (OSError, TimeoutError, InvalidURI) as e:
        fail(f"cannot reach the daemon at {base}: {e}", EXIT_UNREACHABLE, prog)
    outbox: queue.Queue = queue.Queue()

    def sender() -> None:
        while (item := outbox.get()) is not None:
            try:
                ws.send(item)
            except ConnectionClosed:
                return

    def reader() -> None:
        while True:
            try:
                data = os.read(stdin, 4096)
            except OSError:
                data = b""
            if not data:  # the input ended: end the remote input too (^D at a line's start)
                outbox.put(b"\x04")
                return
            outbox.put(data)

    raw = os.isatty(stdin)
    saved = termios.tcgetattr(stdin) if raw else None
    old_winch = signal.signal(signal.SIGWINCH, lambda *_: outbox.put(json.dumps({"resize": list(_size(
        stdout if os.isatty(stdout) else stdin))})))
    rc: int | None = None
    reason = ""
    try:
        if raw:
            tty.setraw(stdin, termios.TCSADRAIN)  # DRAIN, not FLUSH: keep what was typed ahead
        threading.Thread(target=sender, daemon=True).start()
        threading.Thread(target=reader, daemon=True).start()
        while True:
            try:
                frame = ws.recv()
            except ConnectionClosed:
                break
            if isinstance(frame, bytes):
                view = memoryview(frame)
                while view:  # a pipe or a slow terminal may take a frame in pieces
                    view = view[os.write(stdout, view):]
                continue
            msg = json.loads(frame)
            if "exit" in msg:
                rc, reason = msg["exit"], msg.get("reason") or ""
                break
    finally:
        if saved is not None:
            termios.tcsetattr(stdin, termios.TCSADRAIN, saved)
        signal.signal(signal.SIGWINCH, old_winch)
        outbox.put(None)
        ws.close()
    if reason:
        click.echo(f"{prog}: {reason}", err=True)
    if rc is None:
        click.echo(f"{prog}: error: the terminal closed without an exit status", err=True)
        return 1
    return rc


# ----------------------------------------------------------------------------- allocations
def _split(args: tuple[str, ...], prog: str) -> tuple[list[str], list[str], dict]:
    """(sbatch options, the command, srun's own flags) from salloc's or srun's command line."""
    from .sbatch import split_argv

    own: dict = {"pty": False, "jobid": None}
    rest: list[str] = []
    items = list(args)
    while items and items[0].startswith("-"):
        arg = items.pop(0)
        if prog == "srun" and arg == "--pty":
            own["pty"] = True
        elif prog == "srun" and (arg.startswith("--jobid=") or arg == "--jobid"):
            value = arg.partition("=")[2] or (items.pop(0) if items else "")
            if not value.split("_")[0].isdigit():
                fail(f"Invalid job id {value!r} in --jobid; give a number such as 42", EXIT_USAGE, prog)
            own["jobid"] = int(value.split("_")[0])
        elif prog == "srun" and arg in ("--overlap", "-u", "--unbuffered"):
            continue  # one terminal, unbuffered already; steps always overlap here
        elif arg == "--":
            break
        else:
            rest.append(arg)
            if "=" not in arg and items:  # the option's value, if sbatch's parser says it takes one
                options, _, _ = split_argv([arg, items[0], "CMD"])
                if len(options) == 2:
                    rest.append(items.pop(0))
    return rest, items, own


def _submit(c, prog: str, options: list[str], command: list[str]) -> tuple[dict, str | None]:
    """Submit the allocation's job: the job, and where its terminal starts (here, unless
    --chdir named the job's directory)."""
    from .sbatch import SbatchError, parse

    try:
        spec = parse(None, options, default_name=Path(command[0]).name if command else "interactive")
    except SbatchError as e:
        fail(str(e), EXIT_USAGE, prog)
    if spec.warning():
        click.echo(spec.warning().replace("sbatch:", f"{prog}:", 1), err=True)
    body = spec.to_submit_body(command=HOLDER)
    for key in ("workdir", "submit_dir", "output", "error"):
        # the holder needs no directory on the node and writes no file; the terminal starts in
        # this directory where the node has it (run_terminal's cwd)
        body.pop(key, None)
    if "chdir" in spec.origins:
        body["workdir"] = spec.workdir
    known = api_fields(c.url)
    if known is not None:
        body = {k: v for k, v in body.items() if k in known}
    job = call(c.submit, body, prog=prog)
    if prog == "salloc":
        click.echo(f"salloc: Pending job allocation {job['id']}", err=True)
    return job, None if "chdir" in spec.origins else os.getcwd()


def _wait_running(c, prog: str, job: dict) -> None:
    """Wait until the allocation's job runs, saying so in Slurm's words."""
    job_id = job["id"]
    said_waiting = False
    while job["state"] in WAITING:
        if not said_waiting and job["state"] in ("PENDING", "HELD"):
            click.echo(f"{prog}: job {job_id} queued and waiting for resources", err=True)
            said_waiting = True
        time.sleep(POLL_S)
        job = call(c.job, job_id, prog=prog)
    if job["state"] != "RUNNING":
        fail(f"job {job_id} ended {job['state']} before it ran: {job.get('reason') or 'no reason given'}",
             EXIT_REFUSED, prog)
    if said_waiting:
        click.echo(f"{prog}: job {job_id} has been allocated resources", err=True)
    if prog == "salloc":
        click.echo(f"salloc: Granted job allocation {job_id}", err=True)


def _hold_and_run(prog: str, options: list[str], command: list[str]) -> int:
    """salloc: allocate, run the command in a terminal, give the allocation back on every exit."""
    from ..client import ApiError, Unreachable, load_settings

    c = client()
    token = load_settings()[1]
    job_id: int | None = None
    granted = False

    def stop(signum, _frame):
        raise KeyboardInterrupt

    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGHUP)}
    try:
        job, here = _submit(c, prog, options, command)
        job_id = job["id"]
        _wait_running(c, prog, job)
        granted = True
        return run_terminal(prog, c.url, token, job_id, command or None, here)
    except KeyboardInterrupt:
        if job_id is not None and not granted:
            click.echo(f"{prog}: Job allocation {job_id} has been revoked.", err=True)
        return 128 + signal.SIGINT
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if job_id is not None:
            if prog == "salloc" and granted:
                click.echo(f"salloc: Relinquishing job allocation {job_id}", err=True)
            try:
                c.cancel(job_id)
            except ApiError as e:
                if e.status != 409:  # 409: the job has ended already
                    click.echo(f"{prog}: error: cannot cancel job {job_id}: {e.detail}", err=True)
            except Unreachable as e:
                click.echo(f"{prog}: error: cannot cancel job {job_id}: {e}", err=True)


_SETTINGS = {"ignore_unknown_options": True, "allow_interspersed_args": False,
             "help_option_names": ["--help"]}


@click.command("salloc", context_settings=_SETTINGS)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def salloc(args):
    """Hold an allocation and run CMD (default: your shell) in it: `salloc [OPTIONS] [CMD...]`."""
    options, command, _ = _split(args, "salloc")
    sys.exit(_hold_and_run("salloc", options, command))


@click.command("srun", context_settings=_SETTINGS)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def srun(args):
    """Run CMD in a terminal in a job: `srun --pty [OPTIONS] CMD...` (in the allocation named by
    SLURM_JOB_ID or --jobid, else in a new one)."""
    from ..client import load_settings

    options, command, own = _split(args, "srun")
    if not command:
        fail("a command is required: `srun --pty [OPTIONS] CMD...`, e.g. srun --pty bash", EXIT_USAGE, "srun")
    if not own["pty"]:
        fail("on a login host srun runs interactive steps only: use `srun --pty CMD` (or sbatch for "
             "batch work; inside a job, srun launches the job's tasks)", EXIT_USAGE, "srun")
    job = own["jobid"] or os.environ.get("SLURM_JOB_ID")
    if job is None:
        sys.exit(_hold_and_run("srun", options, command))
    if not str(job).isdigit():
        fail(f"SLURM_JOB_ID={job!r} is not a job id; unset it or give --jobid", EXIT_USAGE, "srun")
    c = client()
    sys.exit(run_terminal("srun", c.url, load_settings()[1], int(job), command, os.getcwd()))
