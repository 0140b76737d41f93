"""The database: engine, sessions and the schema version (SQLite with WAL, or PostgreSQL)."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import orjson
from sqlalchemy import event, inspect, text
from sqlalchemy.engine import Connection, CursorResult, Engine
from sqlalchemy.schema import CreateIndex
from sqlmodel import Session, SQLModel, create_engine, select

from .models import SCHEMA_VERSION, Meta

log = logging.getLogger("trainyard.store")


def add_missing_columns(conn: Connection) -> None:
    """Add the columns a newer model declares to an older table, with the model's default."""
    insp = inspect(conn)
    models = {m.local_table.name: m.class_ for m in SQLModel._sa_registry.mappers}
    for table in SQLModel.metadata.sorted_tables:
        if not insp.has_table(table.name):
            continue
        have = {c["name"] for c in insp.get_columns(table.name)}
        for col in table.columns:
            if col.name in have:
                continue
            ddl = col.type.compile(dialect=conn.dialect)
            default = col.default.arg if col.default is not None and not callable(col.default.arg) else None
            if default is None and "JSON" in ddl.upper():
                field = getattr(models.get(table.name), "model_fields", {}).get(col.name)
                default = "[]" if field is not None and field.default_factory is list else "{}"
            clause = ""
            if isinstance(default, bool):
                clause = f" DEFAULT {'true' if default else 'false'}"
            elif isinstance(default, int | float):
                clause = f" DEFAULT {default}"
            elif isinstance(default, str):
                clause = " DEFAULT '" + default.replace("'", "''") + "'"
            conn.execute(text(f'ALTER TABLE "{table.name}" ADD COLUMN "{col.name}" {ddl}{clause}'))


def add_missing_indexes(conn: Connection) -> None:
    """Create the indexes a newer model declares on an older table (`create_all` makes only
    whole tables). On a table of millions of jobs that takes seconds, once, at the first start of
    the version that declares it (on PostgreSQL, holding other writers to that table meanwhile)."""
    insp = inspect(conn)
    for table in SQLModel.metadata.sorted_tables:
        if not insp.has_table(table.name):
            continue
        have = {ix["name"] for ix in insp.get_indexes(table.name)}
        for index in sorted(table.indexes, key=lambda ix: ix.name or ""):
            if index.name not in have:  # IF NOT EXISTS: a second daemon may be starting too
                log.info("creating the index %s on %s", index.name, table.name)
                conn.execute(CreateIndex(index, if_not_exists=True))


def _v1_to_v2(conn: Connection) -> None:
    """Slurm's words: HELD becomes PENDING/JobHeldUser, STARTING becomes CONFIGURING."""
    add_missing_columns(conn)
    conn.execute(text("UPDATE job SET state = 'PENDING', reason = 'JobHeldUser', held = 'user' "
                      "WHERE state = 'HELD'"))
    conn.execute(text("UPDATE job SET state = 'CONFIGURING' WHERE state = 'STARTING'"))


# Migrations from version N to N+1, applied in order at start-up. Each is a function of a
# connection; add one here (and bump SCHEMA_VERSION) whenever a table changes shape.
MIGRATIONS: dict[int, object] = {1: _v1_to_v2}


class SchemaError(RuntimeError):
    pass


def normalise_url(db: str) -> str:
    """Accept a path or a URL; postgresql:// URLs use psycopg 3."""
    if "://" not in db:
        return f"sqlite:///{Path(db).expanduser().resolve()}"
    if db.startswith(("postgresql://", "postgres://")):
        return "postgresql+psycopg://" + db.split("://", 1)[1]
    return db


def json_column(text_: str | bytes):
    """A JSON column's value: orjson reads a listing's thousands of small documents several times
    faster than `json`, which stays the fallback for the NaN that `json` may have written."""
    try:
        return orjson.loads(text_)
    except orjson.JSONDecodeError:
        return json.loads(text_)


def json_text(value) -> str:
    """A JSON column's text: orjson writes a job's ten small documents (and each event's detail)
    several times faster than `json`, which stays the fallback for what orjson refuses (keys that
    are not strings, integers past 64 bits). NaN and infinity are written as null, as JSON has no
    such numbers (`json` wrote them as the non-JSON NaN and Infinity, which json_column still reads)."""
    try:
        return orjson.dumps(value).decode()
    except TypeError:
        return json.dumps(value)


def row_objects(result: CursorResult) -> list[SimpleNamespace]:
    """A result's rows as attribute objects, without an ORM object or a key view per row."""
    keys = tuple(result.keys())
    return [SimpleNamespace(**dict(zip(keys, r, strict=True))) for r in result]


def make_engine(db: str) -> Engine:
    url = normalise_url(db)
    if url.startswith("sqlite"):
        engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30},
                               json_serializer=json_text, json_deserializer=json_column)

        @event.listens_for(engine, "connect")
        def _pragmas(dbapi_conn, _record):
            cur = dbapi_conn.cursor()
            cur.execute("PRAGMA journal_mode=WAL")
            cur.execute("PRAGMA synchronous=NORMAL")  # durable across process crashes in WAL mode
            cur.execute("PRAGMA busy_timeout=30000")
            cur.close()

        return engine
    return create_engine(url, pool_pre_ping=True, pool_size=5, max_overflow=5,
                         json_serializer=json_text, json_deserializer=json_column)


def init_schema(engine: Engine) -> int:
    """Create the tables on a new database, migrate an old one; refuse a newer one."""
    SQLModel.metadata.create_all(engine)
    with Session(engine) as session:
        row = session.exec(select(Meta).where(Meta.key == "schema_version")).first()
        if row is None:
            session.add(Meta(key="schema_version", value=str(SCHEMA_VERSION)))
            session.commit()
            return SCHEMA_VERSION
        version = int(row.value)
        if version > SCHEMA_VERSION:
            raise SchemaError(
                f"database schema version {version} is newer than this trainyard "
                f"({SCHEMA_VERSION}); upgrade trainyard or point --db at another database"
            )
        while version < SCHEMA_VERSION:
            MIGRATIONS[version](session.connection())  # type: ignore[operator]
            version += 1
        # columns added within a version (nullable or with a default) need no migration of their
        # own, nor do indexes
        add_missing_columns(session.connection())
        add_missing_indexes(session.connection())
        row.value = str(version)
        session.add(row)
        session.commit()
        return version
