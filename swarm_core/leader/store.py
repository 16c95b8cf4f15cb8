"""SQLite state of the leader: fellow records and the job queue survive a restart.

Writes are small and local, so they run inline on the event loop; WAL keeps readers unblocked.
``synchronous=FULL``: each commit (a job transition, a step's record) fsyncs the WAL before it
returns, so what the leader has answered survives a power loss, not only a crash; under WAL
that is one fsync per commit (``NORMAL`` would defer it to the next checkpoint).
"""

from __future__ import annotations

import sqlite3
from pathlib import Path
from typing import Any

from swarm_core import jsonio

SCHEMA_VERSION = 1

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS fellows (
    fellow_id INTEGER PRIMARY KEY,
    name TEXT NOT NULL UNIQUE,
    data BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS progress (
    job_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    data BLOB NOT NULL,
    PRIMARY KEY (job_id, step)
);
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL UNIQUE,
    state TEXT NOT NULL,
    data BLOB NOT NULL
);
"""


class StoreError(RuntimeError):
    pass


class Store:
    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        except sqlite3.DatabaseError as exc:  # (a directory, unreadable…)
            raise StoreError(f"{path}: cannot open the leader's state: {exc}") from None
        try:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(_SCHEMA)
        except sqlite3.DatabaseError as exc:  # (not a database, locked, unwritable…)
            self._db.close()
            raise StoreError(f"{path}: cannot open the leader's state: {exc}") from None
        row = self._db.execute("SELECT value FROM meta WHERE key='schema'").fetchone()
        if row is None:
            self._db.execute("INSERT INTO meta VALUES ('schema', ?)", (str(SCHEMA_VERSION),))
        elif int(row[0]) > SCHEMA_VERSION:
            raise StoreError(
                f"{path} was written by a newer leader (schema {row[0]} > {SCHEMA_VERSION})"
            )

    def close(self) -> None:
        self._db.close()

    # fellows ---------------------------------------------------------------------------------
    def load_fellows(self) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT data FROM fellows ORDER BY fellow_id").fetchall()
        return [jsonio.loads(r[0]) for r in rows]

    def save_fellows(self, records: list[dict[str, Any]]) -> None:
        if not records:
            return
        with self._tx():
            self._db.executemany(
                "INSERT INTO fellows (fellow_id, name, data) VALUES (?, ?, ?) "
                "ON CONFLICT(fellow_id) DO UPDATE SET name=excluded.name, data=excluded.data",
                [(r["fellow_id"], r["name"], jsonio.dumps(r)) for r in records],
            )

    # jobs ------------------------------------------------------------------------------------
    def next_job_seq(self) -> int:
        row = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name='jobs'").fetchone()
        return (row[0] if row else 0) + 1

    def load_jobs(self) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT data FROM jobs ORDER BY seq").fetchall()
        return [jsonio.loads(r[0]) for r in rows]

    def insert_job(self, seq: int, record: dict[str, Any]) -> None:
        with self._tx():
            self._db.execute(
                "INSERT INTO jobs (seq, job_id, state, data) VALUES (?, ?, ?, ?)",
                (seq, record["job_id"], record["state"], jsonio.dumps(record)),
            )

    def save_job(self, record: dict[str, Any]) -> None:
        with self._tx():
            self._db.execute(
                "UPDATE jobs SET state=?, data=? WHERE job_id=?",
                (record["state"], jsonio.dumps(record), record["job_id"]),
            )

    # per-step progress ----------------------------------------------------------------------
    def put_progress(self, job_id: str, step: int, record: dict[str, Any]) -> None:
        with self._tx():
            self._db.execute(
                "INSERT INTO progress (job_id, step, data) VALUES (?, ?, ?) "
                "ON CONFLICT(job_id, step) DO UPDATE SET data=excluded.data",
                (job_id, step, jsonio.dumps(record)),
            )

    def progress_record(self, job_id: str, step: int) -> dict[str, Any] | None:
        row = self._db.execute("SELECT data FROM progress WHERE job_id=? AND step=?",
                               (job_id, step)).fetchone()
        return None if row is None else jsonio.loads(row[0])

    def delete_progress_after(self, job_id: str, step: int) -> None:
        with self._tx():
            self._db.execute("DELETE FROM progress WHERE job_id=? AND step>?", (job_id, step))

    def progress(self, job_id: str, after: int = 0, limit: int = 100_000) -> list[dict[str, Any]]:
        rows = self._db.execute(
            "SELECT data FROM progress WHERE job_id=? AND step>? ORDER BY step LIMIT ?",
            (job_id, after, limit),
        ).fetchall()
        return [jsonio.loads(r[0]) for r in rows]

    def _tx(self) -> _Tx:
        return _Tx(self._db)


class _Tx:
    def __init__(self, db: sqlite3.Connection) -> None:
        self.db = db

    def __enter__(self) -> None:
        self.db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type: object, *_: object) -> None:
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")
