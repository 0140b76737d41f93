"""The S3-compatible bucket that keeps jobs' finished output once the daemon's spool lets it go.

`[logs] bucket = "s3://BUCKET/PREFIX"` (with `endpoint_url` for MinIO, Ceph or any other
S3-compatible server, `region`, and `credentials_file` in AWS's shared-credentials format, mode
0600; without it boto3's own chain applies, e.g. the instance's role). The daemon's files under
`[logs] dir` stay the write-ahead spool: output is acknowledged to the agents once it is on the
local disk, and a rank whose stream ended is shipped to `PREFIX/JOB/ATTEMPT/RANK.log` (with the
attempt's `nodes.json`) by `Shipper`, which removes the local copy only after the upload
succeeded. Every bucket call blocks, so the shipper runs them in a thread; an unreachable bucket
keeps the spool, is retried with backoff, and is reported as a problem until it answers again.
"""

from __future__ import annotations

import asyncio
import configparser
import contextlib
import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..config import read_private
from ..settings import parse_bucket_url

log = logging.getLogger("trainyard.logs")

NODES_OBJECT = "nodes.json"
RETRY_MAX_S = 30.0  # the longest wait between two tries of an unreachable bucket


class BucketError(Exception):
    """The bucket did not do what was asked: `what` was tried, `why` it failed (the same words for
    every object, so a bucket that stays down is one problem, not one per upload); no secrets."""

    def __init__(self, what: str, why: str):
        super().__init__(f"cannot {what}: {why}")
        self.why = why


def load_bucket_credentials(path: str) -> dict[str, str]:
    """boto3's keyword arguments from an AWS shared-credentials file ([default] or its one profile);
    ValueError naming the file and the problem when it is missing, readable by others or
    incomplete. The values are never logged."""
    if not path:
        return {}
    what = "logs.credentials_file"
    p = Path(path).expanduser()
    text = read_private(path, what)
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(text)
    except configparser.Error as e:
        raise ValueError(f"{what}: cannot read {str(p)!r}: {type(e).__name__}") from None
    sections = parser.sections()
    name = "default" if "default" in sections else sections[0] if len(sections) == 1 else ""
    section = parser[name] if name else {}
    keys = {"aws_access_key_id", "aws_secret_access_key"}
    if not all(section.get(k) for k in keys):
        raise ValueError(f"{what}: {str(p)!r} needs a [default] profile (or exactly one profile) "
                         "with aws_access_key_id and aws_secret_access_key")
    out = {k: section[k] for k in keys}
    if section.get("aws_session_token"):
        out["aws_session_token"] = section["aws_session_token"]
    return out


class LogBucket:
    """Objects `PREFIX/JOB/ATTEMPT/RANK.log` in one bucket; every method blocks (run it in a thread)."""

    def __init__(self, url: str, endpoint_url: str = "", region: str = "",
                 credentials: dict[str, str] | None = None, timeout_s: float = 10.0):
        self.url = url
        self.name, self.prefix = parse_bucket_url(url)
        self.endpoint_url = endpoint_url
        self.region = region or "us-east-1"
        self._credentials = dict(credentials or {})
        self._timeout_s = timeout_s
        self._client: Any = None

    @classmethod
    def from_settings(cls, logs: Any) -> LogBucket | None:
        """The bucket of `[logs]`, None when none is set; ValueError for a bad credentials file."""
        if not logs.bucket:
            return None
        return cls(logs.bucket, logs.endpoint_url, logs.region, load_bucket_credentials(logs.credentials_file))

    def __repr__(self) -> str:  # never the credentials, whatever prints this
        return f"LogBucket({self.url!r}, endpoint_url={self.endpoint_url!r})"

    def key(self, job_id: int, attempt: int, name: str) -> str:
        return "/".join(p for p in (self.prefix, str(job_id), str(attempt), name) if p)

    def rank_key(self, job_id: int, attempt: int, rank: int) -> str:
        return self.key(job_id, attempt, f"{rank}.log")

    @property
    def client(self) -> Any:
        if self._client is None:
            import boto3  # noqa: PLC0415 - only daemons with a bucket pay for importing it
            from botocore.config import Config  # noqa: PLC0415

            # one try per call: the shipper retries with its own backoff and says why meanwhile;
            # path-style addressing is what S3-compatible servers on a plain host name answer
            config = Config(connect_timeout=self._timeout_s, read_timeout=self._timeout_s,
                            retries={"mode": "standard", "max_attempts": 1},
                            s3={"addressing_style": "path"} if self.endpoint_url else None)
            self._client = boto3.session.Session().client(
                "s3", endpoint_url=self.endpoint_url or None, region_name=self.region, config=config,
                **self._credentials)
        return self._client

    # ---------------------------------------------------------------- calls
    def put(self, job_id: int, attempt: int, name: str, path: Path) -> None:
        key = self.key(job_id, attempt, name)
        with self._call(f"upload {path} to {self.url}"):
            self.client.upload_file(str(path), self.name, key)

    def read(self, job_id: int, attempt: int, rank: int, offset: int, limit: int) -> tuple[bytes, int] | None:
        """(up to `limit` bytes from `offset`, the object's size), or None when there is no object."""
        key = self.rank_key(job_id, attempt, rank)
        with self._call(f"read {key} from {self.url}"):
            from botocore.exceptions import ClientError  # noqa: PLC0415

            try:
                got = self.client.get_object(Bucket=self.name, Key=key,
                                             Range=f"bytes={offset}-{offset + max(limit, 1) - 1}")
            except ClientError as e:
                code = e.response.get("Error", {}).get("Code", "")
                if code in ("NoSuchKey", "404"):
                    return None
                if code != "InvalidRange":  # at or past the end (or an empty object)
                    raise
                try:
                    head = self.client.head_object(Bucket=self.name, Key=key)
                except ClientError as e2:
                    if e2.response.get("Error", {}).get("Code", "") in ("NoSuchKey", "404"):
                        return None
                    raise
                return b"", int(head["ContentLength"])
            data = got["Body"].read()
            size = int(str(got.get("ContentRange", "")).rpartition("/")[2] or len(data))
            return data[:limit], size

    def ranks(self, job_id: int, attempt: int) -> list[str]:
        """The node of each rank of an attempt, as shipped beside its output ([] when none was)."""
        key = self.key(job_id, attempt, NODES_OBJECT)
        with self._call(f"read {key} from {self.url}"):
            from botocore.exceptions import ClientError  # noqa: PLC0415

            try:
                body = self.client.get_object(Bucket=self.name, Key=key)["Body"].read()
            except ClientError as e:
                if e.response.get("Error", {}).get("Code", "") in ("NoSuchKey", "404"):
                    return []
                raise
        try:
            nodes = json.loads(body)
        except ValueError:
            return []
        return [str(n) for n in nodes] if isinstance(nodes, list) else []

    def delete_older(self, cutoff: float) -> int:
        """Remove the objects under the prefix last written before `cutoff` (epoch s); how many."""
        old: list[str] = []
        with self._call(f"expire old output in {self.url}"):
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.name, Prefix=f"{self.prefix}/" if self.prefix else "")
            for page in pages:
                old += [o["Key"] for o in page.get("Contents", ()) if o["LastModified"].timestamp() < cutoff]
            for i in range(0, len(old), 1000):  # DeleteObjects takes at most 1000 keys a call
                self.client.delete_objects(Bucket=self.name, Delete={
                    "Objects": [{"Key": k} for k in old[i:i + 1000]], "Quiet": True})
        return len(old)

    @contextlib.contextmanager
    def _call(self, what: str):
        from botocore.exceptions import BotoCoreError, ClientError  # noqa: PLC0415
        from botocore.exceptions import ConnectionError as BotoConnectionError  # noqa: PLC0415

        try:
            yield
        except ClientError as e:
            err = e.response.get("Error", {})
            why = f"{err.get('Code', '?')}: {err.get('Message', '')}".rstrip(": ")
            raise BucketError(what, why) from None
        except BotoConnectionError:
            raise BucketError(what, f"no answer from {self.endpoint_url or 'S3'}") from None
        except BotoCoreError as e:
            raise BucketError(what, f"{type(e).__name__}: {e}") from None
        except OSError as e:
            raise BucketError(what, e.strerror or str(e)) from None


class Shipper:
    """Moves finished ranks from the spool into the bucket, in a thread, retrying with backoff."""

    def __init__(self, bucket: LogBucket, spool: Path, on_problem: Callable[[str], None],
                 retry_max_s: float = RETRY_MAX_S):
        self.bucket = bucket
        self.spool = spool
        self.on_problem = on_problem  # on the event loop, each time `problem` changes
        self.retry_max_s = retry_max_s
        self.problem = ""
        self.pending: set[tuple[int, int]] = set()  # attempts with finished ranks still in the spool
        self._expire_before: float | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="logs-shipper")

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    def ship(self, job_id: int, attempt: int) -> None:
        """An attempt has a rank whose stream ended: its output goes to the bucket."""
        self.pending.add((job_id, attempt))
        self._wake.set()

    def expire(self, cutoff: float) -> None:
        self._expire_before = cutoff
        self._wake.set()

    async def _run(self) -> None:
        self.pending |= await asyncio.to_thread(self._finished_in_spool)  # left by the last daemon
        delay = 0.0
        while True:
            if not self.pending and self._expire_before is None:
                await self._wake.wait()
            self._wake.clear()
            try:
                await self._step()
            except Exception as e:  # noqa: BLE001 - whatever failed, the spool keeps the output
                if isinstance(e, BucketError):
                    log.debug("%s", e)  # the problem below is logged once when it changes
                    why = e.why
                else:
                    log.exception("shipping jobs' output to %s failed", self.bucket.url)
                    why = f"{type(e).__name__}: {e}"
                self._set_problem(f"log bucket {self.bucket.url}: {why}; finished jobs' output stays "
                                  f"in {self.spool} and is sent again")
                delay = min(max(1.0, delay * 2), self.retry_max_s)
                await asyncio.sleep(delay)
                continue
            delay = 0.0
            self._set_problem("")

    async def _step(self) -> None:
        if self._expire_before is not None:
            cutoff = self._expire_before
            removed = await asyncio.to_thread(self.bucket.delete_older, cutoff)
            if self._expire_before == cutoff:
                self._expire_before = None
            if removed:
                log.info("removed %d objects of expired output from %s", removed, self.bucket.url)
        while self.pending:
            where = min(self.pending)
            await asyncio.to_thread(self._ship_attempt, *where)
            self.pending.discard(where)

    def _ship_attempt(self, job_id: int, attempt: int) -> None:
        """Upload the attempt's finished ranks (and its nodes.json), then drop their local copies."""
        d = self.spool / str(job_id) / str(attempt)
        nodes = d / NODES_OBJECT
        if nodes.exists():
            self.bucket.put(job_id, attempt, NODES_OBJECT, nodes)
        for out in sorted(d.glob("*.out")):
            if not out.stem.isdigit() or not out.with_suffix(".done").exists():
                continue  # still streaming: shipped when it ends
            self.bucket.put(job_id, attempt, f"{out.stem}.log", out)
            out.unlink(missing_ok=True)  # only now: the bucket holds it

    def _finished_in_spool(self) -> set[tuple[int, int]]:
        found = set()
        for done in self.spool.glob("*/*/*.done"):
            job, attempt = done.parent.parent.name, done.parent.name
            if job.isdigit() and attempt.isdigit() and done.with_suffix(".out").exists():
                found.add((int(job), int(attempt)))
        return found

    def _set_problem(self, why: str) -> None:
        if why != self.problem:
            self.problem = why
            self.on_problem(why)


__all__ = ["BucketError", "LogBucket", "Shipper", "load_bucket_credentials", "parse_bucket_url"]
