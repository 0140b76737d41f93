"""Job steps across a job's nodes (`srun` in a batch script, docs/slurm.md): the agent's two sides.

Part of the agent's bundle (standard library, Python 3.8). In Slurm's model a batch script runs
once, on the job's first node, and `srun` starts the step's tasks on every node of the job.

- The caller's side (StepServer): the agent listens on a Unix socket, `<agent dir>/step.sock`. A
  job's `srun` connects once per other node of the step, proves which job it belongs to with the
  job's TRAINYARD_STEP_TOKEN (and, where jobs run as their owners, with its uid), and names the
  node and the command. The agent passes that to the daemon (`step_launch`), writes what comes
  back (`step_output`, `step_end`) to the connection, and acknowledges each piece once written
  (`step_ack`): a caller that stops reading holds back its own step and nothing else.
- The other node's side (StepRunner): `step_exec` starts `srun --trainyard-node-tasks ...` (that
  node's ranks of the step) as the job's owner, in its cgroups, with that rank's environment plus
  the variables the caller exported or changed, and streams its stdout and stderr back, at most
  STEP_WINDOW bytes ahead of the caller. The step ends with its process, with `step_kill`, or
  when the job ends on that node.
"""

from __future__ import annotations

import base64
import hmac
import json
import os
import secrets
import select
import signal
import socket
import struct
import threading
import time
import warnings

if __package__:
    from . import fencing
    from . import protocol as P
    from .accounts import Account, become
else:  # inside the agent's bundle on a node
    import fencing
    import protocol as P
    from accounts import Account, become

SOCKET_NAME = "step.sock"
TOKEN_VAR = "TRAINYARD_STEP_TOKEN"
SOCKET_VAR = "TRAINYARD_STEP_SOCKET"
NODE_TASKS_FLAG = "--trainyard-node-tasks"  # srun: run this node's ranks only (shims/srun.py)
MAX_REQUEST = 4 * 2**20  # a request carries the caller's environment
CHUNK = 65536
JOB_CHECK_S = 0.5
KILL_GRACE_S = 5.0  # SIGTERM, then SIGKILL this long after (srun's KillWait is 30 s by default)
# what `srun` passes on to a step's tasks on other nodes (INT and TERM end the step instead)
FORWARDED_SIGNALS = {"USR1": signal.SIGUSR1, "USR2": signal.SIGUSR2, "HUP": signal.SIGHUP,
                     "CONT": signal.SIGCONT, "ALRM": signal.SIGALRM}


class StepError(Exception):
    """A step cannot start here; the message says why."""


def new_token() -> str:
    return secrets.token_hex(16)


def exit_code(status: int) -> int:
    return 128 + os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)


def enter_job(spec: dict, account, cwd: str, newline: str = "\n") -> None:
    """In a forked child: join the job's cgroups, become its owner, take its umask, and go to
    `cwd` when the owner may enter it, else (saying so on stderr, as slurmstepd does) to the
    job's working directory. Exits the child when not even that can be entered."""
    fencing.join(spec.get("cgroups") or [])
    if account is not None and os.geteuid() == 0:
        become(account)
    os.umask(int(spec.get("umask", 0o077)))
    fallback = spec.get("cwd") or "/"
    if cwd and cwd != fallback:
        try:
            os.chdir(cwd)
            return
        except OSError as e:
            os.write(2, f"trainyard: couldn't chdir to `{cwd}': {e.strerror}: going to "
                        f"{fallback} instead{newline}".encode())
    try:
        os.chdir(fallback)
    except OSError as e:
        os.write(2, f"trainyard: cannot enter {fallback}: {e.strerror}{newline}".encode())
        os._exit(1)


def read_spec(job_dir: str) -> dict:
    with open(os.path.join(job_dir, "spec.json")) as f:
        return json.load(f)


# ---------------------------------------------------------------- the caller's node

class StepClient:
    """One `srun` connection: the step it asked for on one other node."""

    def __init__(self, server: StepServer, conn: socket.socket, name: str):
        self.server = server
        self.conn = conn
        self.name = name
        self.lock = threading.Lock()
        self.cond = threading.Condition(self.lock)
        self.frames: list = []  # (stream, bytes, offset after) and finally ("end", rc, reason)
        self.ended = False
        self.gone = False

    def put(self, frame: tuple) -> None:
        with self.cond:
            self.frames.append(frame)
            self.cond.notify()

    def write_loop(self) -> None:
        """Write what the daemon relays to `srun`, acknowledging each piece once written."""
        while True:
            with self.cond:
                while not self.frames and not self.gone:
                    self.cond.wait()
                if self.gone and not self.frames:
                    return
                frame = self.frames.pop(0)
            if frame[0] == "end":
                line = {"end": frame[1], "reason": frame[2]}
            else:
                line = {frame[0][0]: base64.b64encode(frame[1]).decode()}
            try:
                self.conn.sendall((json.dumps(line) + "\n").encode())
            except OSError:
                self.closed_by_caller()
                return
            if frame[0] == "end":
                self.finish()
                return
            self.server.agent.send(P.StepAcked(self.name, frame[2]))

    def read_loop(self) -> None:
        """Pass on the signals `srun` forwards, until it hangs up: before the step ended, that
        ends the step."""
        try:
            for line in self.conn.makefile("rb"):
                try:
                    sig = json.loads(line).get("signal")
                except (ValueError, AttributeError):
                    continue
                if sig in FORWARDED_SIGNALS:
                    self.server.agent.send(P.StepSignalled(self.name, sig))
        except OSError:
            pass
        self.closed_by_caller()

    def closed_by_caller(self) -> None:
        with self.cond:
            if self.ended or self.gone:
                return
            self.gone = True
            self.cond.notify()
        self.server.agent.send(P.StepCancel(self.name))
        self.server.forget(self.name)

    def finish(self) -> None:
        with self.cond:
            self.ended = True
        self.server.forget(self.name)
        try:
            self.conn.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.conn.close()


class StepServer:
    """The agent's step socket: `srun` in a job on this node reaches the job's other nodes."""

    def __init__(self, agent):
        self.agent = agent
        self.path = os.path.join(agent.root, SOCKET_NAME)
        self.clients: dict[str, StepClient] = {}
        self.lock = threading.Lock()
        self.sock: socket.socket | None = None

    def handlers(self) -> dict:
        return {"step_output": self.on_output, "step_end": self.on_end}

    def start(self) -> None:
        """Listen (every job account may connect: a request proves its job with the token)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(self.path)
        os.chmod(self.path, 0o666)
        sock.listen(64)
        self.sock = sock
        threading.Thread(target=self.accept_loop, name="steps", daemon=True).start()

    def accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            threading.Thread(target=self.serve, args=(conn,), name="step-request",
                             daemon=True).start()

    def serve(self, conn: socket.socket) -> None:
        try:
            request = self.read_request(conn)
            name, msg = self.launch(conn, request)
        except StepError as e:
            self.refuse(conn, str(e))
            return
        client = StepClient(self, conn, name)
        with self.lock:
            self.clients[name] = client
        self.agent.send(msg)
        threading.Thread(target=client.write_loop, name=f"step-{name}", daemon=True).start()
        client.read_loop()

    @staticmethod
    def refuse(conn: socket.socket, why: str) -> None:
        try:
            conn.sendall((json.dumps({"end": None, "reason": why}) + "\n").encode())
        except OSError:
            pass
        conn.close()

    @staticmethod
    def read_request(conn: socket.socket) -> dict:
        data = b""
        conn.settimeout(10)
        while not data.endswith(b"\n"):
            try:
                piece = conn.recv(65536)
            except OSError as e:
                raise StepError(f"cannot read the request: {e}") from None
            if not piece:
                raise StepError("the request ended early")
            data += piece
            if len(data) > MAX_REQUEST:
                raise StepError(f"the request is over {MAX_REQUEST} bytes")
        conn.settimeout(None)
        try:
            request = json.loads(data)
        except ValueError as e:
            raise StepError(f"the request is not JSON: {e}") from None
        if not isinstance(request, dict):
            raise StepError("the request is not a JSON object")
        return request

    def launch(self, conn: socket.socket, request: dict) -> tuple:
        """Check who asks and for what; the `step_launch` event to send."""
        key, spec = self.job_of(str(request.get("token") or ""))
        account = spec.get("account")
        if self.agent.as_owners and account:
            uid = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                      struct.calcsize("3i")))[1]
            if uid not in (0, int(account["uid"])):
                raise StepError(f"this job belongs to {account['name']}; uid {uid} may not start "
                                "its steps")
        node, argv, srun = request.get("node"), request.get("argv"), request.get("srun")
        env = request.get("env")
        if not isinstance(node, str) or not node:
            raise StepError("the request names no node")
        if node == self.agent.node:
            raise StepError(f"{node} is this node: run its tasks here")
        if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
            raise StepError("the request has no command")
        if not (isinstance(srun, list) and all(isinstance(a, str) for a in srun)):
            raise StepError("the request's srun options are not a list of strings")
        if not isinstance(env, dict) or not all(isinstance(v, str) for v in env.values()):
            raise StepError("the request's environment is not a mapping of strings")
        base = spec.get("env") or {}
        changes = {k: v for k, v in env.items() if base.get(k) != v}
        unset = sorted(k for k in base if k not in env)
        name = f"{key}:{secrets.token_hex(6)}"
        return name, P.StepLaunch(name, key, node, argv, srun, changes, unset,
                                  str(request.get("cwd") or ""))

    def job_of(self, token: str) -> tuple:
        """The running job on this node whose token this is, and its spec."""
        if len(token) < 16:
            raise StepError(f"no job token: {TOKEN_VAR} is not set; srun reaches other nodes "
                            "only from inside a job")
        for key in sorted(self.agent.watching):  # the jobs that run here (not every job dir)
            try:
                spec = read_spec(self.agent.job_dir(key))
            except (OSError, ValueError):
                continue
            if hmac.compare_digest(str((spec.get("env") or {}).get(TOKEN_VAR, "")), token):
                state = self.agent.status(key)["state"]
                if state != "running":
                    raise StepError(f"job {key.partition('.')[0]} is not running on "
                                    f"{self.agent.node} ({state})")
                return key, spec
        raise StepError(f"no running job on {self.agent.node} has this {TOKEN_VAR}")

    def forget(self, name: str) -> None:
        with self.lock:
            self.clients.pop(name, None)

    # relayed by the daemon from the node that runs the step

    def on_output(self, msg: P.StepOutputTo) -> None:
        client = self.clients.get(msg.step)
        if client is not None:
            data = base64.b64decode(msg.data)
            client.put((msg.stream if msg.stream in ("out", "err") else "out", data,
                        int(msg.offset) + len(data)))

    def on_end(self, msg: P.StepEndTo) -> None:
        client = self.clients.get(msg.step)
        if client is not None:
            client.put(("end", msg.rc, msg.reason))


# ---------------------------------------------------------------- the node that runs the step

class StepProcess:
    """This node's share of a step: the forked `srun --trainyard-node-tasks` and its pipes."""

    def __init__(self, runner: StepRunner, name: str, job_dir: str, pid: int, out: int, err: int):
        self.runner = runner
        self.name = name
        self.job_dir = job_dir
        self.pid = pid
        self.fds = {out: "out", err: "err"}
        self.sent = 0
        self.acked = 0
        self.status: int | None = None
        self.reason = ""
        self.term_at: float | None = None
        self.lock = threading.Lock()
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_w, False)

    def wake(self) -> None:
        try:
            os.write(self.wake_w, b"x")
        except OSError:
            pass

    def ack(self, offset: int) -> None:
        with self.lock:
            self.acked = max(self.acked, min(int(offset), self.sent))
        self.wake()

    def kill(self, reason: str) -> None:
        with self.lock:
            if self.term_at is not None:
                return
            self.reason = self.reason or reason
            self.term_at = time.monotonic()
        self._signal(signal.SIGTERM)
        self.wake()

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.pid, sig)
        except (ProcessLookupError, PermissionError):
            try:
                os.kill(self.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass

    def run(self) -> None:
        next_check = 0.0
        try:
            while self.fds:
                with self.lock:
                    window = P.STEP_WINDOW - (self.sent - self.acked)
                    term_at = self.term_at
                readable = [self.wake_r] + (list(self.fds) if window > 0 else [])
                r, _, _ = select.select(readable, [], [], JOB_CHECK_S)
                if self.wake_r in r:
                    os.read(self.wake_r, 4096)
                for fd in [fd for fd in r if fd in self.fds]:
                    self._read(fd, window)
                    window = P.STEP_WINDOW - (self.sent - self.acked)
                now = time.monotonic()
                if term_at is not None and now - term_at > KILL_GRACE_S:
                    self._signal(signal.SIGKILL)
                if now >= next_check:
                    next_check = now + JOB_CHECK_S
                    if os.path.exists(os.path.join(self.job_dir, "rc")):
                        self.kill(f"job {os.path.basename(self.job_dir).partition('.')[0]} ended")
        finally:
            self._close()

    def _read(self, fd: int, window: int) -> None:
        try:
            data = os.read(fd, max(1, min(CHUNK, window)))
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            os.close(fd)
            del self.fds[fd]
            return
        self.runner.agent.send(P.StepOutput(self.name, self.fds[fd], self.sent,
                                            base64.b64encode(data).decode()))
        with self.lock:
            self.sent += len(data)

    def _close(self) -> None:
        for fd in list(self.fds):
            os.close(fd)
        deadline = time.monotonic() + KILL_GRACE_S
        while self.status is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                break
            if pid:
                self.status = status
                break
            if time.monotonic() > deadline:
                self._signal(signal.SIGKILL)
                deadline = time.monotonic() + 60
            time.sleep(0.02)
        for fd in (self.wake_r, self.wake_w):
            os.close(fd)
        self.runner.ended(self)
        rc = exit_code(self.status) if self.status is not None else None
        self.runner.agent.send(P.StepEnd(self.name, rc, self.reason))


class StepRunner:
    """Steps other nodes' `srun` started on this node, by the daemon's step name."""

    def __init__(self, agent):
        self.agent = agent
        self.steps: dict[str, StepProcess] = {}
        self.lock = threading.Lock()

    def handlers(self) -> dict:
        return {"step_exec": self.on_exec, "step_ack": self.on_ack, "step_kill": self.on_kill,
                "step_signal": self.on_signal}

    def on_exec(self, msg: P.StepExec) -> None:
        try:
            process = self.start(msg)
        except StepError as e:
            self.agent.send(P.StepEnd(msg.step, None, str(e)))
            return
        threading.Thread(target=process.run, name=f"step-{msg.step}", daemon=True).start()

    def start(self, msg: P.StepExec) -> StepProcess:
        if msg.step in self.steps:
            raise StepError(f"step {msg.step} already runs on {self.agent.node}")
        d = self.agent.job_dir(msg.key)
        job = msg.key.partition(".")[0]
        state = self.agent.status(msg.key)["state"]
        if state != "running":
            raise StepError(f"job {job} is not running on {self.agent.node} ({state})")
        try:
            spec = read_spec(d)
        except (OSError, ValueError) as e:
            raise StepError(f"job {job} on {self.agent.node}: cannot read its spec: {e}") from None
        shims = self.agent.slurm_shims()
        if not shims:
            raise StepError(f"{self.agent.node} has no srun to run the step's tasks with")
        account = Account.from_dict(spec["account"]) if spec.get("account") else None
        env = dict(spec.get("env") or {})
        for k in msg.unset:
            env.pop(k, None)
        env.update(msg.env)
        argv = [os.path.join(shims, "srun"), NODE_TASKS_FLAG, *msg.srun, "--", *msg.argv]
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        with warnings.catch_warnings():  # forking a threaded agent: the child only execs
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:
            _child(argv, env, spec, account, msg.cwd, out_w, err_w)
        os.close(out_w)
        os.close(err_w)
        process = StepProcess(self, msg.step, d, pid, out_r, err_r)
        with self.lock:
            self.steps[msg.step] = process
        return process

    def ended(self, process: StepProcess) -> None:
        with self.lock:
            self.steps.pop(process.name, None)

    def on_ack(self, msg: P.StepAck) -> None:
        process = self.steps.get(msg.step)
        if process is not None:
            process.ack(msg.offset)

    def on_kill(self, msg: P.StepKill) -> None:
        process = self.steps.get(msg.step)
        if process is not None:
            process.kill("its srun went away")

    def on_signal(self, msg: P.StepSignal) -> None:
        process = self.steps.get(msg.step)
        sig = FORWARDED_SIGNALS.get(msg.sig)
        if process is not None and sig is not None:
            try:  # to the step's srun alone: it passes the signal on to each of its tasks once
                os.kill(process.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def _child(argv: list, env: dict, spec: dict, account, cwd: str, out_w: int, err_w: int) -> None:
    """In the forked child: stdin from /dev/null, the pipes as stdout and stderr, a session of
    its own (so a kill reaches every task), the job's context, then exec."""
    try:
        os.setsid()
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 65536)
        enter_job(spec, account, cwd)
        env["PWD"] = os.getcwd()
        for sig in (signal.SIGPIPE, signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        try:
            os.execve(argv[0], argv, env)
        except OSError as e:
            os.write(2, f"srun: error: cannot run {argv[0]}: {e.strerror}\n".encode())
            os._exit(127)
    except BaseException as e:  # noqa: BLE001 - nothing of the agent may run on in the child
        try:
            os.write(2, f"srun: error: cannot start the step: {e}\n".encode())
        finally:
            os._exit(1)
