"""Central logs in an S3-compatible bucket: shipped when a rank ends, read back after the node and
the daemon's spool are gone, kept in the spool while the bucket is down, expired with retention.

The bucket is a real S3-compatible HTTP server on loopback: moto's server (`moto[server]`), run
in a thread of the test process. MinIO would be the usual choice, but it has no Debian package
and cannot be downloaded here; moto speaks the same S3 REST API that boto3 sends to any server.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from scheduler.daemon.clock import Clock
from scheduler.daemon.logbucket import LogBucket, load_bucket_credentials
from scheduler.daemon.logstore import LogStore
from scheduler.daemon.state import StateStore
from scheduler.models import Job
from scheduler.settings import Settings, SettingsError
from scheduler.store import init_schema, make_engine
from tests.conftest import PY, ROOT, add_sshd_node, free_port, wait_for, wait_job
from tests.scheduler.test_logs import Sent, chunk

boto3 = pytest.importorskip("boto3")
moto_server = pytest.importorskip("moto.server")

KEY_ID = "AKIATRAINYARDTESTKEY"
SECRET = "s3cr3t-Zq9wVx7-never-shown"
TICKS = "for i in $(seq 1 {n}); do echo out $i; sleep 0.05; done"
_names = itertools.count()


class S3Server:
    """moto's S3 server on a loopback port; stop() and start() again keep its buckets."""

    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=self.port, verbose=False)
        self.server.start()
        self.client = boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                                   aws_access_key_id=KEY_ID, aws_secret_access_key=SECRET)

    def new_bucket(self) -> str:
        name = f"ty-logs-{os.getpid()}-{next(_names)}"
        self.client.create_bucket(Bucket=name)
        return name

    def keys(self, bucket: str) -> list[str]:
        return sorted(o["Key"] for o in self.client.list_objects_v2(Bucket=bucket).get("Contents", ()))

    def stop(self) -> None:
        self.server.stop()

    def start(self) -> None:
        self.server.start()


@pytest.fixture(scope="module")
def s3():
    server = S3Server()
    yield server
    server.stop()


def credentials_file(d: Path, mode: int = 0o600) -> Path:
    p = d / "s3-credentials"
    p.write_text(f"[default]\naws_access_key_id = {KEY_ID}\naws_secret_access_key = {SECRET}\n")
    p.chmod(mode)
    return p


@pytest.fixture
def bucket_cluster(s3, tmp_path, daemon_factory, sshd_factory):
    """A daemon whose [logs] ship to a fresh bucket, with one real sshd node."""
    bucket = s3.new_bucket()
    creds = credentials_file(tmp_path)
    d = daemon_factory(extra_config=f'\n[logs]\nbucket = "s3://{bucket}/cluster-a"\n'
                                    f'endpoint_url = "{s3.url}"\nregion = "us-east-1"\n'
                                    f'credentials_file = "{creds}"\n')
    node = sshd_factory("n1", d.public_key)
    add_sshd_node(d, node)
    return d, node, bucket


def spool(d, job_id: int, attempt: int = 0, rank: int = 0) -> Path:
    return d.state / "logs" / str(job_id) / str(attempt) / f"{rank}.out"


def completed(c, job_id: int) -> None:
    """The job COMPLETED within 30 s (the error names the state it is in otherwise)."""
    try:
        wait_job(c, job_id, "COMPLETED", timeout=30)
    except AssertionError:
        job = c.job(job_id)
        raise AssertionError(f"job {job_id} is {job['state']} ({job['reason']!r}) after 30 s") from None


def log_problems(c) -> list[str]:
    return [e["detail"]["problem"] for e in c.events(limit=1000) if e["action"] == "logs.problem"]


# ------------------------------------------------------------------ through the daemon
def test_output_lands_in_the_bucket_and_is_read_after_the_node_and_the_spool_are_gone(s3, bucket_cluster):
    d, node, bucket = bucket_cluster
    c = d.client()
    job = c.submit({"command": ["sh", "-c", TICKS.format(n=40)]})
    wait_job(c, job["id"], "COMPLETED", timeout=30)
    key = f"cluster-a/{job['id']}/0/0.log"
    wait_for(lambda: key in s3.keys(bucket), 20, what="the output in the bucket")
    assert f"cluster-a/{job['id']}/0/nodes.json" in s3.keys(bucket)
    body = s3.client.get_object(Bucket=bucket, Key=key)["Body"].read().decode()
    assert body.splitlines() == [f"out {i}" for i in range(1, 41)]
    # the local copy goes once the bucket holds it
    wait_for(lambda: not spool(d, job["id"]).exists(), 10, what="the spool emptied")
    d.cli("node", "remove", node.name, "--force", check=True)
    node.stop()
    shutil.rmtree(d.state / "logs")
    out = d.cli("logs", str(job["id"]), check=True)
    assert out.stdout == body
    as_json = json.loads(d.cli("logs", str(job["id"]), "--json", check=True).stdout)
    assert as_json["complete"] and as_json["node"] == "n1" and as_json["size"] == len(body)
    tail = c.log_page(job["id"], offset=len(body) - 7, limit=100)  # a ranged GET from the bucket
    assert tail["data"] == "out 40\n"


def test_an_unreachable_bucket_keeps_the_output_runs_the_job_and_says_so_until_it_answers(
        s3, bucket_cluster):
    d, _, bucket = bucket_cluster
    c = d.client()
    s3.stop()
    try:
        job = c.submit({"command": ["sh", "-c", TICKS.format(n=10)]})
        completed(c, job["id"])
        problem = wait_for(lambda: c.cluster()["problems"], 30, what="the bucket's problem shown")
        assert "log bucket" in problem[0] and bucket in problem[0]
        # kept in the spool (the last piece may reach the daemon just after the job ended)
        wait_for(lambda: spool(d, job["id"]).read_text().splitlines()[-1:] == ["out 10"], 15,
                 what="all the output in the spool")
        assert d.cli("logs", str(job["id"]), check=True).stdout.splitlines()[-1] == "out 10"
    finally:
        s3.start()
    wait_for(lambda: f"cluster-a/{job['id']}/0/0.log" in s3.keys(bucket), 40, what="the upload after")
    wait_for(lambda: not c.cluster()["problems"], 10, what="the problem cleared")
    assert wait_for(lambda: not spool(d, job["id"]).exists(), 10, what="the spool emptied")
    changes = log_problems(c)
    assert len(changes) == 2 and changes[0] and changes[1] == ""  # one event per change


def test_output_the_bucket_did_not_take_before_a_daemon_restart_is_shipped_after_it(s3, bucket_cluster):
    d, _, bucket = bucket_cluster
    c = d.client()
    s3.stop()
    try:
        job = c.submit({"command": ["sh", "-c", TICKS.format(n=5)]})
        completed(c, job["id"])
        wait_for(lambda: spool(d, job["id"]).with_suffix(".done").exists(), 20, what="the whole output")
        d.kill9()
    finally:
        s3.start()
    d.start()
    wait_for(lambda: f"cluster-a/{job['id']}/0/0.log" in s3.keys(bucket), 30, what="the upload after")
    wait_for(lambda: not spool(d, job["id"]).exists(), 10, what="the spool emptied")
    assert d.cli("logs", str(job["id"]), check=True).stdout.splitlines() == [f"out {i}" for i in range(1, 6)]


def test_the_bucket_credentials_never_appear_in_what_the_daemon_answers_or_logs(s3, bucket_cluster):
    d, _, _ = bucket_cluster
    c = d.client()
    job = c.submit({"command": ["sh", "-c", "echo hello"]})
    wait_job(c, job["id"], "COMPLETED", timeout=30)
    seen = [json.dumps(c.cluster()), json.dumps(c.events(limit=1000)), json.dumps(c.nodes()),
            json.dumps(c.job(job["id"])), d.cli("logs", str(job["id"]), "--json", check=True).stdout,
            (d.base / "daemon.log").read_text()]
    for text in seen:
        assert SECRET not in text and KEY_ID not in text


def test_a_daemon_with_a_credentials_file_others_can_read_refuses_to_start(tmp_path):
    creds = credentials_file(tmp_path, mode=0o644)
    config = tmp_path / "trainyard.toml"
    config.write_text(f'[logs]\nbucket = "s3://ops-logs"\ncredentials_file = "{creds}"\n')
    env = {**os.environ, "HOME": str(tmp_path), "TRAINYARD_HOME": str(tmp_path / "state"),
           "XDG_CONFIG_HOME": str(tmp_path / "cfg")}
    r = subprocess.run([PY, "-m", "scheduler.cli", "daemon", "--listen", f"127.0.0.1:{free_port()}",
                        "--config", str(config)], env=env, cwd=ROOT, capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2
    assert f"logs.credentials_file: '{creds}' is readable by others (mode 644); chmod 600 it" in r.stderr
    assert SECRET not in r.stderr + r.stdout


def test_a_credentials_file_without_the_secret_key_is_refused(tmp_path):
    (tmp_path / "bare").write_text("[default]\naws_access_key_id = x\n")
    (tmp_path / "bare").chmod(0o600)
    with pytest.raises(ValueError, match="with aws_access_key_id and aws_secret_access_key"):
        load_bucket_credentials(str(tmp_path / "bare"))


def test_bucket_settings_are_checked_with_the_key_the_value_and_what_to_write():
    def problems(logs: dict) -> list[str]:
        with pytest.raises(SettingsError) as e:
            Settings.from_toml({"logs": logs})
        return e.value.problems

    assert problems({"bucket": "https://logs.example.com"}) == [
        "logs.bucket: expected s3://BUCKET or s3://BUCKET/PREFIX (a bucket name of 3 to 63 lower case "
        "letters, digits, '.' and '-'), got 'https://logs.example.com'"]
    assert problems({"endpoint_url": "http://127.0.0.1:9000"}) == [
        'logs: endpoint_url set without logs.bucket; add bucket = "s3://BUCKET/PREFIX" or remove them']
    assert problems({"bucket": "s3://ops-logs", "region": "EU West"})[0].startswith(
        "logs.region: expected a region name such as eu-west-1")
    assert Settings.from_toml({"logs": {"bucket": "s3://ops-logs/trainyard/"}}).logs.bucket == \
        "s3://ops-logs/trainyard/"


# ------------------------------------------------------------------ the store and its bucket
@pytest.fixture
async def shipping(s3, tmp_path):
    """A LogStore that ships to prefix `p` of a fresh bucket; job 7 RUNNING on n1."""
    engine = make_engine(str(tmp_path / "t.db"))
    init_schema(engine)
    st = StateStore(engine, Clock())
    with st.tx() as s:
        s.add(Job(id=7, user="ann", state="RUNNING", attempt=0, allocation=[{"node": "n1", "gpus": [0]}]))
    name = s3.new_bucket()
    bucket = LogBucket(f"s3://{name}/p", s3.url, credentials={"aws_access_key_id": KEY_ID,
                                                              "aws_secret_access_key": SECRET})
    logs = LogStore(tmp_path / "logs", st, Sent(), Clock(), retention_days=1, bucket=bucket)
    logs.start()
    yield logs, name
    await logs.stop()


async def test_retention_removes_the_objects_in_the_bucket_too(s3, shipping):
    logs, name = shipping
    logs.on_output("n1", chunk("7.0", 0, b"kept a day\n", eof=True))
    await wait_async(lambda: s3.keys(name) == ["p/7/0/0.log", "p/7/0/nodes.json"], "shipped")
    # the shipper unlinks the local copy just after the upload returns, so the listing can
    # show the object a moment before the spool has let it go
    await wait_async(lambda: logs.read(7, 0, 0, 0, 100) is None, "the spool let it go")
    logs.expire(now=time.time() + 2 * 86400)
    await wait_async(lambda: s3.keys(name) == [], "the objects expired")


async def test_output_whose_node_left_with_the_job_is_shipped_once_the_job_ended_and_an_hour_passed(
        s3, shipping):
    logs, name = shipping
    logs.on_output("n1", chunk("7.0", 0, b"half a line and then the node was gone"))
    logs.expire(now=time.time() + 7200)
    assert not logs.shipper.pending  # the job still runs: its node may come back and send more
    with logs.store.tx() as s:
        s.get(Job, 7).state = "NODE_FAIL"
    logs.expire(now=time.time() + 600)
    assert not logs.shipper.pending  # written to ten minutes ago: the node may still send more
    logs.expire(now=time.time() + 7200)
    await wait_async(lambda: "p/7/0/0.log" in s3.keys(name), "the rank shipped")
    body = s3.client.get_object(Bucket=name, Key="p/7/0/0.log")["Body"].read()
    assert body == b"half a line and then the node was gone"


async def wait_async(pred, what: str, timeout: float = 15.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await asyncio.to_thread(pred):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


async def test_a_running_job_that_printed_nothing_yet_is_not_looked_for_in_the_bucket(s3, shipping):
    """An attempt's files come with its first output: until then the daemon knows it from the
    dispatch, and a reader (`trainyard logs --follow`, twice a second) is answered without a
    GET from the bucket for output that cannot have been shipped."""
    from scheduler.daemon import Caller
    from scheduler.daemon.logstore import JobLogs

    logs, name = shipping
    asked = []
    read, ranks = logs.bucket.read, logs.bucket.ranks
    logs.bucket.read = lambda *a: asked.append(("read", a)) or read(*a)
    logs.bucket.ranks = lambda *a: asked.append(("ranks", a)) or ranks(*a)
    logs.record_ranks(7, 0, ["n1"])
    reader = JobLogs(logs, logs.store, Sent())
    page = await reader.read(Caller("ann", "user"), 7, 0, 0, 1000)
    assert (page["data"], page["node"], page["source"]) == ("", "n1", "none")
    assert asked == []
    logs.on_output("n1", chunk("7.0", 0, b"now it prints\n"))
    page = await reader.read(Caller("ann", "user"), 7, 0, 0, 1000)
    assert (page["data"], page["source"]) == ("now it prints\n", "store") and asked == []
