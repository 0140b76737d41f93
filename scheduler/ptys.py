"""Terminals in running jobs on the node (`srun --pty`, `salloc`): one pty session per `pty_open`.

Part of the agent's bundle (standard library, Python 3.8). A session forks on a new pty as the
job's owner, inside the job's cgroups, with the environment, umask and working directory the job
step got (its `spec.json`), so the shell sees what the job sees: its account, GPUs, `SLURM_*`
variables and the srun/scontrol shims. One thread per session copies the terminal's output to
the daemon (`pty_data`, at most PTY_WINDOW bytes ahead of its `pty_ack`) and writes what the
user types; the session ends with its process, or when the job ends (time limit, cancel,
preemption), and `pty_close` says how.
"""

from __future__ import annotations

import base64
import errno
import fcntl
import json
import os
import pty
import select
import signal
import struct
import termios
import threading
import time
import warnings

if __package__:
    from . import protocol as P
    from .accounts import Account
    from .steps import enter_job
else:  # inside the agent's bundle on a node
    import protocol as P
    from accounts import Account
    from steps import enter_job

CHUNK = 16384
MAX_PENDING_INPUT = 2**20  # typed bytes the session's program has not read yet; more is dropped
JOB_CHECK_S = 0.5  # how often a session looks whether its job has ended
HANGUP_GRACE_S = 2.0  # SIGHUP, then SIGKILL this long after
DRAIN_S = 0.05  # an ended process's terminal closes after it has been quiet this long


class PtyError(Exception):
    """A terminal cannot be opened in that job; the message says why."""


def _winsize(rows: int, cols: int) -> bytes:
    return struct.pack("HHHH", max(1, min(int(rows), 4096)), max(1, min(int(cols), 4096)), 0, 0)


def _exit_code(status: int) -> int:
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


class PtySession:
    """One terminal: the forked process on the pty's slave side, the agent on the master side."""

    def __init__(self, sessions: PtySessions, name: str, key: str, job_dir: str, pid: int, fd: int):
        self.sessions = sessions
        self.name = name
        self.key = key
        self.job_dir = job_dir
        self.pid = pid
        self.fd = fd
        self.sent = 0  # bytes of output sent
        self.acked = 0  # bytes the daemon passed on
        self.pending = b""  # input not yet written to the pty
        self.reason = ""
        self.hangup_at: float | None = None
        self.status: int | None = None  # the session process's wait status, once it ended
        self.lock = threading.Lock()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self.wake_w, False)

    def wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # a full pipe wakes the thread as well

    def feed(self, data: bytes) -> None:
        with self.lock:  # a program that never reads its terminal must not fill the agent's memory
            self.pending += data[:max(0, MAX_PENDING_INPUT - len(self.pending))]
        self.wake()

    def ack(self, offset: int) -> None:
        with self.lock:
            self.acked = max(self.acked, min(int(offset), self.sent))
        self.wake()

    def resize(self, rows: int, cols: int) -> None:
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, _winsize(rows, cols))

    def hang_up(self, reason: str) -> None:
        """End the session: SIGHUP to its process group now, SIGKILL after a grace period."""
        with self.lock:
            if self.hangup_at is not None:
                return
            self.reason = self.reason or reason
            self.hangup_at = time.monotonic()
        self._signal(signal.SIGHUP)
        self.wake()

    def _signal(self, sig: int) -> None:
        for target in (lambda: os.killpg(self.pid, sig), lambda: os.kill(self.pid, sig)):
            try:
                target()
                return
            except (ProcessLookupError, PermissionError):
                continue

    def run(self) -> None:
        """The session's thread: copy output out and input in until the terminal closes, or
        its process has ended and the terminal has nothing more to say (a background process
        that still holds the terminal does not keep the session open, as with sshd)."""
        next_check = 0.0
        try:
            while True:
                with self.lock:
                    window = P.PTY_WINDOW - (self.sent - self.acked)
                    want_write = bool(self.pending)
                    hangup_at = self.hangup_at
                readable = [self.wake_r] + ([self.fd] if window > 0 else [])
                r, w, _ = select.select(readable, [self.fd] if want_write else [], [], JOB_CHECK_S)
                if self.wake_r in r:
                    os.read(self.wake_r, 4096)
                if self.fd in w and not self._write_input():
                    break
                if self.fd in r and not self._read_output(window):
                    break
                if self.status is not None and window > 0 and self.fd not in r and not self._more_output():
                    break
                now = time.monotonic()
                if hangup_at is not None and now - hangup_at > HANGUP_GRACE_S and self.status is None:
                    self._signal(signal.SIGKILL)
                if now >= next_check:
                    next_check = now + JOB_CHECK_S
                    self._reap()
                    if os.path.exists(os.path.join(self.job_dir, "rc")):
                        self.hang_up(f"job {self.key.partition('.')[0]} ended")
        finally:
            self._close()

    def _more_output(self) -> bool:
        """Whether the terminal of an ended process has more to say. What the process wrote just
        before it ended can still be on its way to the master side (the kernel hands a pty's
        output over in a worker of its own), and a turn of the loop woken by the daemon (an
        ack, a resize) says nothing about it: wait a moment for it before closing."""
        return bool(select.select([self.fd], [], [], DRAIN_S)[0])

    def _read_output(self, window: int) -> bool:
        try:
            data = os.read(self.fd, min(CHUNK, window))
        except BlockingIOError:
            return True
        except OSError as e:  # EIO: every process on the slave side has gone
            if e.errno != errno.EIO:
                raise
            return False
        if not data:
            return False
        self.sessions.agent.send(P.PtyOutput(self.name, self.sent, base64.b64encode(data).decode()))
        with self.lock:
            self.sent += len(data)
        return True

    def _write_input(self) -> bool:
        with self.lock:
            data = self.pending
        try:
            n = os.write(self.fd, data)
        except BlockingIOError:
            return True
        except OSError:
            return False
        with self.lock:
            self.pending = self.pending[n:]
        return True

    def _reap(self) -> bool:
        """Collect the session process's status if it ended; False while it runs."""
        if self.status is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # not ours to wait for any more: its status is unknown
                return True
            if not pid:
                return False
            self.status = status
        return True

    def _close(self) -> None:
        deadline = time.monotonic() + HANGUP_GRACE_S
        while not self._reap():
            if time.monotonic() > deadline:
                self._signal(signal.SIGKILL)
                deadline = time.monotonic() + 60
            time.sleep(0.02)
        for fd in (self.fd, self.wake_r, self.wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        self.sessions.ended(self)
        rc = _exit_code(self.status) if self.status is not None else None
        self.sessions.agent.send(P.PtyClosed(self.name, rc, self.reason))


class PtySessions:
    """The agent's terminals, by the daemon's session name; the handlers of the pty_* ops."""

    def __init__(self, agent):
        self.agent = agent
        self.sessions: dict[str, PtySession] = {}
        self.lock = threading.Lock()

    def handlers(self) -> dict:
        return {"pty_open": self.on_open, "pty_data": self.on_input, "pty_resize": self.on_resize,
                "pty_ack": self.on_ack, "pty_close": self.on_hangup}

    def on_open(self, msg: P.PtyOpen) -> None:
        try:
            session = self.open(msg)
        except PtyError as e:
            self.agent.send(P.Error(str(e), msg.id))
            return
        self.agent.send(P.PtyOpened(msg.pty, msg.id, session.pid))
        threading.Thread(target=session.run, name=f"pty-{msg.pty}", daemon=True).start()

    def open(self, msg: P.PtyOpen) -> PtySession:
        if msg.pty in self.sessions:
            raise PtyError(f"terminal session {msg.pty!r} is already open")
        d = self.agent.job_dir(msg.key)
        job = msg.key.partition(".")[0]
        state = self.agent.status(msg.key)["state"]
        if state != "running":
            raise PtyError(f"job {job} is not running on {self.agent.node} ({state}); a terminal "
                           "opens only in a running job")
        try:
            with open(os.path.join(d, "spec.json")) as f:
                spec = json.load(f)
        except (OSError, ValueError) as e:
            raise PtyError(f"job {job} on {self.agent.node}: cannot read its spec: {e}") from None
        if spec.get("container"):
            raise PtyError(f"job {job} runs in a container ({spec['container'].get('image')}); "
                           "a terminal opens only in jobs that run on the node itself")
        account = Account.from_dict(spec["account"]) if spec.get("account") else None
        argv = list(msg.argv or [account.shell if account else os.environ.get("SHELL", "/bin/sh")])
        env = dict(spec.get("env") or {})
        env["TERM"] = msg.term or env.get("TERM") or "xterm-256color"
        with warnings.catch_warnings():  # forking a threaded agent: the child only execs
            warnings.simplefilter("ignore", DeprecationWarning)
            pid, fd = pty.fork()
        if pid == 0:
            _child(argv, env, spec, account, msg.rows, msg.cols, msg.cwd)
        session = PtySession(self, msg.pty, msg.key, d, pid, fd)
        with self.lock:
            self.sessions[msg.pty] = session
        return session

    def ended(self, session: PtySession) -> None:
        with self.lock:
            self.sessions.pop(session.name, None)

    # input, resizes and acks may cross a session's end on the way: those are dropped

    def on_input(self, msg: P.PtyInput) -> None:
        session = self.sessions.get(msg.pty)
        if session is not None:
            session.feed(base64.b64decode(msg.data))

    def on_resize(self, msg: P.PtyResize) -> None:
        session = self.sessions.get(msg.pty)
        if session is not None:
            session.resize(msg.rows, msg.cols)

    def on_ack(self, msg: P.PtyAck) -> None:
        session = self.sessions.get(msg.pty)
        if session is not None:
            session.ack(msg.offset)

    def on_hangup(self, msg: P.PtyHangup) -> None:
        session = self.sessions.get(msg.pty)
        if session is not None:
            session.hang_up("the terminal's user went away")


def _child(argv: list, env: dict, spec: dict, account, rows: int, cols: int, cwd: str) -> None:
    """In the forked child (on the pty's slave side): the job's cgroups, identity, then exec.
    It starts in `cwd` when the owner may enter it there, else (saying so, as slurmstepd does)
    in the job's working directory."""
    try:
        fcntl.ioctl(0, termios.TIOCSWINSZ, _winsize(rows, cols))
        if account is not None and os.geteuid() == 0:
            os.fchown(0, account.uid, -1)  # the terminal belongs to who uses it
        os.closerange(3, 65536)
        enter_job(spec, account, cwd, newline="\r\n")
        env["PWD"] = os.getcwd()
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        try:
            os.execvpe(argv[0], argv, env)
        except OSError as e:
            os.write(2, f"trainyard: cannot run {argv[0]}: {e.strerror}\r\n".encode())
            os._exit(127)
    except BaseException as e:  # noqa: BLE001 - nothing of the agent may run on in the child
        try:
            os.write(2, f"trainyard: cannot open the terminal: {e}\r\n".encode())
        finally:
            os._exit(1)
