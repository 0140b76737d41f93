"""The node agent: starts jobs, reports their ends and the node's GPUs, over typed JSON lines.

The daemon uploads it as a bundle (agent, protocol, gpus, nodestate, accounts, fencing,
jobstep, zygote, ...; standard library only, pynvml when the node has it) and runs it over one
SSH channel; the messages are protocol.py's. Every job runs under its own job step
(jobstep.py) in a session of its own, so it survives the agent, the SSH link and the daemon;
the step is forked from a pre-loaded zygote (zygote.py), or started as a fresh interpreter
(`wrap`) when there is none;
the step writes the job's exit status to `<dir>/jobs/<key>/rc`, and whoever asks later
reads it from there. Each job's output (`<dir>/jobs/<key>/log`) is streamed to the daemon as
it is written (`OutputStreams`), a bounded window ahead of the daemon's acknowledgements.

When it runs as root (real nodes) each job runs as its owner's Unix account, inside a cgroup
that limits its memory, CPUs and pids and the GPUs it may open (fencing.py). Not as root
(the demo, a login without privileges) jobs run as the agent's own account, unfenced; hello
says so. The demo's simulated GPUs are a plugin (simgpu.py) that only simulated nodes have.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import subprocess
import sys
import threading
import time

if __package__:
    from . import containers, fencing, nodestate, ptys, steps
    from . import protocol as P
    from .accounts import DEFAULT_MIN_UID, AccountError, lookup
    from .gpus import GPU_FIELDS, Gpus, job_of_pid
    from .jobdirs import DEFAULT_KEEP_S, JobDirs
    from .nodefiles import WAKE_SOCKET, install_public, listen_wake, own_file, write_atomic
    from .outputs import OutputStreams
    from .zygote import Zygote
else:  # inside the agent's bundle on a node
    import containers
    import fencing
    import nodestate
    import protocol as P
    import ptys
    import steps
    from accounts import DEFAULT_MIN_UID, AccountError, lookup
    from gpus import GPU_FIELDS, Gpus, job_of_pid
    from jobdirs import DEFAULT_KEEP_S, JobDirs
    from nodefiles import WAKE_SOCKET, install_public, listen_wake, own_file, write_atomic
    from outputs import OutputStreams
    from zygote import Zygote

__all__ = ["Agent", "GPU_FIELDS", "Gpus", "job_of_pid", "main"]

SIGNALS = {"TERM": signal.SIGTERM, "KILL": signal.SIGKILL, "INT": signal.SIGINT,
           "USR1": signal.SIGUSR1, "HUP": signal.SIGHUP}


def node_gpus(declared: int, model: str):
    """The node's GPUs; the demo's simulated ones when TRAINYARD_SIM_GPUS is set and the
    simulator plugin is there (simulated nodes only)."""
    sim = os.environ.get("TRAINYARD_SIM_GPUS")
    if not sim:
        return Gpus(declared, model)
    plugin_dir = os.environ.get("TRAINYARD_SIM_PLUGIN_DIR")
    if plugin_dir and plugin_dir not in sys.path:
        sys.path.append(plugin_dir)
    try:
        if __package__:
            from .simgpu import SimulatedGpus  # noqa: PLC0415
        else:
            from simgpu import SimulatedGpus  # noqa: PLC0415
    except ImportError:
        gpus = Gpus(declared, model)
        gpus.note = ("TRAINYARD_SIM_GPUS is set but this agent has no GPU simulator (only the "
                     "demo's simulated nodes have one); " + gpus.note)
        return gpus
    return SimulatedGpus(int(sim))


# requests handled in one turn of the main loop before it looks at the job directories again
INBOX_BATCH = 64
# Slurm's srun and scontrol for batch scripts: where each file lies under the agent's directory,
# and its path in the bundle (the shims load hostlist.py and layout.py from the directory above)
SLURM_SHIM_FILES = (("hostlist.py", "slurm/hostlist.py"), ("layout.py", "slurm/layout.py"),
                    ("bin/srun", "slurm/shims/srun.py"), ("bin/scontrol", "slurm/shims/scontrol.py"))


class Agent:
    def __init__(self, root: str, declared_gpus: int, declared_model: str, telemetry_s: float,
                 node: str = "", min_uid: int = DEFAULT_MIN_UID,
                 pids_max: int = fencing.DEFAULT_PIDS_MAX, entry: str = "",
                 image_cache_gb: float = containers.DEFAULT_HIGH_WATER_GB,
                 pull_timeout_s: float = containers.DEFAULT_PULL_TIMEOUT_S,
                 container_runtime: str = "", keep_job_dirs_s: float = DEFAULT_KEEP_S):
        self.node = node or os.environ.get("TRAINYARD_SIM_NODE") or socket.gethostname()
        self.root = nodestate.resolve(root)
        self.out_lock = threading.Lock()
        self.held = False  # the main loop holds its reports until the end of its turn (release)
        self.pending: list[str] = []
        self.main_thread = threading.get_ident()
        self.inbox: queue.Queue = queue.Queue()
        self.wrappers: dict[str, subprocess.Popen] = {}
        self.watching: dict[str, dict] = {}  # key -> {"gpus": [...], "job_id": ...}
        self.gpus = node_gpus(declared_gpus, declared_model)
        self.telemetry_s = telemetry_s
        self.min_uid = min_uid
        self.entry = entry or os.path.abspath(sys.argv[0])
        simulated = self.gpus.source == "simulated"
        self.as_owners = os.geteuid() == 0 and not simulated
        why = ("simulated node: jobs run as the demo's user, unfenced" if simulated else
               "the agent does not run as root: jobs run as its own account, unfenced")
        self.fencing = fencing.Fencing(self.node, self.as_owners, why, pids_max)
        self.umask = os.umask(0o077)  # the agent's files are its own; jobs get theirs back
        self.jobs_dir = os.path.join(self.root, "jobs")
        # as root, job owners may pass through (not list) to their own job's directory
        self.dir_mode = 0o711 if self.as_owners else 0o700
        self.containers = containers.detect(container_runtime)
        self.images = containers.ImageCache(os.path.join(self.root, "images"),
                                            int(image_cache_gb * 2**30))
        self.pull_timeout_s = pull_timeout_s
        self.output = OutputStreams(self)
        self.job_dirs = JobDirs(self.jobs_dir, keep_job_dirs_s)  # ended jobs' directories go
        self.ptys = ptys.PtySessions(self)  # terminals in running jobs (srun --pty)
        self.step_server = steps.StepServer(self)  # srun in a job here, to the job's other nodes
        self.step_runner = steps.StepRunner(self)  # steps that other nodes' srun start here
        self._slurm_bin: str | None = None  # see slurm_shims(); "" once they cannot be installed
        self.zygote = Zygote(self.entry)  # forks each job's supervisor (zygote.py)
        self.wake_path: str | None = None  # job steps wake the agent here (see claim_dir)

    def claim_dir(self) -> None:
        """Take the node-local directory; StateDirError says why it cannot be used."""
        nodestate.claim(self.root, self.node, self.dir_mode)
        os.makedirs(self.jobs_dir, exist_ok=True)
        os.chmod(self.jobs_dir, self.dir_mode)
        keys = sorted(os.listdir(self.jobs_dir))  # the job directories earlier agents left
        self.output.load(keys)
        self.job_dirs.load(keys)
        path = os.path.join(self.root, WAKE_SOCKET)
        if listen_wake(path, self.woken):
            self.wake_path = path
        try:
            self.step_server.start()
        except OSError as e:  # batch jobs' srun then starts only this node's tasks
            print(f"trainyard-agent: cannot listen on {self.step_server.path}: {e}; srun in "
                  "batch jobs on this node cannot reach their other nodes", file=sys.stderr)

    def send(self, msg) -> None:
        line = P.encode(msg) if not isinstance(msg, dict) else json.dumps(msg, separators=(",", ":")) + "\n"
        with self.out_lock:
            # the main loop's reports of one turn go out together at its end (`held`); any
            # other thread's at once, after them
            if self.held and threading.get_ident() == self.main_thread:
                self.pending.append(line)
                return
            if self.pending:
                line, self.pending = "".join(self.pending) + line, []
            sys.stdout.write(line)
            sys.stdout.flush()

    def release(self) -> None:
        """End of the main loop's turn: what it reported goes to the daemon in one write."""
        with self.out_lock:
            self.held = False
            if self.pending:
                sys.stdout.write("".join(self.pending))
                sys.stdout.flush()
                self.pending = []

    def job_dir(self, key: str) -> str:
        if not key or "/" in key or key.startswith(".") or "\0" in key:
            raise ValueError(f"bad job key {key!r}")
        return os.path.join(self.jobs_dir, key)

    # --- requests
    def on_launch(self, msg: P.Launch) -> None:
        key = msg.key
        d = self.job_dir(key)
        info = {"gpus": msg.gpus, "job_id": msg.job_id, "announced": False}
        try:
            os.mkdir(d)
        except FileExistsError:
            # launched before (the daemon retries after a crash): report, never run twice
            self.watching.setdefault(key, info)
            self.report(key)
            return
        os.chmod(d, self.dir_mode)
        self.output.add(key)
        try:
            spec = self.prepare(d, msg)
        except (AccountError, fencing.FencingError, containers.ContainerError, OSError) as e:
            reason = str(e) if not isinstance(e, OSError) else f"cannot prepare the job: {e}"
            write_atomic(os.path.join(d, "failed"), reason)
            self.send(P.LaunchFailed(key, reason))
            return
        self.watching[key] = info
        if spec is None:  # the job failed before it started (its rc and log are written)
            self.report(key)
            return
        supervisor = self.zygote.launch(d)  # None: forked by the zygote, not the agent's child
        if supervisor is not None:  # a fresh interpreter (no zygote): the agent reaps it
            self.wrappers[key] = supervisor

    def prepare(self, d: str, msg: P.Launch):
        """Resolve the job's account, directory, cgroups and environment; write spec.json."""
        account = lookup(msg.user, self.min_uid) if self.as_owners else None
        work = os.path.join(d, "work")
        os.mkdir(work, 0o700)
        if account is not None:
            os.chown(work, account.uid, account.gid)
        argv = msg.argv
        if msg.script is not None:
            path = os.path.join(work, "script")
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o700)
            with os.fdopen(fd, "w") as f:
                f.write(msg.script)
            if account is not None:
                os.chown(path, account.uid, account.gid)
            argv = [path] if msg.script.startswith("#!") else ["/bin/sh", path]
        if not argv:
            raise OSError("the launch has neither argv nor script")
        if msg.workdir and not os.path.isdir(msg.workdir):
            write_atomic(os.path.join(d, "log"),
                          f"trainyard: workdir {msg.workdir!r} does not exist on {socket.gethostname()}\n")
            write_atomic(os.path.join(d, "rc"), "127")
            return None
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TRAINYARD_SIM_", "SSH_"))}
        if account is not None:  # the owner's own environment, as a login would give it
            env = {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"),
                   "LANG": os.environ.get("LANG", "C.UTF-8")}
            env.update(HOME=account.home, USER=account.name, LOGNAME=account.name,
                       SHELL=account.shell)
        env.update(msg.env)
        shims = self.slurm_shims() if "SLURM_JOB_ID" in env and not msg.image else None
        if shims:  # a Slurm batch script finds srun and scontrol on its PATH (docs/slurm.md)
            env["PATH"] = shims + os.pathsep + env.get("PATH", "/usr/bin:/bin")
            if msg.batch_step and self.step_server.sock is not None:
                # srun in the batch step proves its job with this token on the step socket
                env[steps.TOKEN_VAR] = steps.new_token()
                env[steps.SOCKET_VAR] = self.step_server.path
        # a preemption's deadline appears here the moment the job is chosen as a victim
        env["TRAINYARD_PREEMPT_DEADLINE_FILE"] = os.path.join(work, "preempt_deadline")
        container = self.container_spec(msg) if msg.image else None
        cgroups = self.fencing.create(msg.key, msg.gpus, msg.cpus, msg.mem_mb) \
            if self.fencing.active else []
        spec = {"argv": argv, "env": env, "cwd": msg.workdir or work, "workdir": msg.workdir,
                "account": account.to_dict() if account else None, "cgroups": cgroups,
                "stdout": msg.stdout, "stderr": msg.stderr, "gpus": msg.gpus,
                "umask": 0o077 if account else self.umask, "wake": self.wake_path}
        if container:
            spec["container"] = container
        write_atomic(os.path.join(d, "spec.json"), json.dumps(spec))
        return spec

    def slurm_shims(self) -> str | None:
        """The directory of the srun and scontrol shims, written from the agent's own bundle the
        first time a job needs them; None (and no shims) where the bundle does not carry them."""
        if self._slurm_bin is None:
            top = os.path.join(self.root, "slurm")
            try:
                for rel, source in SLURM_SHIM_FILES:
                    install_public(top, rel, own_file(source))
            except (OSError, KeyError):
                self._slurm_bin = ""
            else:
                self._slurm_bin = os.path.join(top, "bin")
        return self._slurm_bin or None

    def container_spec(self, msg: P.Launch) -> dict:
        """How the job step runs this launch's image; ContainerError when it cannot here."""
        runtime = self.containers.get("runtime")
        if not runtime:
            raise containers.ContainerError(
                f"job {msg.key} needs a container ({msg.image}) but {self.node} cannot run one: "
                f"{self.containers.get('reason')}")
        workdir = msg.container_workdir or ""
        if workdir and not workdir.startswith("/"):
            raise containers.ContainerError(
                f"container workdir {workdir!r} is not an absolute path inside the image")
        mounts = containers.parse_mounts(msg.mounts)
        if msg.script is not None:  # the batch script (prepare() writes it) runs inside
            script = os.path.join(self.job_dir(msg.key), "work", "script")
            mounts.append({"src": script, "dst": script, "ro": True})
        return {"runtime": runtime, "image": str(containers.parse_image(msg.image)),
                "mounts": mounts, "workdir": workdir,
                "cdi": bool(self.containers.get("cdi")), "cache_dir": self.images.dir,
                "init": self.containers.get("init", True),
                "high_water_bytes": self.images.high_water, "pull_timeout_s": self.pull_timeout_s,
                "node": self.node, "mem_mb": msg.mem_mb, "cpus": msg.cpus,
                "pids_max": self.fencing.pids_max if self.fencing.active else None}

    def on_pull(self, msg: P.Pull) -> None:
        """Pull an image ahead of a job's ranks, in the background; `pulled` tells the end."""
        threading.Thread(target=self._pull, args=(msg,), daemon=True).start()

    def _pull(self, msg: P.Pull) -> None:
        def progress(done, total):
            self.send(P.PullProgress(msg.image, msg.key, done, total))

        try:
            runtime = self.containers.get("runtime")
            if not runtime:
                raise containers.ContainerError(
                    f"{self.node} cannot pull {msg.image}: {self.containers.get('reason')}")
            got = containers.ensure(runtime, containers.parse_image(msg.image), self.images,
                                    msg.timeout_s or self.pull_timeout_s, msg.auth, progress,
                                    self.node)
        except Exception as e:  # every pull gets its answer, and never the credentials
            error = str(e) if isinstance(e, containers.ContainerError) else \
                f"cannot pull {msg.image} on {self.node}: {type(e).__name__}"
            self.send(P.Pulled(msg.image, msg.id, msg.key, error=error))
            return
        self.send(P.Pulled(msg.image, msg.id, msg.key, got["digest"], got["id"],
                           int(got["size"]), not got["pulled_now"]))

    def on_images(self, msg: P.Images) -> None:
        self.send(P.ImageList(msg.id, self.containers.get("runtime", ""), self.images.high_water,
                              self.images.listing()))

    def image_of(self, key: str) -> tuple:
        """(image, digest) a container job runs, as its step recorded; (None, None) else."""
        text = self.read(self.job_dir(key), "image.json")
        try:
            info = json.loads(text) if text else {}
        except ValueError:
            info = {}
        return info.get("image"), info.get("digest")

    def exists(self, d: str, name: str) -> bool:
        return os.path.exists(os.path.join(d, name))

    def status(self, key: str) -> dict:
        d = self.job_dir(key)
        if not os.path.isdir(d):
            return {"key": key, "state": "unknown"}
        failed = self.read(d, "failed")
        if failed is not None:
            return {"key": key, "state": "failed", "reason": failed}
        for attempt in (0, 1):
            rc = self.read(d, "rc")
            if rc is not None:
                end = os.stat(os.path.join(d, "rc")).st_mtime
                return {"key": key, "state": "exited", "rc": int(rc), "end_time": end,
                        "oom": self.exists(d, "oom")}
            if attempt:
                break
            pid = self.read(d, "pid")
            if pid is not None and self.alive(int(pid)):
                # running once setsid has made it the leader of its own process group
                state = "running" if self.group_leader(int(pid)) else "starting"
                return {"key": key, "state": state, "pid": int(pid)}
            wpid = self.read(d, "wpid")
            if wpid is None or self.alive(int(wpid)):
                # the wrapper is still starting the job, or about to write its exit status
                return {"key": key, "state": "starting" if pid is None else "running",
                        "pid": int(pid) if pid else None}
        # job and wrapper are gone and no exit status was written (e.g. the node rebooted)
        return {"key": key, "state": "lost"}

    @staticmethod
    def read(d: str, name: str):
        try:
            with open(os.path.join(d, name)) as f:
                return f.read().strip()
        except FileNotFoundError:
            return None

    @staticmethod
    def group_leader(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return int(f.read().rsplit(")", 1)[1].split()[2]) == pid
        except (OSError, ValueError, IndexError):
            try:
                return os.getpgid(pid) == pid if hasattr(os, "getpgid") else True
            except ProcessLookupError:  # it ended meanwhile; the next pass reports its exit
                return False

    @staticmethod
    def alive(pid: int) -> bool:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        try:  # kill -0 succeeds on zombies
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"
        except OSError:
            return True

    def report(self, key: str, st: dict | None = None) -> None:
        """Tell the daemon where a job is: `st`, the status just read, else read now."""
        st = self.status(key) if st is None else st
        if st["state"] == "running":
            self.send(P.Started(key, st["pid"], *self.image_of(key)))
        elif st["state"] in ("exited", "lost"):
            self.send(P.Exited(key, st.get("rc"), st.get("end_time"), st["state"] == "lost",
                               bool(st.get("oom"))))
            self.watching.pop(key, None)
        elif st["state"] == "failed":
            self.send(P.LaunchFailed(key, st["reason"]))
            self.watching.pop(key, None)

    def cgroups_of(self, d: str) -> list:
        try:
            with open(os.path.join(d, "spec.json")) as f:
                return json.load(f).get("cgroups") or []
        except (OSError, ValueError):
            return []

    def on_notice(self, msg: P.Notice) -> None:
        """Write the preemption deadline where the job reads it (TRAINYARD_PREEMPT_DEADLINE_FILE)."""
        path = os.path.join(self.job_dir(msg.key), "work", "preempt_deadline")
        if os.path.isdir(os.path.dirname(path)):
            write_atomic(path, f"{msg.deadline:.0f}\n")
            os.chmod(path, 0o644)

    def on_signal(self, msg: P.Signal) -> None:
        if msg.sig not in SIGNALS:
            raise ValueError(f"unknown signal {msg.sig!r}; use one of {', '.join(SIGNALS)}")
        sig = SIGNALS[msg.sig]
        d = self.job_dir(msg.key)
        cgroups = self.cgroups_of(d)
        if cgroups and fencing.signal_all(cgroups, sig):
            return  # every process of the job, wherever it moved its session
        pid = self.read(d, "pid")
        if pid is None:
            return
        try:
            os.killpg(int(pid), sig)
        except ProcessLookupError:  # not yet its own group leader: signal the process itself
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), sig)

    def on_sync(self, msg: P.Sync) -> None:
        """Report every job that has not been forgotten: running ones and exits nobody heard."""
        jobs = []
        for key in sorted(os.listdir(self.jobs_dir)):
            d = os.path.join(self.jobs_dir, key)
            if os.path.exists(os.path.join(d, "forgotten")):
                continue
            st = self.status(key)
            jobs.append(st)
            if st["state"] in ("running", "starting"):
                self.watching.setdefault(key, {"gpus": [], "job_id": None})
        self.send(P.Jobs(msg.id, jobs))

    def on_watch(self, msg: P.Watch) -> None:
        """After a reconnect the daemon says which GPUs each running job holds (for telemetry)."""
        for key, info in msg.jobs.items():
            if key in self.watching:
                self.watching[key] = info

    def on_forget(self, msg: P.Forget) -> None:
        for key in msg.keys:
            d = self.job_dir(key)
            if os.path.isdir(d):
                open(os.path.join(d, "forgotten"), "w").close()
                if self.exists(d, "rc") or self.exists(d, "failed"):
                    fencing.remove(self.cgroups_of(d))  # only the cgroups recorded for it
                self.job_dirs.ended(key)
            self.watching.pop(key, None)
            w = self.wrappers.pop(key, None)
            if w is not None:
                w.poll()

    def on_log(self, msg: P.Log) -> None:
        d = self.job_dir(msg.key)
        offset, limit = int(msg.offset), int(msg.limit)
        data, size = b"", 0
        try:
            with open(os.path.join(d, "log"), "rb") as f:
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(min(offset, size))
                data = f.read(limit)
        except FileNotFoundError:
            pass
        self.send(P.LogChunk(msg.key, msg.id, offset, data.decode("utf-8", "replace"),
                             offset + len(data), size))

    def on_fault(self, msg: P.Fault) -> None:
        """Inject a fault into a simulated GPU (demo only); refused on real or declared GPUs."""
        try:
            self.gpus.fault(msg.gpu, str(msg.kind), msg.value, host=self.node)
        except ValueError as e:
            self.send(P.Error(str(e), msg.id))
            return
        self.send(P.FaultDone(msg.id, True, msg.gpu, msg.kind))

    # --- loops
    def woken(self) -> None:
        """A job step wrote a job's pid or rc: look at once (a queued message does as well)."""
        if self.inbox.empty():
            self.inbox.put("")

    def read_stdin(self) -> None:
        for line in sys.stdin:
            line = line.strip()
            if line:
                self.inbox.put(line)
        self.inbox.put(None)  # EOF: the daemon went away

    def hello(self) -> P.Hello:
        mem_mb = 0
        try:
            with open("/proc/meminfo") as f:
                mem_mb = int(f.readline().split()[1]) // 1024
        except (OSError, ValueError, IndexError):
            pass
        # simulated nodes (demo, tests) share one machine, so they may claim a size of their own
        cpus = int(os.environ.get("TRAINYARD_SIM_CPUS") or os.cpu_count() or 1)
        mem_mb = int(os.environ.get("TRAINYARD_SIM_MEM_MB") or mem_mb)
        return P.Hello(
            protocol=P.PROTOCOL_VERSION, host=socket.gethostname(), node=self.node,
            pid=os.getpid(), user=_user_name(), cpus=cpus, mem_mb=mem_mb,
            gpu_source=self.gpus.source, gpu_model=self.gpus.model, gpus=self.gpus.describe(),
            gpu_note=self.gpus.note, root=self.root, jobs_as_owners=self.as_owners,
            min_uid=self.min_uid, fencing=self.fencing.mode(), containers=self.containers)

    def handle(self, line: str) -> None:
        handlers = {"launch": self.on_launch, "signal": self.on_signal, "notice": self.on_notice, "sync": self.on_sync,
                    "forget": self.on_forget, "log": self.on_log, "watch": self.on_watch,
                    "output_ack": self.output.on_ack, "fault": self.on_fault,
                    "ping": lambda m: self.send(P.Pong(m.id)),
                    "pull": self.on_pull, "images": self.on_images, **self.ptys.handlers(),
                    **self.step_server.handlers(), **self.step_runner.handlers()}
        rid = None
        try:
            obj = json.loads(line)
            rid = obj.get("id") if isinstance(obj, dict) else None
            msg = P.decode_op(obj)
            handlers[msg.op](msg)
        except Exception as e:  # a bad request never kills the agent
            self.send(P.Error(f"{type(e).__name__}: {e}", rid if isinstance(rid, int) else None))

    def run(self) -> None:
        self.main_thread = threading.get_ident()
        self.send(self.hello())
        threading.Thread(target=self.read_stdin, daemon=True).start()
        next_tel = next_lost_check = next_output = time.monotonic()
        while True:
            try:
                starting = any(not i.get("announced", True) for i in self.watching.values())
                # poll fast while jobs start, often while they run (exits are noticed by their rc
                # file), and rarely when idle; with the wake-up socket, job steps say when they
                # wrote a pid or rc and the polls only catch a wake-up that was lost
                if self.wake_path is None:
                    timeout = 0.002 if starting else 0.01 if self.watching else 0.05
                else:
                    timeout = 0.02 if starting else 0.05
                line = self.inbox.get(timeout=timeout)
            except queue.Empty:
                line = ""
            if line is None:
                return
            # every request that came meanwhile is handled in this turn (a cycle's launches
            # arrive together), then the job directories are looked at once, and the reports
            # of the turn go out in one write
            self.held = True
            handled = 0
            while True:
                if line:
                    self.handle(line)
                handled += 1
                if handled >= INBOX_BATCH:
                    break
                try:
                    line = self.inbox.get_nowait()
                except queue.Empty:
                    break
                if line is None:
                    self.release()
                    return
            check_lost = time.monotonic() >= next_lost_check
            if check_lost:
                next_lost_check = time.monotonic() + 1.0
            for key, info in list(self.watching.items()):
                d = self.job_dir(key)
                if self.exists(d, "rc"):
                    self.report(key)
                elif not info.get("announced", True) and self.exists(d, "pid"):
                    st = self.status(key)
                    if st["state"] != "starting":
                        info["announced"] = True
                        self.report(key, st)
                elif check_lost:
                    st = self.status(key)
                    if st["state"] == "lost":
                        self.report(key, st)
            for key, w in list(self.wrappers.items()):
                if w.poll() is not None and key not in self.watching:
                    del self.wrappers[key]
            self.release()
            if time.monotonic() >= next_output:
                next_output = time.monotonic() + 0.1
                try:
                    self.output.pump()
                except OSError as e:  # output that cannot be read never stops the jobs' agent
                    self.send(P.Error(f"output: {e}"))
            if self.job_dirs.due:
                self.job_dirs.sweep()
            if self.telemetry_s > 0 and time.monotonic() >= next_tel:
                next_tel = time.monotonic() + self.telemetry_s
                self.send_telemetry()

    def job_pids(self) -> dict:
        """Process-group leader pid of each running job -> its job id (to map GPU processes)."""
        out = {}
        for key, info in self.watching.items():
            pid = self.read(self.job_dir(key), "pid")
            if pid and pid.isdigit():
                out[int(pid)] = info.get("job_id")
        return out

    def send_telemetry(self) -> None:
        busy = {g: info.get("job_id") for info in self.watching.values() for g in info.get("gpus", [])}
        try:
            gpus = self.gpus.telemetry(busy, self.job_pids())
        except Exception as e:  # telemetry never kills the agent that runs the jobs
            self.send(P.Error(f"telemetry: {type(e).__name__}: {e}"))
            return
        self.send(P.Telemetry(time.time(), self.gpus.source, gpus))


def _user_name() -> str:
    import pwd  # noqa: PLC0415

    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:
        return str(os.geteuid())


def main(argv: list) -> int:
    if argv[:1] == ["wrap"]:
        if __package__:
            from . import jobstep  # noqa: PLC0415
        else:
            import jobstep  # noqa: PLC0415
        return jobstep.main(argv[1:])
    if argv[:1] == ["zygote"]:
        if __package__:
            from . import zygote  # noqa: PLC0415
        else:
            import zygote  # noqa: PLC0415
        return zygote.main(argv[1:])
    import argparse  # noqa: PLC0415

    p = argparse.ArgumentParser(prog="trainyard-agent")
    p.add_argument("--dir", "--root", dest="dir", default="",
                   help="the agent's directory [default: node-local: /var/lib/trainyard as root, "
                        "else /var/tmp/trainyard-USER]")
    p.add_argument("--node", default="", help="the node's name in trainyard (its identity)")
    p.add_argument("--gpus", type=int, default=0, help="GPUs declared for this node (used without NVML)")
    p.add_argument("--gpu-model", default="")
    p.add_argument("--telemetry", type=float, default=2.0, help="seconds between telemetry reports")
    p.add_argument("--min-uid", type=int, default=DEFAULT_MIN_UID,
                   help="jobs never run as an account below this uid (system accounts)")
    p.add_argument("--pids-max", type=int, default=fencing.DEFAULT_PIDS_MAX,
                   help="most processes one job may have")
    p.add_argument("--image-cache-gb", type=float, default=containers.DEFAULT_HIGH_WATER_GB,
                   help="high-water mark of the node's image cache: least recently used images "
                        "are removed above it")
    p.add_argument("--pull-timeout", type=float, default=containers.DEFAULT_PULL_TIMEOUT_S,
                   help="seconds an image pull may take")
    p.add_argument("--keep-job-dirs", type=float, default=DEFAULT_KEEP_S,
                   help="seconds an ended job's directory stays on the node once its end and all "
                        "of its output are stored by the daemon")
    p.add_argument("--container-runtime", default="", choices=("",) + containers.RUNTIMES,
                   help="the runtime for container jobs [default: podman, docker, enroot: the "
                        "first found]")
    args = p.parse_args(argv)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    agent = Agent(args.dir, args.gpus, args.gpu_model, args.telemetry, node=args.node,
                  min_uid=args.min_uid, pids_max=args.pids_max,
                  image_cache_gb=args.image_cache_gb, pull_timeout_s=args.pull_timeout,
                  container_runtime=args.container_runtime, keep_job_dirs_s=args.keep_job_dirs)
    try:
        agent.claim_dir()
    except (nodestate.StateDirError, OSError) as e:
        agent.send(P.Error(str(e), fatal=True))
        sys.stderr.write(f"trainyard agent: {e}\n")
        return 3
    agent.zygote.start()  # it loads while the agent says hello
    agent.run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
