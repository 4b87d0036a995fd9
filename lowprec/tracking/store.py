"""Opening an MLflow tracking store that other processes may be opening at the same moment.

    client = mlflow_client("sqlite:///mlflow.db")   # a MlflowClient whose store exists, schema and all

MLflow creates a new SQL store's tables the first time a process opens it
(`SqlAlchemyStore.__init__`: "Creating initial MLflow database tables..."), without a lock.
Two `lowprec run` started together against one new SQLite file both try, and the second
fails with `table ... already exists`. `mlflow_client` opens a SQLite store while holding an
exclusive lock (`fcntl.flock`) on `<database>.lock` beside the database file: the first
process creates the schema, the others wait for it and then find it made. The lock is held
only while the store is opened (a second or two the first time, milliseconds after that);
the lock file is left in place (removing it would race with a process about to take it).

A new SQLite store is created whole or not at all: MLflow builds its schema in a run of about
seventy migrations, not in one transaction, so a process killed (SIGKILL, an OOM kill, Ctrl-C
reaching a thread) in those seconds used to leave a database that no later run could open
(`table spans already exists`: the tables of a migration whose version was never recorded).
`mlflow_client` builds a new store's schema in a `<database>.creating-*` file beside it and renames that
file onto the database only once the schema is complete; a leftover `.creating-*` file from
a killed process is deleted by the next creator, who holds the lock. A store left half-made
before that (or by MLflow itself, or half-migrated by a newer MLflow) cannot be opened:
`HalfMadeStoreError` names it, says whether it holds runs and how to move it aside, instead
of MLflow's `table _alembic_tmp_params already exists` on every send.
Other stores (an HTTP server, PostgreSQL behind a server) are opened as they are: a server
creates its schema once, at its own start.
"""

from __future__ import annotations

import contextlib
import os
import time
import uuid
from pathlib import Path
from typing import Iterator

__all__ = ["mlflow_client", "schema_lock", "sqlite_path", "HalfMadeStoreError", "LOCK_SUFFIX", "CREATING_SUFFIX"]

LOCK_SUFFIX = ".lock"
CREATING_SUFFIX = ".creating"


def sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a `sqlite:///` tracking URI (None for other stores and `:memory:`)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    path = tracking_uri[len("sqlite:///"):].split("?", 1)[0]
    return None if not path or path == ":memory:" else Path(path)


@contextlib.contextmanager
def schema_lock(tracking_uri: str, timeout_s: float = 120.0) -> Iterator[None]:
    """Hold the exclusive lock on a SQLite store's `<database>.lock` (nothing for other stores,
    or where `fcntl` does not exist); TimeoutError after `timeout_s` seconds of waiting."""
    db = sqlite_path(tracking_uri)
    try:
        import fcntl
    except ImportError:   # not POSIX: no lock (MLflow's own behaviour)
        fcntl = None
    if db is None or fcntl is None:
        yield
        return
    db.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(str(db) + LOCK_SUFFIX, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline, wait = time.monotonic() + timeout_s, 0.01
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{db}{LOCK_SUFFIX} stayed locked for {timeout_s:.0f} s: another process "
                                       f"is creating or opening the store {tracking_uri}") from None
                time.sleep(wait)
                wait = min(2 * wait, 0.25)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def mlflow_client(tracking_uri: str):
    """A `MlflowClient` for `tracking_uri`, its store opened (a new SQLite store created) under
    `schema_lock`, so that any number of processes may do this at once."""
    from mlflow.tracking import MlflowClient
    with schema_lock(tracking_uri):
        db = sqlite_path(tracking_uri)
        if db is not None and not db.exists():
            _create_sqlite_store(db)
        try:
            client = MlflowClient(tracking_uri)   # opens the store: creates or migrates a SQL store's tables
        except Exception as e:
            if db is not None and "already exists" in str(e):
                raise HalfMadeStoreError(db, e) from None
            raise
    return client


class HalfMadeStoreError(ValueError):
    """A SQLite store whose schema a killed process left half-made (created by a lowprec before
    the whole-or-nothing creation above, or by MLflow itself, or half-migrated by a newer
    MLflow): MLflow can neither finish nor open it. Says what it holds and what to do."""

    def __init__(self, db: Path, error: BaseException):
        import sqlite3
        self.error = error   # MLflow's (SQL) error
        try:
            with contextlib.closing(sqlite3.connect(f"file:{db}?mode=ro", uri=True)) as con:
                runs = con.execute("SELECT COUNT(*) FROM runs").fetchone()[0]
        except sqlite3.Error:
            runs = 0
        aside = f"mv {db} {db}.half-made"
        holds = (f"it holds no run: move it aside ({aside}); the next use makes a new one" if not runs else
                 f"it holds {runs} runs: restore it from a backup, or move it aside ({aside}) for a new one")
        super().__init__(f"{db} is a half-made MLflow store (a process was killed while MLflow built or migrated "
                         f"its tables; MLflow cannot open it): {holds}")


def _create_sqlite_store(db: Path) -> None:
    """Create MLflow's schema in a new SQLite file at `db` all at once (see the module doc): built
    in `<db>.creating-<random>` (a name MLflow has not cached a store for), its connections
    closed, then renamed onto `db`. Called under `schema_lock`."""
    from mlflow.tracking import MlflowClient
    for leftover in db.parent.glob(db.name + CREATING_SUFFIX + "*"):   # creators killed before their rename
        leftover.unlink(missing_ok=True)
    building = db.with_name(f"{db.name}{CREATING_SUFFIX}-{uuid.uuid4().hex}")
    client = MlflowClient(f"sqlite:///{building}")   # creates every table, one migration after another
    engine = getattr(getattr(getattr(client, "_tracking_client", None), "store", None), "engine", None)
    if engine is not None:   # no pooled connection left open on the file that becomes the store
        engine.dispose()
    os.replace(building, db)
