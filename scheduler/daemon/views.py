"""Read models: the JSON shapes of jobs and nodes that the API, CLI and TUI show."""

from __future__ import annotations

import struct
import zlib
from collections.abc import Iterable
from typing import Any

import orjson

from .caller import Caller


def json_bytes(content: Any) -> bytes:
    """`content` as JSON, by orjson. Keys that are not strings (GPU indexes) are written as
    strings, an option that triples orjson's time on a node's telemetry: it is used only for
    content that has such keys."""
    try:
        return orjson.dumps(content)
    except orjson.JSONEncodeError:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)


# A gzip member put together from pieces compressed apart (GET /v1/nodes compresses each node's
# part once per change of it). Each piece is raw deflate ending on a byte boundary (a sync flush)
# and refers to nothing before it, so pieces one after another are one valid deflate stream;
# the member then needs only its header, a final empty block, and the CRC and length of the
# whole (RFC 1952). Compressed by ISA-L where it is installed: a node's part of 8 GPUs (~7 KB)
# at its fastest level in ~12 us against ~45 us at zlib's (about 4x smaller against 5x); a
# small piece at its level 1 (its fastest expands small inputs). Else by zlib: both write
# standard deflate.
try:
    from isal import isal_zlib as _deflate
    _FAST, _SMALL, _SMALL_BELOW = 0, 1, 2048
except ImportError:  # isal is a dependency; a platform without its wheel (tested: test_nodes_listing.py)
    _deflate, _FAST, _SMALL, _SMALL_BELOW = zlib, 1, 1, 0
_GZIP_HEADER = b"\x1f\x8b\x08\x00\x00\x00\x00\x00\x00\xff"  # deflate, no name, no time: same listing, same bytes
_DEFLATE_END = zlib.compressobj(1, zlib.DEFLATED, -zlib.MAX_WBITS).flush()  # an empty final block


def deflate_piece(data: bytes) -> bytes:
    """`data` as raw deflate that can be put before or after other such pieces (see above)."""
    c = _deflate.compressobj(_SMALL if len(data) < _SMALL_BELOW else _FAST, _deflate.DEFLATED, -15)
    return c.compress(data) + c.flush(_deflate.Z_SYNC_FLUSH)


def gzip_joined(pieces: Iterable[bytes], crc32: int, size: int) -> bytes:
    """One gzip member of deflate pieces whose uncompressed bytes, in order, have this CRC-32
    and length."""
    return b"".join((_GZIP_HEADER, *pieces, _DEFLATE_END, struct.pack("<II", crc32, size & 0xFFFFFFFF)))


def gzip_bytes(data: bytes) -> bytes:
    """`data` as one gzip member, compressed as a whole."""
    return gzip_joined([deflate_piece(data)], zlib.crc32(data), len(data))


# a listing shorter than this goes as it is: compressing it would save less than it costs
GZIP_FROM = 16 * 1024


def encoded(content: Any, accept_encoding: str | None) -> tuple[bytes, bool]:
    """A listing's body: JSON, gzip-compressed (True) when it is long and the client's
    Accept-Encoding admits gzip (httpx, and so the CLI and TUI, and curl --compressed ask for it)."""
    body = json_bytes(content)
    if len(body) >= GZIP_FROM and accepts_gzip(accept_encoding):
        return gzip_bytes(body), True
    return body, False


def accepts_gzip(accept_encoding: str | None) -> bool:
    """Whether an Accept-Encoding header admits gzip: named (or as x-gzip), else by `*`, with a
    q-value above 0 (RFC 9110, 12.5.3). A value that cannot be read admits nothing."""
    q: dict[str, float] = {}
    for item in (accept_encoding or "").split(","):
        name, _, params = item.partition(";")
        weight = 1.0
        for param in params.split(";"):
            key, _, value = param.strip().partition("=")
            if key.lower() == "q":
                try:
                    weight = float(value)
                except ValueError:
                    weight = 0.0
        q[name.strip().lower()] = weight
    for name in ("gzip", "x-gzip", "*"):
        if name in q:
            return q[name] > 0
    return False


# What job_json and prediction_json read of a job: a listing selects these columns, with
# `script` as whether the job has one (not the script's text), and not the columns only a
# node's launch or the history read (tests/scheduler/test_busy_reads.py holds them to
# job_json).
LISTED_COLUMNS = (
    "id", "name", "user", "queue", "state", "reason", "reason_detail", "held", "command", "gpus",
    "gpu_type", "nodes", "cpus", "mem_mb", "time_limit_s", "priority", "retries", "failures",
    "attempt", "preemptions", "dependency", "array_parent", "array_task_id", "constraint",
    "exclusive", "nice", "account", "env", "workdir", "submit_time", "start_time", "end_time",
    "exit_code", "estimated_start", "allocation", "ntasks", "ntasks_per_node", "cpus_per_task",
    "features", "nodelist", "exclude", "output", "error", "signal", "requeue", "begin_time", "qos",
    "comment", "mail_type", "mail_user", "recorded", "image", "image_digest", "container_mounts",
    "batch_step", "predicted_runtime_s", "prediction_basis", "prediction_confident",
)


def job_json(j, viewer: Caller | None = None) -> dict[str, Any]:
    """One job; another user's environment shows its names but not their values."""
    env = dict(j.env or {})
    if viewer is not None and not viewer.may_act_on(j.user):
        env = dict.fromkeys(env)
    return {
        "id": j.id, "name": j.name, "user": j.user, "queue": j.queue, "state": j.state, "reason": j.reason,
        "reason_detail": getattr(j, "reason_detail", "") or None,
        "held": j.held or None, "command": j.command, "script": j.script is not None, "gpus": j.gpus,
        "gpu_type": j.gpu_type, "nodes": j.nodes, "cpus": j.cpus, "mem": j.mem_mb,
        "time_limit": j.time_limit_s, "priority": j.priority, "retries": j.retries, "failures": j.failures,
        "attempt": j.attempt, "preemptions": getattr(j, "preemptions", 0) or 0, "dependency": j.dependency or None, "array_job_id": j.array_parent,
        "array_task_id": j.array_task_id, "constraint": j.constraint or {}, "exclusive": j.exclusive,
        "nice": j.nice, "account": j.account or None, "env": env, "workdir": j.workdir,
        "submit_time": j.submit_time, "start_time": j.start_time, "end_time": j.end_time,
        "exit_code": j.exit_code, "estimated_start": j.estimated_start,
        "allocation": [{"node": a["node"], "gpus": a["gpus"]} for a in j.allocation or ()],
        "ntasks": j.ntasks, "ntasks_per_node": j.ntasks_per_node, "cpus_per_task": j.cpus_per_task,
        "features": j.features or None, "nodelist": list(j.nodelist or ()), "exclude": list(j.exclude or ()),
        "output": j.output or None, "error": j.error or None, "signal": j.signal or None,
        "requeue": bool(j.requeue), "begin": j.begin_time, "qos": j.qos or None, "comment": j.comment or None,
        "mail_type": list(j.mail_type or ()), "mail_user": j.mail_user or None,
        "recorded": dict(j.recorded or {}),
        "image": j.image or None, "image_digest": j.image_digest or None,
        "container_mounts": list(j.container_mounts or ()),
        "batch_step": bool(getattr(j, "batch_step", False)),
    }


def node_json(n, *, connected: bool, problem: str, gpus_used: int, telemetry: dict | None,
              excluded: dict[int, str]) -> dict[str, Any]:
    reason = n.reason
    if not connected and problem and (not reason or reason == "connecting"):
        reason = problem
    info = n.agent_info or {}
    return {
        "name": n.name, "address": n.address, "port": n.port, "user": n.user, "pool": n.pool,
        "provider": n.provider, "state": n.state, "reason": reason, "connected": connected,
        "gpu_model": n.gpu_model, "gpus_total": n.gpus_total, "gpus_used": gpus_used,
        "cpus": n.cpus, "mem_mb": n.mem_mb, "labels": n.labels, "last_seen": n.last_seen,
        "simulated": n.simulated, "agent_dir": n.agent_dir, "privilege": n.privilege,
        "fencing": info.get("fencing"), "agent": info,
        "telemetry": telemetry or {"time": None, "gpus": []},
        "excluded_gpus": {str(g): why for g, why in excluded.items()},
    }
