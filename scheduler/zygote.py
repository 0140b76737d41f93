"""Job supervisors forked from a pre-loaded process (a zygote), not started as fresh interpreters.

Part of the agent's bundle (standard library, Python 3.8). The agent is threaded, so it never
forks itself: it starts one single-threaded zygote (`python3 -S <bundle> zygote`) that has
imported the job step (jobstep.py) and waits on a socket for job directories. Each one goes
to a supervisor that leads a session of its own and runs `jobstep.run(job_dir)` exactly as
`wrap` does, with nothing of the zygote's descriptors; the zygote reaps them. The supervisor is
forked ahead of its job (the spare, which waits on a pipe), so a job's start waits for neither
an interpreter's start (about 75 ms) nor a fork.

Exactly once: a supervisor first claims its job directory by creating `wpid` exclusively
(jobstep rewrites it with the same pid). When the zygote dies or hangs with a request in
flight, the agent claims the directory itself before it falls back to a fresh interpreter
(today's `wrap`); whichever claim comes first runs the job, the other starts nothing. The
agent says once on stderr that it fell back, and starts a new zygote for the next job.

The zygote ends when the agent goes away (end of file on its socket) and never outlives it;
its spare ends with it (end of file on its pipe).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import signal
import socket
import sys

# Only what the zygote itself needs is imported here: every supervisor is a copy of it, and a
# smaller process forks and exits faster (about 0.4 ms a job less than with subprocess,
# threading and what jobstep no longer imports up front). The agent's side (class Zygote)
# imports subprocess and threading where it uses them; the agent has them loaded anyway.
if __package__:
    from . import jobstep
else:  # inside the agent's bundle on a node
    import jobstep

__all__ = ["Zygote", "claim", "main", "serve"]

# a zygote that does not answer in this time is taken for hung: killed, and replaced
REPLY_TIMEOUT_S = 10.0
# after this many zygotes in a row fail, supervisors are fresh interpreters for good
MAX_FAILURES = 3
# the signals a fresh interpreter has its own dispositions for, restored in each supervisor
_RESTORED = (signal.SIGCHLD, signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def claim(job_dir: str, pid: int) -> bool:
    """Claim `job_dir` for the supervisor `pid`: create `wpid` holding it, exclusively and with
    its content in place at once. False when another process claimed it first."""
    path = os.path.join(job_dir, "wpid")
    tmp = f"{path}.{os.getpid()}.claim"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, str(pid).encode())
    finally:
        os.close(fd)
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    finally:
        os.unlink(tmp)
    return True


# ------------------------------------------------------------------ the zygote process
def main(argv: list) -> int:
    if argv:
        sys.stderr.write("usage: agent zygote (job directories arrive on standard input)\n")
        return 2
    try:
        serve(socket.socket(fileno=os.dup(0)))
    except KeyboardInterrupt:
        return 130
    return 0


def serve(sock: socket.socket) -> None:
    """Hand each `{"dir": ...}` line on `sock` to a supervisor, answer `{"pid": ...}` (or
    `{"error": ...}`); return at end of file (the agent went away).

    The supervisor is the spare: a child forked after the previous request was answered, that
    has already become a supervisor (its own session, signals reset, nothing of the zygote's
    descriptors but its pipe) and waits on that pipe for a job directory. A job's start then
    waits for no fork (about 2.5 ms of the way from launch to running here); the next spare is
    forked once the answer is sent. A spare that went away is replaced by a fork on the spot."""
    fresh = {sig: signal.getsignal(sig) for sig in _RESTORED}
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # the socket arrived as stdin and stdout: `sock` holds it now
        os.dup2(null, fd)
    os.close(null)
    signal.signal(signal.SIGCHLD, _reap)
    os.chdir("/")  # pin no job's or agent's directory
    gc.freeze()  # what is loaded now stays shared with every supervisor (copy-on-write)
    spare = _fork_spare(fresh)
    reader = sock.makefile("rb")
    for line in reader:
        _reap()
        try:
            job_dir = json.loads(line)["dir"]
        except (ValueError, KeyError, TypeError) as e:
            _answer(sock, {"error": f"bad request {line[:200]!r}: {e}"})
            continue
        pid = _hand_to(spare, job_dir) if spare is not None else None
        if pid is None:
            try:
                pid = os.fork()
            except OSError as e:
                _answer(sock, {"error": f"cannot fork a supervisor for {job_dir}: {e}"})
                continue
            if pid == 0:
                _become_supervisor(fresh)
                _supervise(job_dir)
        _answer(sock, {"pid": pid})
        spare = _fork_spare(fresh)  # off the way of this job: it runs meanwhile
    if spare is not None:
        os.close(spare[1])  # the spare reads end of file and exits


def _fork_spare(fresh: dict):
    """(pid, the pipe to hand it a job directory on), or None when no process can be forked."""
    try:
        r, w = os.pipe()
    except OSError:
        return None
    try:
        pid = os.fork()
    except OSError:
        os.close(r)
        os.close(w)
        return None
    if pid == 0:
        os.close(w)
        _become_supervisor(fresh, keep=r)
        data = b""
        while not data.endswith(b"\n"):
            chunk = os.read(r, 65536)
            if not chunk:  # the zygote went away before it had a job for this spare
                os._exit(0)
            data += chunk
        os.close(r)
        _supervise(json.loads(data)["dir"])
    os.close(r)
    return pid, w


def _hand_to(spare: tuple, job_dir: str) -> int | None:
    """Give the spare its job; its pid, or None when it is gone (the zygote then forks)."""
    pid, w = spare
    data = json.dumps({"dir": job_dir}).encode() + b"\n"
    try:
        while data:
            data = data[os.write(w, data):]
    except OSError:  # it died (broken pipe): whatever it read is not a whole line, so it runs nothing
        return None
    finally:
        os.close(w)
    return pid


def _answer(sock: socket.socket, reply: dict) -> None:
    sock.sendall(json.dumps(reply).encode() + b"\n")


def _reap(*_signal) -> None:
    """Collect every supervisor that has ended (they are the zygote's children)."""
    while True:
        try:
            pid, _status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _become_supervisor(fresh: dict, keep: int = -1) -> None:
    """In a forked child: what a fresh interpreter's supervisor would have (the signals' own
    dispositions, a session of its own, /dev/null as 0-2 and no other descriptor but `keep`)."""
    try:
        for sig, handler in fresh.items():
            if handler is not None:  # None: set outside Python, left as it is
                signal.signal(sig, handler)
        os.setsid()
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):
            os.dup2(null, fd)
        top = os.sysconf("SC_OPEN_MAX")
        if keep < 3:
            os.closerange(3, top)
        else:
            os.closerange(3, keep)
            os.closerange(keep + 1, top)
    except BaseException:  # noqa: BLE001 - never back into the zygote's loop
        os._exit(1)


def _supervise(job_dir: str) -> None:
    """In a supervisor: claim the job directory, run the job step as `wrap` would, never return."""
    code = 1
    try:
        if not claim(job_dir, os.getpid()):
            code = 0  # the agent started this job itself (the zygote answered too late)
            return
        sys.argv = [sys.argv[0], "wrap", job_dir]
        code = jobstep.run(job_dir)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:  # noqa: BLE001 - as an interpreter would: a traceback, status 1
        with contextlib.suppress(Exception):
            import traceback  # noqa: PLC0415 - see the imports above

            traceback.print_exc()
            sys.stderr.flush()
    finally:
        os._exit(code)


# ------------------------------------------------------------------ the agent's side
class Zygote:
    """The agent's side: starts job supervisors through the zygote, or as fresh interpreters
    when there is none."""

    def __init__(self, entry: str, python: str = sys.executable,
                 reply_timeout_s: float = REPLY_TIMEOUT_S, forking: bool = True):
        self.entry = entry
        self.forking = forking  # False: every supervisor a fresh interpreter (as before zygotes)
        self.python = python
        self.reply_timeout_s = reply_timeout_s
        self.proc = None  # the zygote (a subprocess.Popen) while it runs
        self.sock: socket.socket | None = None
        self.failures = 0  # zygotes in a row that died or could not start
        import threading  # noqa: PLC0415 - see the imports above

        self.lock = threading.Lock()  # one request in flight: launches from any agent thread

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def start(self) -> None:
        """Start the zygote unless it runs (or failed too often); it loads while the agent works."""
        if self.proc is not None or not self.forking or self.failures >= MAX_FAILURES:
            return
        import subprocess  # noqa: PLC0415 - see the imports above

        ours, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [self.python, "-S", self.entry, "zygote"], stdin=theirs, stdout=theirs,
                cwd="/", env=dict(os.environ), close_fds=True)
        except OSError as e:
            ours.close()
            self._failed(f"cannot start it: {e}")
            return
        finally:
            theirs.close()
        ours.settimeout(self.reply_timeout_s)
        self.sock = ours

    def launch(self, job_dir: str):  # subprocess.Popen | None (not imported here: see the imports)
        """Start the supervisor of `job_dir`. None: the zygote forked it (not the agent's child);
        else the fresh interpreter started instead, for the agent to reap."""
        with self.lock:
            return self._launch(job_dir)

    def _launch(self, job_dir: str):
        self.start()
        if self.sock is not None:
            try:
                reply = self._ask({"dir": job_dir})
            except socket.timeout:  # noqa: UP041 - Python 3.8 on nodes: not TimeoutError there
                self._failed(f"no answer in {self.reply_timeout_s:g} s", hung=True)
            except (OSError, EOFError, ValueError) as e:
                self._failed(str(e) or type(e).__name__)
            else:
                if "pid" in reply:
                    self.failures = 0
                    return None
                sys.stderr.write(f"trainyard agent: the supervisor zygote: {reply.get('error')}; "
                                 f"starting this job's supervisor as a fresh interpreter\n")
                sys.stderr.flush()
        if not claim(job_dir, os.getpid()):
            return None  # the zygote forked it after all, just before it went away
        import subprocess  # noqa: PLC0415 - see the imports above

        return subprocess.Popen(
            # -S: the supervisor needs only the standard library; no site-packages to scan
            [self.python, "-S", self.entry, "wrap", job_dir], cwd=job_dir, env=dict(os.environ),
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True, close_fds=True,
        )

    def _ask(self, request: dict) -> dict:
        self.sock.sendall(json.dumps(request).encode() + b"\n", socket.MSG_NOSIGNAL)
        data = b""
        while not data.endswith(b"\n"):
            chunk = self.sock.recv(4096)  # socket.timeout (an OSError) when the zygote hangs
            if not chunk:
                raise EOFError("it went away")
            data += chunk
        return json.loads(data)

    def _failed(self, why: str, hung: bool = False) -> None:
        """The zygote died, hung or never started: end it, say so once, start a new one later."""
        import subprocess  # noqa: PLC0415 - see the imports above

        status = ""
        if self.proc is not None:
            status = f" (pid {self.proc.pid})"
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(0 if hung else 1.0)  # a zygote that went away is exiting
            if self.proc.poll() is None:  # hung: ended here
                self.proc.kill()
            else:
                rc = self.proc.returncode
                status = f" (pid {self.proc.pid}, {f'signal {-rc}' if rc < 0 else f'status {rc}'})"
            self.proc.wait()
        if self.sock is not None:
            self.sock.close()
        self.proc, self.sock = None, None
        self.failures += 1
        then = ("a new zygote starts for the next job" if self.failures < MAX_FAILURES else
                f"after {self.failures} failures in a row, every supervisor starts as a fresh "
                f"interpreter from now on")
        sys.stderr.write(f"trainyard agent: the supervisor zygote failed{status}: {why}; this "
                         f"job's supervisor starts as a fresh interpreter; {then}\n")
        sys.stderr.flush()

    def close(self) -> None:
        """End the zygote (it would end anyway when the agent goes away)."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            import subprocess  # noqa: PLC0415 - see the imports above

            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None
