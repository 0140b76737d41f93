"""Job supervisors forked from a pre-loaded process (a zygote), not started as fresh interpreters.

Part of the agent's bundle (standard library, Python 3.8). The agent is threaded, so it never
forks itself: it starts one single-threaded zygote (`python3 -S <bundle> zygote`) that has
imported the job step (jobstep.py) and waits on a socket for job directories. Each one goes
to a supervisor that leads a session of its own and runs `jobstep.run(job_dir)` exactly as
`wrap` does, with nothing of the zygote's descriptors; the zygote reaps them. The supervisor is
forked ahead of its job (the spare, which waits on a pipe), so a job's start waits for neither
an interpreter's start (about 75 ms) nor a fork. A supervisor whose job ended waits for the
node's next job (_Pool): on a busy node most jobs cost no fork and no exit at all.

Exactly once: a supervisor first claims its job directory by creating `wpid` exclusively
(jobstep rewrites it with the same pid). When the zygote dies or hangs with a request in
flight, the agent claims the directory itself before it falls back to a fresh interpreter
(today's `wrap`); whichever claim comes first runs the job, the other starts nothing. The
agent says once on stderr that it fell back, and starts a new zygote for the next job.

The zygote ends when the agent goes away (end of file on its socket) and never outlives it;
the supervisors that wait for a job end with it (end of file on their pipes); those that run a
job run it to its end, then end.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import select
import signal
import socket
import sys
import time

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
# a supervisor runs at most this many jobs one after another (as a pre-forked server's worker
# its requests), then exits: whatever a job's run may have left in it ends there
MAX_JOBS = 100
# at most this many supervisors wait for a job; one that finishes beyond them exits
MAX_IDLE = 8
# the supervisors the zygote keeps a pipe to, running a job or waiting (its descriptors): a
# supervisor handed a job beyond them exits after it
MAX_POOL = 64
# a supervisor that waited this long for a job is told to end
IDLE_S = 60.0
# the supervisors that ended, collected by the SIGCHLD handler for the pool to forget
_ENDED: list = []
# how many modules the zygote loaded: a supervisor whose job loaded more exits after it
_LOADED = 0


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

    The supervisor is one that waits for a job (see _Pool): one whose last job ended, else the
    spare, forked after the previous answer, that has already become a supervisor (its own
    session, signals reset, nothing of the zygote's descriptors but its pipes). A job's start then
    waits for no fork (about 2.5 ms of the way from launch to running here), and on a busy node
    most jobs cost no fork and no exit at all. A supervisor that went away is replaced by a fork on
    the spot."""
    fresh = {sig: signal.getsignal(sig) for sig in _RESTORED}
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1):  # the socket arrived as stdin and stdout: `sock` holds it now
        os.dup2(null, fd)
    os.close(null)
    signal.signal(signal.SIGCHLD, _reap)
    os.chdir("/")  # pin no job's or agent's directory
    global _LOADED
    _LOADED = len(sys.modules)
    gc.freeze()  # what is loaded now stays shared with every supervisor (copy-on-write)
    pool = _Pool(fresh)
    pool.spare()
    buf = b""
    while True:
        # awake for a request, a supervisor whose job ended (the books stay exact: at most
        # MAX_IDLE wait) or the next that waited IDLE_S
        wait = pool.retire_due(time.monotonic())
        if sock not in select.select([sock, pool.done_r], [], [], wait)[0]:
            continue
        chunk = sock.recv(65536)
        if not chunk:
            break
        buf += chunk
        while b"\n" in buf:
            line, _, buf = buf.partition(b"\n")
            _reap()
            try:
                job_dir = json.loads(line)["dir"]
            except (ValueError, KeyError, TypeError) as e:
                _answer(sock, {"error": f"bad request {line[:200]!r}: {e}"})
                continue
            try:
                pid = pool.hand(job_dir)
            except OSError as e:
                _answer(sock, {"error": f"cannot fork a supervisor for {job_dir}: {e}"})
                continue
            _answer(sock, {"pid": pid})
            pool.spare()  # off the way of this job: it runs meanwhile
    pool.close()  # every waiting supervisor reads end of file and exits


class _Pool:
    """The supervisors that may run a next job, and the pipes the zygote hands them jobs on.

    A supervisor whose job ended (its `rc` written, the agent woken) writes "<pid> <serial>" on
    the pool's shared pipe and waits on its own pipe for the next job directory. Its process
    exists and the pages it shares with the zygote are already copied, so that job costs it no
    fork, no copy-on-write faults and no exit: about 0.7 ms of CPU a job on this kind of machine
    (bench_spine.py's floor of a supervised start, against a spawn alone). It ends after
    MAX_JOBS jobs, after a job that loaded more than the zygote holds (a container's), when
    MAX_IDLE others already wait, when it waited IDLE_S, and when the zygote goes away. A
    supervisor that ran one job is exactly as one forked for it: `jobstep.run` starts each job
    from its own directory and spec, and what a job's run opened is closed before the next.

    The serial tells a supervisor from a later one that got its pid back: only the one the
    zygote forked under that serial is handed a job."""

    def __init__(self, fresh: dict):
        self.fresh = fresh
        self.done_r, self.done_w = os.pipe()  # every supervisor writes here when its job ended
        os.set_blocking(self.done_r, False)
        self.pipes: dict = {}  # pid -> (serial, write end of its pipe): every reusable supervisor
        self.idle: dict = {}  # pid -> (serial, since) of those waiting for a job, the latest last
        self.serial = 0
        self.partial = b""

    def spare(self) -> None:
        """Fork a supervisor ahead of the next job, unless one waits already."""
        self._collect()
        if not self.idle:
            with contextlib.suppress(OSError):
                self._fork()

    def hand(self, job_dir: str) -> int:
        """Give `job_dir` to a waiting supervisor (the latest to finish: its pages are the
        warmest), or to one forked for it now; its pid. OSError when none can be forked. The
        books are as the last `spare` or `retire_due` collected them."""
        while self.idle:
            pid, _ = self.idle.popitem()
            if self._give(pid, job_dir):
                return pid
        pid = self._fork()
        if not self._give(pid, job_dir):
            raise OSError(f"the supervisor forked for it (pid {pid}) ended at once")
        return pid

    def retire_due(self, now: float):
        """Tell the supervisors that waited IDLE_S to end; the seconds until the next is due
        (None: none waits)."""
        self._collect()
        for pid, (_serial, since) in list(self.idle.items()):  # the longest waiting first
            if now - since < IDLE_S:
                return IDLE_S - (now - since)
            del self.idle[pid]
            self._retire(pid)
        return None

    def close(self) -> None:
        for _serial, w in self.pipes.values():
            with contextlib.suppress(OSError):
                os.close(w)
        self.pipes, self.idle = {}, {}

    def _fork(self) -> int:
        r, w = os.pipe()
        self.serial += 1
        try:
            pid = os.fork()
        except OSError:
            os.close(r)
            os.close(w)
            raise
        if pid == 0:
            os.close(w)
            _become_supervisor(self.fresh, keep=(r, self.done_w))
            _serve_jobs(r, self.done_w, self.serial)  # never returns
        os.close(r)
        self.pipes[pid] = (self.serial, w)
        self.idle[pid] = (self.serial, time.monotonic())
        return pid

    def _give(self, pid: int, job_dir: str) -> bool:
        serial, w = self.pipes[pid]
        last = len(self.pipes) > MAX_POOL  # beyond the descriptors the zygote keeps: no next job
        data = json.dumps({"dir": job_dir, "last": last}).encode() + b"\n"
        try:
            while data:
                data = data[os.write(w, data):]
        except OSError:  # it died (broken pipe): whatever it read is not a whole line, so it runs nothing
            self._retire(pid)
            return False
        if last:
            self._retire(pid)
        return True

    def _retire(self, pid: int) -> None:
        """No more jobs for `pid`: it reads end of file when it next waits, and exits."""
        _serial, w = self.pipes.pop(pid, (0, -1))
        if w >= 0:
            os.close(w)

    def _collect(self) -> None:
        """Forget the supervisors that ended; note those that finished their job."""
        while _ENDED:
            self._retire(_ENDED.pop())
        while True:
            try:
                data = os.read(self.done_r, 65536)
            except BlockingIOError:
                break
            if not data:
                break
            self.partial += data
        if b"\n" in self.partial:
            *lines, self.partial = self.partial.split(b"\n")
            now = time.monotonic()
            for line in lines:
                with contextlib.suppress(ValueError):
                    pid, serial = (int(x) for x in line.split())
                    if self.pipes.get(pid, (None,))[0] == serial:
                        self.idle[pid] = (serial, now)
        # the serial: not a later process that got an ended one's pid
        self.idle = {p: v for p, v in self.idle.items() if self.pipes.get(p, (None,))[0] == v[0]}
        while len(self.idle) > MAX_IDLE:
            oldest = next(iter(self.idle))
            del self.idle[oldest]
            self._retire(oldest)


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
        _ENDED.append(pid)


def _become_supervisor(fresh: dict, keep: tuple = ()) -> None:
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
        _close_all_but(keep)
    except BaseException:  # noqa: BLE001 - never back into the zygote's loop
        os._exit(1)


def _close_all_but(keep: tuple) -> None:
    """Close every descriptor above 2 but those in `keep`."""
    low = 3
    for fd in sorted(keep):
        if fd >= low:
            os.closerange(low, fd)
            low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def _serve_jobs(r: int, done_w: int, serial: int) -> None:
    """In a supervisor: run the jobs handed to it on `r`, one after another; after each that
    leaves nothing behind, say so on `done_w` and wait for the next. Never returns."""
    buf = b""
    code = 0
    for n in range(1, MAX_JOBS + 1):
        while b"\n" not in buf:
            chunk = os.read(r, 65536)
            if not chunk:  # the zygote went away, or has no job for it: end
                os._exit(code)
            buf += chunk
        line, _, buf = buf.partition(b"\n")
        request = json.loads(line)
        code, clean = _supervise(request["dir"])
        if not clean or request.get("last") or n == MAX_JOBS or len(sys.modules) != _LOADED:
            break  # a job that loaded more (a container's modules) leaves this copy to its exit
        os.chdir("/")  # its job's directory stays unpinned
        _close_all_but((r, done_w))  # whatever the job's run left open
        try:
            os.write(done_w, f"{os.getpid()} {serial}\n".encode())
        except OSError:  # the zygote is gone
            break
    os._exit(code)


def _supervise(job_dir: str) -> tuple:
    """In a supervisor: claim the job directory, run the job step as `wrap` would. (exit
    status, whether this process may run another job: it ran to its end as it should have)."""
    try:
        if not claim(job_dir, os.getpid()):
            return 0, True  # the agent started this job itself (the zygote answered too late)
        sys.argv = [sys.argv[0], "wrap", job_dir]
        code = jobstep.run(job_dir)
    except SystemExit as e:
        return (e.code if isinstance(e.code, int) else 1), False
    except BaseException:  # noqa: BLE001 - as an interpreter would: a traceback, status 1
        with contextlib.suppress(Exception):
            import traceback  # noqa: PLC0415 - see the imports above

            traceback.print_exc()
            sys.stderr.flush()
        return 1, False
    # as it started: root, or the agent's account (jobstep acts as the owner only for a while)
    return code, (os.geteuid(), os.getegid()) == (os.getuid(), os.getgid())


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
