"""SQLite state of the leader: fellow records and the job queue survive a restart.

Writes are small and local, so they run inline on the event loop; WAL keeps readers unblocked.
``synchronous=FULL``: each commit (a job transition, a step's record) fsyncs the WAL before it
returns, so what the leader has answered survives a power loss, not only a crash; under WAL
that is one fsync per commit (``NORMAL`` would defer it to the next checkpoint).

A write that fails (a full disk, an I/O error) raises :class:`StoreWriteError` with nothing of
it committed; the caller puts its memory back as the store holds it (``leader/undo.py``).
A record with an integer outside int64 is refused before it is written: SQLite cannot hold
one as a key, and the leader could not read its own row back (``schema``'s int64 rule).
"""

from __future__ import annotations

import contextlib
import errno
import sqlite3
from collections.abc import Iterator
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


class StoreWriteError(StoreError):
    """A write the store did not commit. ``transient``: the disk or the database refused it
    (full, an I/O error), and the same write may succeed later; else the record itself could
    not be stored."""

    def __init__(self, message: str, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


INT64 = (-(2**63), 2**63 - 1)
# Every integer of fewer than 19 digits is an int64, and orjson writes no float with 19 digits
# in a row: a blob without 19 digits in a row needs no closer look (most saves: a step's).
_DIGITS = bytes.maketrans(b"012345678", b"999999999")
_LONG = b"9" * 19


def ints_fit(value: Any) -> bool:
    """Whether every integer in ``value`` (JSON-like) is an int64."""
    if isinstance(value, int):
        return INT64[0] <= value <= INT64[1]
    if isinstance(value, dict):
        return all(ints_fit(v) for v in value.values())
    if isinstance(value, list | tuple):
        return all(ints_fit(v) for v in value)
    return True


def _first_misfit(value: Any, path: str) -> str:
    """Where ``ints_fit`` failed."""
    items = value.items() if isinstance(value, dict) else \
        enumerate(value) if isinstance(value, list | tuple) else ()
    for key, v in items:
        if not ints_fit(v):
            return _first_misfit(v, f"{path}.{key}" if isinstance(value, dict)
                                 else f"{path}[{key}]")
    return path


def _blob(what: str, record: Any) -> bytes:
    """``record`` as stored, or a StoreWriteError if an integer in it is outside int64: SQLite
    holds no larger key, and a leader could not read the row back (schema's int64 rule made
    such a job vanish from GET /jobs after a restart)."""
    blob: bytes | None = None
    try:
        blob = jsonio.dumps(record)
    except TypeError:  # (orjson: an integer past 64 bits; else not an integer's doing)
        if ints_fit(record):
            raise
    if (blob is None or _LONG in blob.translate(_DIGITS)) and not ints_fit(record):
        raise StoreWriteError(f"{what}: {_first_misfit(record, '$')} is an integer outside "
                              "int64", transient=False)
    assert blob is not None
    return blob


class Store:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._batched = False  # inside batch(): writes join its transaction
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
        rows = [(r["fellow_id"], r["name"], _blob(f"fellow {r['fellow_id']}", r))
                for r in records]
        with self._tx():
            self._db.executemany(
                "INSERT INTO fellows (fellow_id, name, data) VALUES (?, ?, ?) "
                "ON CONFLICT(fellow_id) DO UPDATE SET name=excluded.name, data=excluded.data",
                rows,
            )

    def forget_fellow(self, fellow_id: int) -> None:
        """Delete a fellow's record; its id is never given again (the jobs that name it
        keep meaning it): the next id stays above it."""
        with self._tx():
            self._db.execute("DELETE FROM fellows WHERE fellow_id=?", (fellow_id,))
            self._db.execute(
                "INSERT INTO meta (key, value) VALUES ('next_fellow_id', ?) "
                "ON CONFLICT(key) DO UPDATE SET value=max(CAST(value AS INTEGER), "
                "CAST(excluded.value AS INTEGER))", (str(fellow_id + 1),))

    def next_fellow_id(self) -> int:
        """The least id a new fellow may have (above every forgotten one)."""
        row = self._db.execute("SELECT value FROM meta WHERE key='next_fellow_id'").fetchone()
        return 0 if row is None else int(row[0])

    # jobs ------------------------------------------------------------------------------------
    def next_job_seq(self) -> int:
        row = self._db.execute("SELECT seq FROM sqlite_sequence WHERE name='jobs'").fetchone()
        return (row[0] if row else 0) + 1

    def load_jobs(self) -> list[dict[str, Any]]:
        rows = self._db.execute("SELECT data FROM jobs ORDER BY seq").fetchall()
        return [jsonio.loads(r[0]) for r in rows]

    def insert_job(self, seq: int, record: dict[str, Any]) -> None:
        blob = _blob(f"job {record['job_id']}", record)
        with self._tx():
            self._db.execute(
                "INSERT INTO jobs (seq, job_id, state, data) VALUES (?, ?, ?, ?)",
                (seq, record["job_id"], record["state"], blob),
            )

    def save_job(self, record: dict[str, Any]) -> None:
        blob = _blob(f"job {record['job_id']}", record)
        with self._tx():
            self._db.execute(
                "UPDATE jobs SET state=?, data=? WHERE job_id=?",
                (record["state"], blob, record["job_id"]),
            )

    # per-step progress ----------------------------------------------------------------------
    def put_progress(self, job_id: str, step: int, record: dict[str, Any]) -> None:
        what = f"job {job_id}'s record of step {step}"
        if not ints_fit(step):
            raise StoreWriteError(f"{what}: the step is outside int64", transient=False)
        blob = _blob(what, record)
        with self._tx():
            self._db.execute(
                "INSERT INTO progress (job_id, step, data) VALUES (?, ?, ?) "
                "ON CONFLICT(job_id, step) DO UPDATE SET data=excluded.data",
                (job_id, step, blob),
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

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Several writes as one transaction (one commit, one fsync: a fellow's reports of
        many steps at once): each write's own transaction joins it, and all of them are
        committed together or none is (StoreWriteError, as for one)."""
        if self._batched:
            yield
            return
        with self._tx():
            self._batched = True
            try:
                yield
            finally:
                self._batched = False

    @contextlib.contextmanager
    def _tx(self) -> Iterator[None]:
        """One transaction: committed, or (whatever failed in it, the COMMIT too) rolled
        back and a StoreWriteError raised for what the disk or database refused. Inside
        :meth:`batch`, part of the batch's."""
        if self._batched:
            yield
            return
        try:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                yield
                self._db.execute("COMMIT")
            except BaseException:
                if self._db.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        self._db.execute("ROLLBACK")
                raise
        except (sqlite3.Error, OSError) as exc:
            # (full, locked, an I/O error: the same write may go through later; a constraint
            # or a damaged file will not)
            transient = isinstance(exc, sqlite3.OperationalError | OSError)
            raise StoreWriteError(f"{self.path.name}: {_why(exc)}", transient) from exc


def _why(exc: BaseException) -> str:
    if (isinstance(exc, OSError) and exc.errno == errno.ENOSPC) or \
            getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL:
        return "the disk is full"
    return str(exc) or type(exc).__name__
