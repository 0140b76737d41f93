"""One leader (DESIGN.md boundary 7): a PostgreSQL advisory lock elects it, an epoch fences it.

- SQLite: one daemon per database file, held by an exclusive lock on `<db>.lock`; a second one
  is refused with the reason and what to use instead.
- PostgreSQL: every daemon campaigns for a session-level advisory lock on a connection of its
  own. The holder leads; the others stand by (they serve reads and point writers to the
  leader). PostgreSQL releases the lock when the holder's session ends, so a leader killed with
  -9 is replaced within a poll interval.
- Split brain is impossible by construction: each new leader increments `leader_epoch` in the
  database when it takes office, and every write transaction of a leader reads the epoch FOR
  SHARE and aborts unless it is still its own. A deposed leader therefore cannot commit, and
  since nothing is sent to a node before its state change commits (write-ahead), it cannot act on
  a node for a new decision either. It steps down as soon as it notices.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from collections.abc import Awaitable, Callable
from pathlib import Path

from sqlalchemy import text
from sqlalchemy.engine import Connection, Engine

from .errors import NotLeader

log = logging.getLogger("trainyard.daemon")

LOCK_KEY = 0x7472_6169_6E79  # "trainy": the advisory lock every trainyard daemon campaigns for
POLL_S = 1.0


class AlreadyServed(RuntimeError):
    """Another daemon serves this SQLite database."""


class Leadership:
    def __init__(self, engine: Engine, db_url: str, url: Callable[[], str]):
        self.engine = engine
        self.postgres = engine.dialect.name == "postgresql"
        self.db_url = db_url
        self.url = url
        self.role = "standby" if self.postgres else "leader"
        self.reason = "campaigning for the leader lock" if self.postgres else ""
        self.epoch = 0
        self._in_office = False  # elected() ran and deposed() has not yet
        self._lock_conn: Connection | None = None
        self._lock_file = None

    # ---------------------------------------------------------------- SQLite
    def claim_sqlite(self, db_path: Path) -> None:
        """Hold `<db>.lock` for this process's life; refuse a second daemon on the same file."""
        lock_path = db_path.with_name(db_path.name + ".lock")
        f = open(lock_path, "a+")  # noqa: SIM115 - held open on purpose
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            f.seek(0)
            holder = f.read().strip() or "unknown"
            f.close()
            raise AlreadyServed(
                f"another trainyard daemon ({holder}) already serves the SQLite database {db_path}; "
                "SQLite allows one daemon. For a standby that takes over, run both daemons on "
                "PostgreSQL: --db postgresql://USER@HOST/DB") from None
        f.seek(0)
        f.truncate()
        f.write(f"pid {os.getpid()}\n")
        f.flush()
        self._lock_file = f

    # ---------------------------------------------------------------- PostgreSQL
    @property
    def leading(self) -> bool:
        return self.role == "leader"

    def leader(self) -> dict:
        """What the database says of the current leader: url, pid, epoch."""
        try:
            with self.engine.connect() as c:
                rows = dict(c.execute(text("SELECT key, value FROM meta WHERE key IN "
                                           "('leader_url', 'leader_epoch', 'leader_pid')")).all())
        except Exception as e:  # noqa: BLE001 - the database is the thing that failed; say so
            return {"url": None, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
        return {"url": rows.get("leader_url"), "epoch": int(rows.get("leader_epoch") or 0),
                "pid": rows.get("leader_pid")}

    def _try_lock(self) -> bool:
        if self._lock_conn is None:
            self._lock_conn = self.engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        return bool(self._lock_conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": LOCK_KEY}).scalar())

    def _lock_alive(self) -> bool:
        try:
            assert self._lock_conn is not None
            self._lock_conn.execute(text("SELECT 1"))
            return True
        except Exception:  # noqa: BLE001
            return False

    def _drop_lock_conn(self) -> None:
        if self._lock_conn is not None:
            with contextlib.suppress(Exception):
                self._lock_conn.invalidate()
                self._lock_conn.close()
            self._lock_conn = None

    def _take_office(self) -> None:
        """A new epoch fences every earlier leader's writes; the database tells clients who leads."""
        with self.engine.begin() as c:
            row = c.execute(text("SELECT value FROM meta WHERE key = 'leader_epoch' FOR UPDATE")).scalar()
            self.epoch = int(row or 0) + 1
            for key, value in (("leader_epoch", str(self.epoch)), ("leader_url", self.url()),
                               ("leader_pid", f"{os.uname().nodename}:{os.getpid()}")):
                updated = c.execute(text("UPDATE meta SET value = :v WHERE key = :k"), {"k": key, "v": value})
                if updated.rowcount == 0:
                    c.execute(text("INSERT INTO meta (key, value) VALUES (:k, :v)"), {"k": key, "v": value})

    def fence(self, conn: Connection) -> None:
        """Inside a write transaction: abort unless this daemon still leads (PostgreSQL only)."""
        if not self.postgres:
            return
        if not self.leading:
            raise NotLeader(self.not_leader_message())
        row = conn.execute(text("SELECT value FROM meta WHERE key = 'leader_epoch' FOR SHARE")).scalar()
        if int(row or 0) != self.epoch:
            self.role, self.reason = "standby", f"deposed: epoch {row} is not ours ({self.epoch})"
            raise NotLeader(self.not_leader_message())

    def not_leader_message(self) -> str:
        url = self.leader().get("url")
        where = f"the leader is at {url}" if url and url != self.url() else "no leader is elected yet"
        return f"this daemon stands by ({self.reason}); {where}: retry there"

    async def campaign(self, elected: Callable[[], Awaitable[None]],
                       deposed: Callable[[str], Awaitable[None]], running: Callable[[], bool]) -> None:
        """Stand by until the lock is ours; lead while it stays ours; step down when it is lost.

        A leader steps down in two ways: its lock's connection dies, or a write finds the epoch
        moved on (`fence`). Either way it leaves office (`deposed`) before it campaigns again, and
        it gives up the lock, so a leader is never elected twice over one office's loops."""
        while running():
            if self._in_office and not self.leading:  # the fence found this daemon deposed
                self._in_office = False
                self._drop_lock_conn()
                log.warning("stepping down: %s", self.reason)
                await deposed(self.reason)
            elif not self.leading:
                try:
                    got = await asyncio.to_thread(self._try_lock)
                except Exception as e:  # noqa: BLE001 - a standby that loses the database says why
                    self._drop_lock_conn()
                    self.reason = f"cannot reach the database: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
                    got = False
                if got:
                    try:
                        await asyncio.to_thread(self._take_office)
                    except Exception as e:  # noqa: BLE001
                        self._drop_lock_conn()
                        self.reason = f"could not take office: {e}"
                    else:
                        self.role, self.reason = "leader", ""
                        self._in_office = True
                        log.info("leading (epoch %d)", self.epoch)
                        await elected()
                elif self._lock_conn is not None:
                    self.reason = "another daemon holds the leader lock"
            elif not await asyncio.to_thread(self._lock_alive):
                self.role, self.reason = "standby", "lost the database connection that holds the leader lock"
                self._in_office = False
                self._drop_lock_conn()
                log.warning("stepping down: %s", self.reason)
                await deposed(self.reason)
            await asyncio.sleep(POLL_S)

    def close(self) -> None:
        self._drop_lock_conn()
        if self._lock_file is not None:
            self._lock_file.close()
            self._lock_file = None
