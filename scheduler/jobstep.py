"""One job on a node, like Slurm's slurmstepd: runs it as its owner in its cgroup, records its end.

Part of the agent's bundle (standard library, Python 3.8); the agent starts it as
`python3 <bundle> wrap <job dir>` in a session of its own, so it outlives the agent, the SSH
link and the daemon. It reads `spec.json` (written by the agent), starts the job in a new
session (the job's pid leads it), as the job's account and inside the job's cgroups, copies
the job's output to the agent's `log` and to the job's own output files when it has any,
and writes the exit status atomically to `rc` (128+N for signal N), with `oom` beside it
when the kernel's OOM killer ended a process of the job. Everything the job started ends
with it where it has a cgroup.

A job with an image (`container` in its spec) runs in a container of the node's runtime:
the step makes sure the image is on the node (pulled here only when the agent has not
pulled it ahead), checks that the owner can read every mount, and runs the runtime in the
job's cgroups; the container runs as the owner with the job's GPUs and limits
(containers.py). An image or mount that fails ends the launch with `failed` and the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import sys
import time

if __package__:
    from . import fencing
    from .accounts import Account, become
    from .nodefiles import wake, write_atomic
else:  # inside the agent's bundle on a node
    import fencing
    from accounts import Account, become
    from nodefiles import wake, write_atomic

CHUNK = 65536


def _containers():
    """containers.py, imported by the jobs that run in a container, when they need it. The
    zygote that forks every job's supervisor (zygote.py) imports this module: without
    containers.py and what it imports (subprocess, tempfile, base64, ...) it holds about a third
    less memory, and a supervisor forked from it starts and exits that much faster."""
    if __package__:
        from . import containers  # noqa: PLC0415
    else:
        import containers  # noqa: PLC0415
    return containers
# Python ignores these; a job gets them back at their defaults
DEFAULT_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)


def exit_code(status: int) -> int:
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


@contextlib.contextmanager
def _owner_rights(account):
    """Act with the job owner's effective ids (files are opened and checked with their rights)."""
    if account is None or os.geteuid() != 0:
        yield
        return
    old_umask = os.umask(0o077)
    os.setgroups(account.groups)
    os.setegid(account.gid)
    os.seteuid(account.uid)
    try:
        yield
    finally:
        os.seteuid(0)
        os.setegid(0)
        os.setgroups([])
        os.umask(old_umask)


def _open_as(account, path: str) -> int:
    """Open (append) an output file with the job owner's rights, not the agent's."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_APPEND
    with _owner_rights(account):
        return os.open(path, flags, 0o600 if account is not None else 0o644)


def _child(spec: dict, account, out_fd: int, err_fd: int, container=None) -> None:
    """In the forked child: own session, the job's cgroups, the owner's identity, then exec.

    For a container, the runtime (podman, docker: they run as root) is exec'd in the job's
    cgroups instead; the container itself runs as the owner."""
    try:
        os.setsid()
        fencing.join(spec.get("cgroups") or [])
        env = spec["env"]
        if container is not None:
            containers = _containers()
            parent = containers.cgroup_parent() if spec.get("cgroups") else ""
            argv = containers.run_argv(cgroup_parent=parent, **container)
            env = dict(os.environ)  # the runtime's own (root's) environment, not the job's
        elif account is not None and os.geteuid() == 0:
            become(account)
        os.umask(int(spec.get("umask", 0o077)))
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        os.closerange(3, 65536)
        try:
            os.chdir(spec["cwd"])
        except OSError as e:
            os.write(2, f"trainyard: cannot enter {spec['cwd']}: {e.strerror}\n".encode())
            os._exit(1)
        for sig in DEFAULT_SIGNALS:
            signal.signal(sig, signal.SIG_DFL)
        if container is None:
            argv = spec["argv"]
        try:
            os.execvpe(argv[0], argv, env)
        except OSError as e:
            os.write(2, f"trainyard: cannot run {argv[0]}: {e.strerror}\n".encode())
            os._exit(127)
    except BaseException as e:  # noqa: BLE001 - nothing of the wrapper may run on in the child
        try:
            os.write(2, f"trainyard: cannot start the job: {e}\n".encode())
        finally:
            os._exit(1)


def _spawnable(spec: dict, account, container) -> bool:
    """Whether the job needs nothing of `_child` that posix_spawn cannot do: no cgroup to join
    before it runs, no identity to take, no container runtime."""
    return (container is None and not spec.get("cgroups") and hasattr(os, "posix_spawnp")
            and (account is None or os.geteuid() != 0))


def _spawn(spec: dict, out_fd: int, err_fd: int):
    """Start the job as `_child` would, with posix_spawnp (a vfork: no copy of this interpreter,
    about a millisecond less per start); its pid, or None where it cannot start this way (the
    caller then forks, and `_child` reports why the job cannot run exactly as before).

    The program is looked up as execvpe does it, on the job's PATH (the C library's search, not
    shutil.which: in a supervisor forked from the zygote, Python code that creates objects
    costs page copies). posix_spawnp searches the caller's PATH, so this process (the job's
    supervisor, nothing else runs in it) takes the job's; a name with a slash is found from the
    job's working directory, where the job is spawned."""
    argv, env = spec["argv"], spec["env"]
    here = os.getcwd()
    umask = os.umask(int(spec.get("umask", 0o077)))
    own_path = os.environ.get("PATH")  # os.environ does not follow putenv: the process's own
    try:
        path = env.get("PATH")
        if path is None:  # both then search /bin:/usr/bin (os.defpath, the C library's default)
            os.unsetenv("PATH")
        else:
            os.putenv("PATH", path)
        os.chdir(spec["cwd"])  # the job's working directory is the one it is spawned in
        return os.posix_spawnp(
            argv[0], argv, env, setsid=True, setsigdef=DEFAULT_SIGNALS,
            file_actions=[(os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                          (os.POSIX_SPAWN_DUP2, out_fd, 1), (os.POSIX_SPAWN_DUP2, err_fd, 2)])
    except (OSError, TypeError, ValueError):
        return None
    finally:
        os.umask(umask)
        os.chdir(here)
        # a supervisor may run a next job (zygote.py): nothing of this one's environment stays
        if own_path is None:
            os.unsetenv("PATH")
        else:
            os.putenv("PATH", own_path)


def _read(path: str) -> bytes:
    """A small file's bytes with plain os calls, no file object (see nodefiles.write_atomic)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = []
        while True:
            chunk = os.read(fd, CHUNK)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    finally:
        os.close(fd)


def run(job_dir: str) -> int:
    os.chdir(job_dir)
    os.umask(0o077)
    me = str(os.getpid())
    try:
        claimed = _read("wpid").decode()
    except OSError:
        claimed = ""
    if claimed != me:  # a fresh interpreter: the agent claimed the directory with its own pid
        # (a supervisor forked by the zygote claimed it as itself: a file less to create per job,
        # and on ext4 each new inode is a scan past the recently deleted ones of busy job dirs)
        write_atomic("wpid", me)
    spec = json.loads(_read("spec.json"))
    account = Account.from_dict(spec["account"]) if spec.get("account") else None
    cgroups = spec.get("cgroups") or []
    log = os.open("log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def fail(text: str, rc: int, launch: bool = False) -> int:
        os.write(log, f"trainyard: {text}\n".encode())
        fencing.remove(cgroups)
        if launch:  # the job never ran: the agent reports launch_failed with this reason
            write_atomic("failed", text)
        write_atomic("rc", str(rc))
        wake(spec.get("wake"))
        return rc

    container = None
    if spec.get("container"):
        containers = _containers()
        try:
            container = _prepare_container(spec, account, log)
        except containers.ContainerError as e:
            return fail(str(e), 1, launch=True)
        except Exception as e:  # noqa: BLE001 - a bug here still ends the launch with a reason
            return fail(f"cannot prepare the container: {type(e).__name__}: {e}", 1, launch=True)

    files = {}
    for stream in ("stdout", "stderr"):
        path = spec.get(stream)
        if path:
            try:
                files[stream] = _open_as(account, path)
            except OSError as e:
                who = f" as {account.name}" if account else ""
                return fail(f"cannot open the {stream} file {path}{who}: {e.strerror}", 1)
    pipes = {}
    if files:  # copy the output: the agent's log for `trainyard logs`, and the job's own files
        for stream in ("stdout", "stderr"):
            pipes[stream] = os.pipe()
        out_w, err_w = pipes["stdout"][1], pipes["stderr"][1]
    else:
        out_w = err_w = log
    pid = _spawn(spec, out_w, err_w) if _spawnable(spec, account, container) else None
    if pid is None:
        pid = os.fork()
        if pid == 0:
            _child(spec, account, out_w, err_w, container)
    write_atomic("pid", str(pid))
    wake(spec.get("wake"))
    status = _copy_until_exit(pid, pipes, files, log, cgroups) if files else _wait(pid)
    rc = exit_code(status)
    if container is not None:  # its own cgroup: its OOM and its end are the runtime's to tell
        containers = _containers()
        runtime, name = container["runtime"], container["name"]
        if containers.container_state(runtime, name).get("oom"):
            write_atomic("oom", "1")
        containers.remove_container(runtime, name)
    if cgroups:
        if fencing.oom_killed(cgroups):
            write_atomic("oom", "1")
        fencing.remove(cgroups)  # what the job left behind ends with it
    write_atomic("rc", str(rc))
    wake(spec.get("wake"))
    return 0


def _prepare_container(spec: dict, account, log: int) -> dict:
    """Make sure the image is on the node, check the mounts as the owner, write the
    container's environment; the arguments of containers.run_argv (ContainerError if not)."""
    containers = _containers()
    c = spec["container"]
    runtime, node = c["runtime"], c.get("node", "")
    image = containers.parse_image(c["image"])
    cache = containers.ImageCache(c["cache_dir"], int(c["high_water_bytes"]))
    started = time.monotonic()
    seen = [0]

    def progress(done, total):
        if done > seen[0]:
            seen[0] = done
            of = f"/{total}" if total else ""
            os.write(log, f"trainyard: pulling {image}: {done}{of} layers\n".encode())

    got = containers.ensure(runtime, image, cache, float(c["pull_timeout_s"]), None, progress,
                            node)
    if got["pulled_now"]:
        os.write(log, f"trainyard: pulled {image} ({got['digest']}) in "
                      f"{time.monotonic() - started:.1f} s\n".encode())
    write_atomic("image.json", json.dumps({"image": str(image), "digest": got["digest"],
                                           "id": got["id"], "runtime": runtime}))
    mounts = c.get("mounts") or []
    for m in mounts:
        try:
            with _owner_rights(account):
                os.close(os.open(m["src"], os.O_RDONLY))
        except OSError as e:
            who = f" {account.name}" if account else ""
            raise containers.ContainerError(
                f"container mount {m['src']}:{m['dst']}: the job's user{who} cannot read "
                f"{m['src']} on {node}: {e.strerror}") from None
    env = dict(spec["env"])
    gpus = spec.get("gpus") or []
    if gpus:  # inside, the container holds only its GPUs: CUDA numbers them from 0 (as Slurm)
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in range(len(gpus)))
    env_file = os.path.abspath("container.env")
    skipped = containers.write_env_file(env_file, env)
    if skipped:
        os.write(log, f"trainyard: not passed to the container (a newline in the value): "
                      f"{', '.join(skipped)}\n".encode())
    uid, gid, groups = (account.uid, account.gid, account.groups) if account else \
        (os.getuid(), os.getgid(), os.getgroups())
    return {"runtime": runtime, "image_id": got["id"],
            "name": f"trainyard-{os.path.basename(os.getcwd())}-{os.getpid()}",
            "argv": spec["argv"], "devices": containers.gpu_devices(gpus, cdi=bool(c.get("cdi"))),
            "mounts": mounts, "workdir": c.get("workdir") or "", "env_file": env_file,
            "uid": uid, "gid": gid, "groups": groups, "mem_mb": c.get("mem_mb"),
            "cpus": c.get("cpus"), "pids_max": c.get("pids_max"), "init": c.get("init", True)}


def _wait(pid: int) -> int:
    while True:
        try:
            return os.waitpid(pid, 0)[1]
        except InterruptedError:
            continue


def _copy_until_exit(pid: int, pipes: dict, files: dict, log: int, cgroups: list) -> int:
    for _r, w in pipes.values():
        os.close(w)
    targets = {
        pipes["stdout"][0]: [log] + ([files["stdout"]] if "stdout" in files else []),
        pipes["stderr"][0]: [log] + ([files["stderr"]] if "stderr" in files
                                     else [files["stdout"]] if "stdout" in files else []),
    }
    status = None
    drain_until = None
    while targets:
        ready, _, _ = select.select(list(targets), [], [], 0.2)
        for fd in ready:
            data = os.read(fd, CHUNK)
            if not data:
                os.close(fd)
                del targets[fd]
                continue
            for t in targets[fd]:
                os.write(t, data)
        if status is None:
            done, st = os.waitpid(pid, os.WNOHANG)
            if done:
                status = st
                if cgroups:  # end what the job left behind, so its pipes close
                    fencing.signal_all(cgroups, signal.SIGKILL)
                drain_until = time.monotonic() + 2.0
        elif time.monotonic() > drain_until:
            break  # a daemon the job left (no cgroup to end it) keeps the pipe open
    for fd in targets:
        os.close(fd)
    return status if status is not None else _wait(pid)


def main(argv: list) -> int:
    if len(argv) != 1:
        sys.stderr.write("usage: agent wrap JOB_DIR\n")
        return 2
    return run(argv[0])
