"""Jobs in container images on a node: the runtime, image pulls, the image cache, the run command.

Part of the agent's bundle (standard library, Python 3.8). The agent detects the node's
runtimes (podman, docker with a reachable daemon, enroot) and says which it uses in hello. An
image is pulled once per node (ahead of a gang's ranks by the `pull` op, else by the job step)
and cached by digest: `images.json` in the agent's directory maps references to the image
the runtime holds, with its size and last use, and the least recently used images go when the
cache passes its high-water mark. Registry credentials reach the runtime in a private auth
file that exists only while the pull runs: never on a command line, in a job's spec or its log.

The container of a job gets exactly its allocated /dev/nvidiaN (or the CDI names of those
GPUs, where the node's NVIDIA CDI spec names them and its runtime reads it), the control
devices, the job's environment, mounts and user, and the job's limits on a parent cgroup
beside the job's (runc cannot nest under a cgroup that denies devices, nor run without
cgroups), which also tells an OOM kill that the runtime missed: see docs/containers.md.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import glob
import json
import os
import re
import select
import shutil
import signal
import subprocess
import tempfile
import time

if __package__:
    from .fencing import cgroup_mounts, own_cgroup_paths
else:  # inside the agent's bundle on a node
    from fencing import cgroup_mounts, own_cgroup_paths

RUNTIMES = ("podman", "docker", "enroot")
DEFAULT_PULL_TIMEOUT_S = 1800.0
DEFAULT_HIGH_WATER_GB = 200.0
CONTROL_DEVICES = ("nvidiactl", "nvidia-uvm", "nvidia-uvm-tools", "nvidia-modeset")
CDI_DIRS = ("/etc/cdi", "/var/run/cdi")
# where podman looks for the init its --init runs (catatonit), when no init_path is configured
PODMAN_INIT_DIRS = ("/usr/libexec/podman", "/usr/local/libexec/podman", "/usr/lib/podman",
                    "/usr/local/lib/podman")
NO_INIT_NOTE = ("podman has no init (catatonit; install the catatonit package): a job's command "
                "runs as PID 1 of its container, where a signal it does not handle is ignored, so "
                "a preemption or cancel ends it only when its grace period is over")
CONTAINER_CGROUP_SUFFIX = ".container"  # the container's parent, beside the job's cgroup
# the job's limits that a container's parent cgroup copies (cgroup v1), in the order written
LIMIT_FILES = {"memory": ("memory.limit_in_bytes", "memory.memsw.limit_in_bytes"),
               "cpu": ("cpu.cfs_period_us", "cpu.cfs_quota_us"), "pids": ("pids.max",)}

# distribution/reference's grammar, enough to refuse what no registry would take
_COMPONENT = r"[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*"
_DOMAIN = r"(?:[a-zA-Z0-9](?:[a-zA-Z0-9-]*[a-zA-Z0-9])?(?:\.[a-zA-Z0-9-]+)*(?::[0-9]+)?|\[[0-9a-fA-F:]+\](?::[0-9]+)?)"
_REFERENCE = re.compile(
    rf"^(?:(?P<domain>{_DOMAIN})/)?(?P<path>{_COMPONENT}(?:/{_COMPONENT})*)"
    r"(?::(?P<tag>[\w][\w.-]{0,127}))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$")


class ContainerError(Exception):
    """A container could not be pulled, prepared or run; the message is for people."""


# ---------------------------------------------------------------- image references

class Image:
    """A parsed image reference: registry, repository, tag and/or digest."""

    def __init__(self, registry: str, repository: str, tag: str, digest: str):
        self.registry, self.repository, self.tag, self.digest = registry, repository, tag, digest

    def __str__(self) -> str:
        out = f"{self.registry}/{self.repository}" if self.registry else self.repository
        if self.tag:
            out += f":{self.tag}"
        if self.digest:
            out += f"@{self.digest}"
        return out

    def __repr__(self) -> str:
        return f"Image({str(self)!r})"


def parse_image(ref: str) -> Image:
    """Parse IMAGE as docker and podman spell it, or pyxis/enroot's `registry#repository:tag`.

    A reference without a tag or digest means `:latest`. ContainerError says what is wrong."""
    text = (ref or "").strip()
    if text.startswith("docker://"):
        text = text[len("docker://"):]
    if "#" in text:  # enroot's spelling: nvcr.io#nvidia/pytorch:24.01-py3
        registry, _, rest = text.partition("#")
        text = f"{registry}/{rest}" if registry else rest
    m = _REFERENCE.match(text)
    if not m or not ref or ref != ref.strip():
        raise ContainerError(
            f"image {ref!r} is not a valid image reference; write it as "
            "[REGISTRY[:PORT]/]REPOSITORY[:TAG][@sha256:DIGEST], e.g. "
            "nvcr.io/nvidia/pytorch:24.01-py3 (repository names are lower case)")
    domain, path = m.group("domain") or "", m.group("path")
    if domain and "." not in domain and ":" not in domain and domain != "localhost" \
            and not domain.startswith("["):
        path, domain = f"{domain}/{path}", ""  # `library/ubuntu`: the first part is a path
    tag = m.group("tag") or ("" if m.group("digest") else "latest")
    return Image(domain, path, tag, m.group("digest") or "")


def parse_mounts(text) -> list:
    """`SRC[:DST[:ro|rw]],...` (pyxis's --container-mounts) or a list of such strings, as
    dicts {"src", "dst", "ro"}; ContainerError names the mount that does not parse."""
    items = text.split(",") if isinstance(text, str) else list(text or [])
    out = []
    for item in (i.strip() for i in items):
        if not item:
            continue
        parts = item.split(":")
        if len(parts) > 3 or (len(parts) == 3 and parts[2] not in ("ro", "rw")):
            raise ContainerError(
                f"container mount {item!r} does not parse; write SRC[:DST[:ro|rw]] with "
                "absolute paths, several separated by commas")
        src, dst = parts[0], parts[1] if len(parts) > 1 and parts[1] else parts[0]
        for p in (src, dst):
            if not p.startswith("/") or "\0" in p:
                raise ContainerError(
                    f"container mount {item!r}: {p!r} is not an absolute path; mount paths "
                    "must start with /")
        out.append({"src": os.path.normpath(src), "dst": os.path.normpath(dst),
                    "ro": len(parts) == 3 and parts[2] == "ro"})
    return out


# ---------------------------------------------------------------- runtimes

def _quick(argv: list, timeout: float = 10.0) -> subprocess.CompletedProcess:
    return subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                          timeout=timeout)


def _version(binary: str, argv: list) -> str:
    try:
        r = _quick([binary] + argv, 10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    if r.returncode != 0:
        return ""
    m = re.search(r"\d+\.\d+(?:\.\d+)?", r.stdout)
    return m.group(0) if m else r.stdout.strip()[:40]


def _cdi_devices_json(spec: dict) -> list:
    """(name, [device node paths]) of each device in a parsed CDI spec."""
    out = []
    for dev in spec.get("devices") or []:
        nodes = ((dev or {}).get("containerEdits") or {}).get("deviceNodes") or []
        out.append((str(dev.get("name", "")),
                    [n.get("hostPath") or n.get("path") or ""
                     for n in nodes if isinstance(n, dict)]))
    return out


def _cdi_devices_yaml(text: str) -> list:
    """(name, [device node paths]) of each device under `devices:` in a CDI spec written as
    YAML (the NVIDIA Container Toolkit's block style; the agent has no YAML library)."""
    out, item, in_devices, item_indent = [], None, False, -1
    for line in text.splitlines():
        body = line.split(" #", 1)[0].rstrip()
        if not body.strip() or body.lstrip().startswith("#"):
            continue
        indent = len(body) - len(body.lstrip())
        if indent == 0 and not body.startswith("-"):
            in_devices = body.startswith("devices:")
            continue
        if not in_devices:
            continue
        stripped = body.lstrip()
        if stripped.startswith("- ") and (item is None or indent <= item_indent):
            item_indent, item = indent, {"name": "", "paths": []}
            out.append(item)
            stripped = stripped[2:].lstrip()
            indent += 2
        if item is None:
            continue
        key, _, value = stripped.lstrip("- ").partition(":")
        value = value.strip().strip("\"'")
        if key == "name" and indent == item_indent + 2:
            item["name"] = value
        elif key in ("path", "hostPath") and value.startswith("/dev/"):
            item["paths"].append(value)
    return [(i["name"], i["paths"]) for i in out]


def cdi_spec(dirs=CDI_DIRS) -> dict:
    """The node's CDI spec for NVIDIA GPUs (the NVIDIA Container Toolkit writes one with
    `nvidia-ctk cdi generate`): {"spec": its path, "version": its cdiVersion, "devices":
    {"/dev/nvidiaN": CDI name}}, the name of the device that holds exactly that one GPU node
    (index names before UUIDs, whole GPUs before MIG slices); {} where the node has none, or
    none that names a GPU."""
    for d in dirs:
        for path in sorted(glob.glob(os.path.join(d, "*.yaml"))
                           + glob.glob(os.path.join(d, "*.json"))):
            try:
                with open(path) as f:
                    text = f.read(4 * 2**20)
            except OSError:
                continue
            if text.lstrip().startswith("{"):
                try:
                    spec = json.loads(text)
                except ValueError:
                    continue
                kind, devices = spec.get("kind", ""), _cdi_devices_json(spec)
                version = str(spec.get("cdiVersion", ""))
            else:
                m = re.search(r"^kind:\s*[\"']?([^\s\"']+)", text, re.M)
                kind, devices = (m.group(1) if m else ""), _cdi_devices_yaml(text)
                v = re.search(r"^cdiVersion:\s*[\"']?([^\s\"']+)", text, re.M)
                version = v.group(1) if v else ""
            if kind != "nvidia.com/gpu":
                continue
            found = {}
            for name, paths in devices:
                gpus = [p for p in paths if re.fullmatch(r"/dev/nvidia\d+", p)]
                if name and len(gpus) == 1:
                    found.setdefault(gpus[0], []).append(name)
            if found:
                pick = {dev: min(names, key=lambda n: (":" in n, not n.isdigit(), len(n), n))
                        for dev, names in found.items()}
                return {"spec": path, "version": version,
                        "devices": {dev: f"{kind}={name}" for dev, name in sorted(pick.items())}}
    return {}


def cdi_gpus(dirs=CDI_DIRS) -> bool:
    """Whether the node has a CDI spec that names its NVIDIA GPUs."""
    return bool(cdi_spec(dirs))


def version_tuple(text: str) -> tuple:
    """A version's first three numbers, for comparing (`4.3.1` -> (4, 3, 1))."""
    return tuple(int(x) for x in re.findall(r"\d+", text or "")[:3])


def cdi_refusal(runtime: str, runtime_version: str, spec: dict) -> str:
    """Why this runtime cannot take GPUs by the names of this CDI spec, in words; "" when it
    can. Podman before 4.7 reads specs up to cdiVersion 0.5.0 and answers "unresolvable CDI
    devices" for a newer one (checked with podman 4.3.1); docker has CDI from 25 on."""
    spec_version, have = spec.get("version", ""), version_tuple(runtime_version)
    if runtime == "podman" and have and have < (4, 7) \
            and version_tuple(spec_version) > (0, 5, 0):
        return (f"podman {runtime_version} reads CDI specs up to cdiVersion 0.5.0 and "
                f"{spec['spec']} is {spec_version} (podman would answer \"unresolvable CDI "
                "devices\"); regenerate the spec for this podman or update podman")
    if runtime == "docker" and have and have < (25,):
        return (f"docker {runtime_version} does not take CDI names (docker 25 or later with "
                "the daemon's cdi feature does)")
    if runtime not in ("podman", "docker"):
        return f"{runtime or 'no runtime'} does not take CDI names here"
    return ""


def _cdi_for(runtime: str, runtime_version: str, spec: dict) -> dict:
    """hello's CDI fields: whether jobs get GPUs by CDI name, the spec, its names, and in
    words why not, or which GPUs of this node the spec does not name."""
    if not spec:
        return {"cdi": False, "cdi_spec": "", "cdi_devices": {}, "cdi_note": ""}
    refusal = cdi_refusal(runtime, runtime_version, spec)
    present = sorted(glob.glob("/dev/nvidia[0-9]*"))
    missing = [p for p in present if p not in spec["devices"]]
    note = (f"GPUs go to containers by device node: {refusal}" if refusal else
            f"{spec['spec']} does not name {', '.join(missing)}: jobs with those GPUs get them "
            "by device node (regenerate it: nvidia-ctk cdi generate)" if missing else "")
    return {"cdi": not refusal, "cdi_spec": spec["spec"], "cdi_devices": spec["devices"],
            "cdi_note": note}


def podman_init(environ=os.environ) -> str:
    """The init that `podman run --init` starts (catatonit): its path, or "" where there is
    none and every `--init` run would fail with exit 125. Read as podman reads it: the
    `init_path` of the last containers.conf that sets one (CONTAINERS_CONF replaces them all),
    else catatonit in podman's helper directories."""
    conf = environ.get("CONTAINERS_CONF")
    files = [conf] if conf else ["/usr/share/containers/containers.conf",
                                 "/etc/containers/containers.conf",
                                 *sorted(glob.glob("/etc/containers/containers.conf.d/*.conf"))]
    configured = ""
    for path in files:
        try:
            with open(path) as f:
                text = f.read(1 << 20)
        except OSError:
            continue
        found = re.findall(r"""^\s*init_path\s*=\s*["']([^"']+)["']""", text, re.M)
        if found:
            configured = found[-1]
    candidates = [configured] if configured else \
        [os.path.join(d, "catatonit") for d in PODMAN_INIT_DIRS]
    return next((c for c in candidates if os.path.isfile(c) and os.access(c, os.X_OK)), "")


def detect(prefer: str = "") -> dict:
    """The node's container runtimes, the one jobs use, and in words why none when none.

    Docker counts only with a reachable daemon (a bare CLI cannot run anything)."""
    found, notes = {}, []
    for name in RUNTIMES:
        binary = shutil.which(name)
        if not binary:
            continue
        if name == "docker":
            version = _version(binary, ["version", "--format", "{{.Server.Version}}"])
            if not version:
                notes.append("docker is installed but its daemon does not answer")
                continue
        else:
            version = _version(binary, ["version"] if name == "enroot" else ["--version"])
        found[name] = {"path": binary, "version": version}
    order = ([prefer] if prefer in found else []) + [n for n in RUNTIMES if n in found]
    runtime = order[0] if order else ""
    reason = "" if runtime else (
        "no container runtime on this node (install podman, docker or enroot)"
        + (f"; {'; '.join(notes)}" if notes else ""))
    version = found.get(runtime, {}).get("version", "")
    # docker's engine carries its own init (docker-init); podman needs catatonit installed
    init = runtime != "podman" or bool(podman_init())
    return {"runtime": runtime, "runtimes": found, "reason": reason, "init": init,
            "init_note": "" if init else NO_INIT_NOTE,
            **_cdi_for(runtime, version, cdi_spec() if runtime else {})}


def runtime_word(agent_info) -> str:
    """A node's container runtime in one word for tables: what detect() found (`podman`),
    `none` where it found none, `-` before the node's agent reported."""
    found = (agent_info or {}).get("containers")
    if found is None:
        return "-"
    return found.get("runtime") or "none"


# ---------------------------------------------------------------- the image cache

def lru_victims(entries: dict, high_water: int, in_use=()) -> list:
    """Images to remove, least recently used first, until the cache is at or under its
    high-water mark; images that jobs use now are never chosen."""
    total = sum(int(e.get("size") or 0) for e in entries.values())
    out = []
    for image_id, e in sorted(entries.items(), key=lambda kv: kv[1].get("last_used", 0)):
        if total <= high_water:
            break
        if image_id in in_use:
            continue
        out.append(image_id)
        total -= int(e.get("size") or 0)
    return out


class ImageCache:
    """The node's record of pulled images: image id -> refs, digest, size, pulled, last_used.

    Shared by the agent (pulls) and job steps (uses), so every change holds a file lock."""

    def __init__(self, directory: str, high_water_bytes: int):
        self.dir = directory
        self.path = os.path.join(directory, "images.json")
        self.high_water = int(high_water_bytes)

    @contextlib.contextmanager
    def _locked(self):
        os.makedirs(self.dir, mode=0o700, exist_ok=True)
        fd = os.open(os.path.join(self.dir, "images.lock"), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                with open(self.path) as f:
                    entries = json.load(f)
            except (OSError, ValueError):
                entries = {}
            yield entries
            tmp = self.path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(entries, f, indent=1, sort_keys=True)
            os.replace(tmp, self.path)
        finally:
            os.close(fd)

    def entries(self) -> dict:
        with self._locked() as entries:
            return dict(entries)

    def find(self, image: Image):
        """(image id, entry) of a cached image for this reference, else (None, None)."""
        with self._locked() as entries:
            for image_id, e in entries.items():
                if image.digest and e.get("digest") == image.digest:
                    return image_id, dict(e)
                if not image.digest and str(image) in e.get("refs", []):
                    return image_id, dict(e)
        return None, None

    def record(self, image: Image, image_id: str, digest: str, size: int) -> dict:
        now = time.time()
        with self._locked() as entries:
            for e in entries.values():  # a tag names one image: the newest pull
                if str(image) in e.get("refs", []) and not image.digest:
                    e["refs"].remove(str(image))
            e = entries.setdefault(image_id, {"refs": [], "pulled": now})
            if str(image) not in e["refs"]:
                e["refs"].append(str(image))
            e.update(digest=digest, size=int(size), last_used=now)
            return dict(e)

    def touch(self, image_id: str) -> None:
        with self._locked() as entries:
            if image_id in entries:
                entries[image_id]["last_used"] = time.time()

    def forget(self, image_id: str) -> None:
        with self._locked() as entries:
            entries.pop(image_id, None)

    def listing(self) -> list:
        """For `trainyard node NAME`: one dict per cached image, most recently used first."""
        rows = [{"id": i, **e} for i, e in self.entries().items()]
        return sorted(rows, key=lambda r: -r.get("last_used", 0))


# ---------------------------------------------------------------- pulls

def _auth_config(registry: str, auth: dict, directory: str) -> str:
    """Write the registry's credentials as a container auth file (mode 0600); its path."""
    user, password = auth.get("username", ""), auth.get("password", "")
    token = base64.b64encode(f"{user}:{password}".encode()).decode()
    path = os.path.join(directory, "config.json")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"auths": {registry or "docker.io": {"auth": token}}}, f)
    return path


def _scrub(text: str, auth) -> str:
    for secret in (auth or {}).values():
        if isinstance(secret, str) and len(secret) >= 3:
            text = text.replace(secret, "***")
    return text


def _pull_argv(runtime: str, image: Image, authfile: str) -> list:
    if runtime == "podman":
        return ["podman", "pull"] + (["--authfile", authfile] if authfile else []) + [str(image)]
    if runtime == "docker":
        conf = ["--config", os.path.dirname(authfile)] if authfile else []
        return ["docker"] + conf + ["pull", str(image)]
    raise ContainerError(f"pulling with {runtime} is not supported; use podman or docker")


def _inspect(runtime: str, ref: str) -> dict:
    try:
        r = _quick([runtime, "image", "inspect", ref], 60)
    except subprocess.TimeoutExpired:
        raise ContainerError(f"{runtime} image inspect {ref} did not answer in 60 s") from None
    if r.returncode != 0:
        raise ContainerError(f"{runtime} cannot inspect {ref}: {r.stderr.strip()[-300:]}")
    try:
        data = json.loads(r.stdout)[0]
    except (ValueError, IndexError, KeyError):
        raise ContainerError(f"{runtime} image inspect {ref} answered no image") from None
    digest = data.get("Digest") or ""
    if not digest:
        repo_digests = data.get("RepoDigests") or []
        digest = repo_digests[0].rpartition("@")[2] if repo_digests else ""
    image_id = (data.get("Id") or data.get("ID") or "").replace("sha256:", "")
    return {"id": image_id, "digest": digest, "size": int(data.get("Size") or 0)}


def pull(runtime: str, image: Image, timeout_s: float, auth=None, on_progress=None,
         node: str = "") -> dict:
    """Pull IMAGE with the runtime; {"id", "digest", "size"} of what was pulled.

    `on_progress(layers_done, layers_total_or_None)` is called as layers land. ContainerError
    says what the runtime said, or that the pull ran past its timeout (the pull is ended)."""
    where = f" on {node}" if node else ""
    private = tempfile.mkdtemp(prefix="trainyard-pull-")  # 0700: the credentials' only home
    try:
        authfile = _auth_config(image.registry, auth, private) if auth else ""
        argv = _pull_argv(runtime, image, authfile)
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, start_new_session=True)
        lines, layers, total, buf = [], set(), None, b""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                last = _scrub(lines[-1], auth) if lines else "nothing"
                raise ContainerError(
                    f"pulling {image}{where} timed out after {timeout_s:g} s (the runtime's "
                    f"last words: {last}); check the registry, or raise the pull timeout")
            ready, _, _ = select.select([proc.stdout], [], [], min(left, 0.5))
            if not ready:
                continue
            data = os.read(proc.stdout.fileno(), 65536)
            if not data:
                break
            buf += data
            *complete, buf = buf.split(b"\n")
            for raw in complete:
                line = raw.decode("utf-8", "replace").strip()
                if not line:
                    continue
                lines.append(line)
                m = re.match(r"Copying blob (?:sha256:)?([0-9a-f]{12,})", line)
                d = re.match(r"([0-9a-f]{12}): (Pulling fs layer|Pull complete|Already exists)", line)
                if m:
                    layers.add(m.group(1)[:12])
                elif d and d.group(2) == "Pulling fs layer":
                    total = (total or 0) + 1
                elif d:
                    layers.add(d.group(1))
                else:
                    continue
                if on_progress is not None:
                    on_progress(len(layers), total)
        rc = proc.wait()
        if rc != 0:
            said = _scrub(" | ".join(x for x in lines if not x.startswith("Trying"))[-400:], auth)
            raise ContainerError(f"cannot pull {image}{where}: {said or f'{runtime} exited {rc}'}")
    except OSError as e:
        raise ContainerError(f"cannot pull {image}{where}: {e}") from None
    finally:
        shutil.rmtree(private, ignore_errors=True)
    got = _inspect(runtime, str(image))
    if image.digest and got["digest"] and got["digest"] != image.digest:
        raise ContainerError(f"{image}{where}: the registry served {got['digest']}, not the "
                             "pinned digest")
    return got


def ensure(runtime: str, image: Image, cache: ImageCache, timeout_s: float, auth=None,
           on_progress=None, node: str = "") -> dict:
    """The cached image for this reference, pulled first when the node does not hold it; the
    cache entry with `id` and `pulled_now`. Pulls may evict least recently used images."""
    image_id, entry = cache.find(image)
    if image_id and _exists(runtime, image_id):
        cache.touch(image_id)
        return {"id": image_id, **entry, "pulled_now": False}
    if image_id:
        cache.forget(image_id)  # removed behind the cache's back
    if runtime == "enroot":
        raise ContainerError("enroot images are imported by the job itself (enroot import); "
                             "pre-pulling is for podman and docker")
    got = pull(runtime, image, timeout_s, auth, on_progress, node)
    entry = cache.record(image, got["id"], got["digest"], got["size"])
    evict(runtime, cache, in_use={got["id"]})
    return {"id": got["id"], **entry, "pulled_now": True}


def _exists(runtime: str, image_id: str) -> bool:
    try:
        return _quick([runtime, "image", "inspect", "--format", "{{.Id}}", image_id], 60) \
            .returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def evict(runtime: str, cache: ImageCache, in_use=()) -> list:
    """Remove least recently used images over the high-water mark; the ids removed. An image
    that the runtime refuses to remove (a container uses it) stays."""
    removed = []
    for image_id in lru_victims(cache.entries(), cache.high_water, set(in_use)):
        try:
            ok = _quick([runtime, "rmi", image_id], 120).returncode == 0
        except (OSError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            cache.forget(image_id)
            removed.append(image_id)
    return removed


# ---------------------------------------------------------------- the run command

def gpu_devices(gpus: list, dev: str = "/dev", cdi=False) -> list:
    """The device arguments for exactly these GPUs: their CDI names where the node's CDI spec
    names every one of them (`cdi` true: read the node's spec; or a {"/dev/nvidiaN": name} map),
    else /dev/nvidiaN and the control devices that exist."""
    nodes = [os.path.join(dev, f"nvidia{int(g)}") for g in gpus]
    if cdi and gpus:
        names = cdi if isinstance(cdi, dict) else cdi_spec().get("devices", {})
        if all(n in names for n in nodes):
            return [names[n] for n in nodes]
    if gpus:
        nodes += [p for p in (os.path.join(dev, c) for c in CONTROL_DEVICES) if os.path.exists(p)]
    return nodes


def run_argv(runtime: str, *, image_id: str, name: str, argv: list, devices: list,
             mounts: list, workdir: str, env_file: str, uid: int, gid: int, groups: list,
             mem_mb=None, cpus=None, pids_max=None, cgroup_parent: str = "",
             init: bool = True) -> list:
    """The runtime's command that runs ARGV in the image as the job's user with its devices,
    mounts, environment and limits (podman and docker spell it alike). With a cgroup parent
    the limits are the parent's (see cgroup_parent()), else the runtime sets them. An init
    (PID 1 that forwards signals and reaps) only where the runtime has one (detect())."""
    if runtime not in ("podman", "docker"):
        raise ContainerError(f"running a container with {runtime!r} is not supported here; "
                             "use podman or docker")
    out = [runtime, "run", "--name", name] + (["--init"] if init else []) + [
           "--network", "host", "--ipc", "host",
           "--cap-drop", "all", "--security-opt", "no-new-privileges",
           "--user", f"{uid}:{gid}", "--env-file", env_file]
    for g in groups:
        if g != gid:
            out += ["--group-add", str(g)]
    for d in devices:
        out += ["--device", d]
    for m in mounts:
        out += ["--volume", f"{m['src']}:{m['dst']}" + (":ro" if m.get("ro") else "")]
    if workdir:
        out += ["--workdir", workdir]
    if cgroup_parent:  # it holds the job's limits (cgroup_parent())
        out += ["--cgroup-parent", cgroup_parent]
    else:
        if mem_mb:
            out += ["--memory", f"{int(mem_mb)}m", "--memory-swap", f"{int(mem_mb)}m"]
        if cpus:
            out += ["--cpus", str(cpus)]
        if pids_max:
            out += ["--pids-limit", str(int(pids_max))]
    return out + ["--", image_id] + list(argv)


def write_env_file(path: str, env: dict) -> list:
    """The container's environment as an env file (mode 0600, never on a command line); the
    names of variables it cannot carry (a value with a newline)."""
    skipped, lines = [], []
    for k, v in sorted(env.items()):
        if "\n" in str(v) or "=" in k or not k:
            skipped.append(k)
            continue
        lines.append(f"{k}={v}\n")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.writelines(lines)
    return skipped


def cgroup_parent(controller: str = "devices") -> str:
    """The container's parent cgroup, beside the job's own (`<job>.container`) and holding
    the job's limits, copied from the cgroups this process (the job step's child) has
    joined; "" where the job has no cgroups or they cannot be copied.

    The container nests there, not in the job's cgroups: runc cannot nest under a cgroup
    that denies devices, nor run without cgroups. The limits sit on the parent, not on the
    container (run_argv then passes none), so that the parent still tells, after runc has
    removed the container's own cgroup, whether the memory limit was reached:
    container_state() reads it, remove_container() removes the parent."""
    own, mounts = own_cgroup_paths(), cgroup_mounts()
    job = own.get(controller, "").rstrip("/")
    if "/trainyard/" not in job + "/" or "memory" not in mounts or "memory" not in own:
        return ""
    parent = job + CONTAINER_CGROUP_SUFFIX
    made = []
    try:
        for c, files in LIMIT_FILES.items():
            if c not in mounts or c not in own:
                continue
            src = os.path.join(mounts[c], own[c].lstrip("/"))
            dst = os.path.join(mounts[c], parent.lstrip("/"))
            os.makedirs(dst, exist_ok=True)
            made.append(dst)
            for name in files:
                if os.path.exists(os.path.join(src, name)):
                    with open(os.path.join(src, name)) as f:
                        value = f.read().strip()
                    with open(os.path.join(dst, name), "w") as f:
                        f.write(value)
    except OSError:
        for d in made:
            with contextlib.suppress(OSError):
                os.rmdir(d)
        return ""
    return parent


_parents: dict = {}  # container name -> its cgroup parent, as container_state() found it


def _parent_of(runtime: str, name: str) -> str:
    """The cgroup parent that cgroup_parent() made for this container, else ""."""
    if name in _parents:
        return _parents.pop(name)
    try:
        r = _quick([runtime, "inspect", "--format", "{{.HostConfig.CgroupParent}}", name], 30)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    parent = r.stdout.strip() if r.returncode == 0 else ""
    return parent if _made_here(parent) else ""


def _made_here(parent: str) -> bool:
    """Whether a container's cgroup parent is one that cgroup_parent() made (and may remove)."""
    return parent.endswith(CONTAINER_CGROUP_SUFFIX) and "/trainyard/" in parent


def _limit_reached(parent: str) -> bool:
    """Whether the container's memory reached the job's limit, held by its parent cgroup."""
    d = os.path.join(cgroup_mounts().get("memory", "/nonexistent"), parent.lstrip("/"))
    try:
        with open(os.path.join(d, "memory.limit_in_bytes")) as f:
            limit = int(f.read())
        with open(os.path.join(d, "memory.max_usage_in_bytes")) as f:
            return int(f.read()) >= limit
    except (OSError, ValueError):
        return False


def container_state(runtime: str, name: str) -> dict:
    """{"oom": bool, "exit": int|None} of a finished container (empty when it is gone).

    OOM: the runtime's word, or a container killed (SIGKILL, 137) after its memory reached
    the limit its parent cgroup holds. conmon misses OOM kills on hybrid cgroup hierarchies,
    and cgroup v1 counts them in the container's own cgroup, which runc has removed by now."""
    try:
        r = _quick([runtime, "inspect", "--format",
                    "{{.State.OOMKilled}} {{.State.ExitCode}} {{.HostConfig.CgroupParent}}",
                    name], 30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    words = r.stdout.split()
    if r.returncode != 0 or len(words) < 2:
        return {}
    oom, code = words[0] == "true", words[1]
    rc = int(code) if code.lstrip("-").isdigit() else None
    parent = words[2] if len(words) > 2 else ""
    _parents[name] = parent if _made_here(parent) else ""
    if not oom and rc == 128 + signal.SIGKILL and _made_here(parent):
        oom = _limit_reached(parent)
    return {"oom": oom, "exit": rc}


def remove_container(runtime: str, name: str) -> None:
    """End and remove a job's container (after its client ended, or was killed), and the
    parent cgroup that held its limits."""
    parent = _parent_of(runtime, name)
    with contextlib.suppress(OSError, subprocess.TimeoutExpired):
        _quick([runtime, "rm", "--force", "--time", "0", name] if runtime == "podman"
               else [runtime, "rm", "--force", name], 60)
    if parent:  # with what the runtime left in it (podman's conmon cgroup)
        for point in set(cgroup_mounts().values()):
            top = os.path.join(point, parent.lstrip("/"))
            for d, _subdirs, _files in os.walk(top, topdown=False):
                with contextlib.suppress(OSError):
                    os.rmdir(d)
