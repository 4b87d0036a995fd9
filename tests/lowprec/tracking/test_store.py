"""lowprec.tracking.store: a new SQLite store is created whole or not at all.

MLflow creates a new SQLite store's schema in about seventy migrations, not in one transaction;
a process killed in those seconds left a database no later run could open (`table spans already
exists`; seen when a 4-rank job was killed during its first start-up, and its `--resume` failed).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from lowprec.tracking.store import CREATING_SUFFIX, mlflow_client

CREATE = """
import sys
from lowprec.tracking.store import mlflow_client
print("opening", flush=True)
mlflow_client(sys.argv[1])
print("created", flush=True)
"""


def _files(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if p.name.startswith("mlflow.db") and not p.name.endswith(".lock")]


@pytest.mark.slow
def test_a_process_killed_while_creating_the_store_leaves_none_or_a_whole_one(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    proc = subprocess.Popen([sys.executable, "-c", CREATE, uri], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "opening"
        deadline = time.monotonic() + 60
        while not any(p.stat().st_size for p in _files(tmp_path)):   # MLflow has begun writing tables
            assert proc.poll() is None and time.monotonic() < deadline, "the store was never created"
            time.sleep(0.01)
        time.sleep(0.2)   # in the middle of the migrations (they take seconds)
        assert proc.poll() is None, "the creation ended before the kill: nothing tested"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
    db = tmp_path / "mlflow.db"
    assert not db.exists(), "a killed creator left a database behind (a half-made schema)"
    # the next process creates it, removing the killed one's half-built file
    client = mlflow_client(uri)
    exp = client.create_experiment("after-a-kill")
    client.create_run(exp)
    assert [p.name for p in _files(tmp_path)] == ["mlflow.db"]


def test_an_existing_store_is_opened_where_it_is(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    first = mlflow_client(uri)
    exp = first.create_experiment("kept")
    inode = (tmp_path / "mlflow.db").stat().st_ino
    again = mlflow_client(uri)   # opened, not re-created: the experiment is there and the file the same
    assert again.get_experiment_by_name("kept").experiment_id == exp
    assert (tmp_path / "mlflow.db").stat().st_ino == inode
    assert not list(tmp_path.glob("mlflow.db" + CREATING_SUFFIX + "*"))


def test_a_half_made_store_is_named_with_what_it_holds_and_what_to_do(tmp_path):
    """A store half-made before lowprec created stores whole (or by MLflow itself): every send failed
    with MLflow's `table _alembic_tmp_params already exists`, and `lowprec sync` could never succeed.
    The file here is that state as a SIGKILL inside MLflow's batch migration of `params` left it
    (seen by killing a bare `MlflowClient(uri)` mid-creation; where a kill lands decides whether
    MLflow can go on, so the state is built directly). Now the error names the file, says it holds
    no run and how to move it aside (a new store is then made, as
    test_a_process_killed_while_creating_the_store_leaves_none_or_a_whole_one shows)."""
    import sqlite3

    from lowprec.tracking.store import HalfMadeStoreError
    db = tmp_path / "mlflow.db"
    with contextlib.closing(sqlite3.connect(db)) as con:
        con.execute("CREATE TABLE _alembic_tmp_params (x INTEGER)")
        con.commit()
    uri = f"sqlite:///{db}"
    with pytest.raises(HalfMadeStoreError) as e:
        mlflow_client(uri)
    assert str(e.value) == (f"{db} is a half-made MLflow store (a process was killed while MLflow built or migrated "
                            f"its tables; MLflow cannot open it): it holds no run: move it aside (mv {db} "
                            f"{db}.half-made); the next use makes a new one")
    assert db.is_file()   # not removed: the user decides (MLflow's failed attempt added tables to it)
