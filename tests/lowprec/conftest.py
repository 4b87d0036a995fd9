"""MLflow fixtures of the tracking and report tests.

Creating a migrated SQLite store and starting `mlflow server` take 10-25 s each; both
start in the background when the first module that uses `mlflow_services` starts
(test_report.py, through its `pytestmark`), so that they warm up while tests run.
`postgres` and `mlflow_postgres` (test_tracking_postgres.py): a private PostgreSQL cluster
and an `mlflow server` backed by it, skipped with the reason where PostgreSQL is missing.
"""

from __future__ import annotations

import pytest

from postgres_helpers import PostgresCluster, missing
from tracking_helpers import MlflowServer, SqliteTemplate


@pytest.fixture(scope="session")
def mlflow_template(tmp_path_factory):
    """An empty SQLite store with MLflow's tables, being created in the background."""
    template = SqliteTemplate(tmp_path_factory.mktemp("mlflow-template"))
    yield template
    template.close()


@pytest.fixture(scope="session")
def mlflow_services(tmp_path_factory, mlflow_template, free_port):
    """One `mlflow server` for the session, started without waiting (and the SQLite
    template); tests call `.wait()` on the server before using it."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-server"), free_port())
    server.start(wait=False)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def sqlite_store(mlflow_template):
    """`sqlite_store(dir)`: the URI of a new, migrated SQLite store in `dir` (a copy of the template)."""
    return mlflow_template.copy_to


@pytest.fixture(scope="session")
def postgres(free_port):
    """A private PostgreSQL cluster on 127.0.0.1 (initdb into a temporary folder, one
    database); skips with the reason where PostgreSQL or psycopg2 is not installed."""
    why = missing()
    if why:
        pytest.skip(why)
    cluster = PostgresCluster(free_port())
    try:
        yield cluster.start()
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def mlflow_postgres(tmp_path_factory, postgres, free_port):
    """An `mlflow server` on 127.0.0.1 whose backend store is the `postgres` cluster."""
    server = MlflowServer(tmp_path_factory.mktemp("mlflow-postgres"), free_port(), backend_store_uri=postgres.uri())
    server.start(timeout=120)
    yield server
    server.stop()
