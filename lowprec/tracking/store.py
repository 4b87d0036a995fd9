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
Other stores (an HTTP server, PostgreSQL behind a server) are opened as they are: a server
creates its schema once, at its own start.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Iterator

__all__ = ["mlflow_client", "schema_lock", "sqlite_path", "LOCK_SUFFIX"]

LOCK_SUFFIX = ".lock"


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
        client = MlflowClient(tracking_uri)   # opens the store: creates or migrates a SQL store's tables
    return client
