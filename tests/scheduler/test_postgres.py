"""The same daemon on PostgreSQL: schema, jobs on a real node, state kept across a restart."""

import pytest
from sqlalchemy import text

from scheduler.models import SCHEMA_VERSION
from scheduler.store import SchemaError, init_schema, make_engine
from tests.conftest import add_sshd_node, fresh_pg_db, wait_job


def test_schema_version_is_recorded_and_a_newer_one_refused(postgres_url):
    url = fresh_pg_db(postgres_url, "ty_schema")
    engine = make_engine(url)
    assert init_schema(engine) == SCHEMA_VERSION
    assert init_schema(engine) == SCHEMA_VERSION  # idempotent
    with engine.begin() as conn:
        conn.execute(text("update meta set value = '999' where key = 'schema_version'"))
    with pytest.raises(SchemaError, match="newer than this trainyard"):
        init_schema(engine)
    engine.dispose()


def test_sqlite_schema_version_too(tmp_path):
    engine = make_engine(str(tmp_path / "t.db"))
    assert init_schema(engine) == SCHEMA_VERSION
    with engine.begin() as conn:
        assert conn.execute(text("pragma journal_mode")).scalar() == "wal"


def test_daemon_on_postgres_runs_jobs_and_survives_restart(postgres_url, daemon_factory, sshd_factory):
    url = fresh_pg_db(postgres_url, "ty_daemon")
    d = daemon_factory(db=url)
    node = sshd_factory("p1", d.public_key)
    add_sshd_node(d, node)
    c = d.client()
    job = c.submit({"command": ["sh", "-c", "echo on-postgres"], "gpus": 2})
    wait_job(c, job["id"], "COMPLETED")
    held = c.submit({"command": ["true"], "hold": True})
    d.stop()
    d.start()
    c = d.client()
    assert c.job(job["id"])["state"] == "COMPLETED"
    assert (c.job(held["id"])["state"], c.job(held["id"])["reason"]) == ("PENDING", "JobHeldUser")
    c.release(held["id"])
    wait_job(c, held["id"], "COMPLETED", timeout=30)
    assert c.log(job["id"])[0] == "on-postgres\n"
