"""Fixtures shared by the test folders.

Plain helpers that tests import as functions or classes live in helper modules beside
the tests that use them (e.g. tests/lowprec/small_gpt.py, tracking_helpers.py); a
folder's own fixtures live in its conftest.py (tests/lowprec/conftest.py: MLflow).
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


_MLFLOW_URI_ENV = os.environ.get("MLFLOW_TRACKING_URI")   # as the test session found it


@pytest.fixture(autouse=True)
def mlflow_process_uri_reset():
    """After each test, MLflow's process-wide tracking URI as the session found it (unset).

    Lightning's MLFlowLogger sets it (`mlflow.set_tracking_uri`, which also writes
    `MLFLOW_TRACKING_URI` into the environment), and the Hugging Face Trainer's MLflow
    reporting then keeps whatever is set: a later test's Trainer in the same process would
    log into an earlier test's store. Reset to the session's start, not to what was set
    before the test: a module fixture that trained with Lightning set it before its first
    test. Imports nothing: MLflow is reset only where it is imported."""
    yield
    utils = sys.modules.get("mlflow.tracking._tracking_service.utils")
    if utils is not None and utils._tracking_uri is not None:
        utils.set_tracking_uri(None)
    if _MLFLOW_URI_ENV is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = _MLFLOW_URI_ENV


@pytest.fixture(scope="session")
def free_port():
    """`free_port()`: a TCP port on 127.0.0.1 that nothing listens on right now."""
    return _free_port


@pytest.fixture(scope="session")
def gloo():
    """torch.distributed; skips the test where this torch build has no gloo backend."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    return dist


@pytest.fixture(scope="session")
def tiny_lm():
    """`tiny_lm(folder, name="tinylm")`: copies tests/tiny_lm.py, a user's own model and data
    module, into `folder` as `<name>.py`; returns `name` (for `model.factory: <name>:build`)."""
    def write(folder: Path, name: str = "tinylm") -> str:
        shutil.copy(Path(__file__).with_name("tiny_lm.py"), Path(folder) / f"{name}.py")
        return name
    return write


@pytest.fixture(scope="session")
def lowprec_forks(tmp_path_factory):
    """`lowprec_forks.run(argv, cwd)` / `.start(argv, cwd)`: `lowprec ARGV` as a process forked from
    one server that imported lowprec, MLflow and lm-eval once for the session (tests/cli_forks.py),
    in place of a `python -m lowprec.cli` start that imports them again."""
    from cli_forks import CliForks
    forks = CliForks(tmp_path_factory.mktemp("lowprec-forks"))
    yield forks
    forks.close()


@pytest.fixture(scope="session")
def rank_forks():
    """torchrun's ranks forked from one server that imported torch and lowprec once for the session
    (tests/rank_forks.py): `[torchrun ..., *rank_forks.rank("-m", "lowprec.cli", "run", ...)]` with
    `env=rank_forks.env({**os.environ, ...})` in place of `[torchrun ..., "-m", "lowprec.cli", ...]`.
    `env(job_env, imports=...)`: the socket of a server started with the job's start-up settings (its
    OpenMP, MKL and ATen CPU variables) that imported `imports` too (torchtitan's trainer)."""
    from rank_forks import RankForks
    forks = RankForks()
    yield forks
    forks.close()


# The longest files that run in one process each (measured with `--durations` in two full runs of the
# checkout, 2026-12-04), taken first in this order; the other files that hold a `slow` test follow,
# then the rest. A hint for balance only: a stale list costs time, not correctness.
LONGEST_FIRST = ("test_wheel_install.py", "test_kill_resume.py", "test_gate_e2e.py", "test_smoke.py",
                 "test_fp8_ops.py", "test_checkpoint.py", "test_run_output.py", "test_gpu_bench.py",
                 "test_tracking_postgres.py", "test_loop_faults.py", "test_tracking_ui.py", "test_fp8_cast.py",
                 "test_quantize_errors.py", "test_tracking.py", "test_tracking_resume.py")
# The files whose tests are marked `launches` (several busy processes at once: torchrun ranks, concurrent
# jobs): one unit of work under `make test` (LaunchesTogether). xdist's scheduler sees test ids, not marks,
# so they are named here; `pytest_collection_modifyitems` refuses a run where the marks and this list differ.
LAUNCH_FILES = ("test_parallel_run.py", "test_torchtitan_trainer.py", "test_parallel_parity.py",
                "test_fast_path_distributed.py", "test_torchtitan_moe.py", "test_parallel_multinode.py",
                "test_fast_path_faults.py", "test_distributed.py", "test_profile_distributed.py")


def pytest_collection_modifyitems(config, items):
    """The launching files first (in LAUNCH_FILES' order), then the longest ones, each file's tests
    kept together and in order.

    `make test` hands whole files to three workers (`--dist loadfile --no-loadscope-reorder`), each
    taking the next unit when it is done, in this order: a long file taken last would leave one
    worker running it alone, so the long ones are taken first (LONGEST_FIRST, then the files that
    hold a `slow` test) and the short ones fill in at the end. The launching files are one unit
    (`LaunchesTogether`), taken first."""
    marked = {item.path.name for item in items if item.get_closest_marker("launches")}
    collected = {item.path.name for item in items}
    if marked != {f for f in LAUNCH_FILES if f in collected}:
        raise pytest.UsageError(f"tests/conftest.py: LAUNCH_FILES {sorted(LAUNCH_FILES)} must name exactly the "
                                f"files with tests marked `launches`: {sorted(marked)}")
    slow_files = {item.path for item in items if item.get_closest_marker("slow")}
    first_seen: dict = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.path, i)

    def rank(path) -> tuple:
        if path.name in LAUNCH_FILES:
            return (0, LAUNCH_FILES.index(path.name))
        if path.name in LONGEST_FIRST:
            return (1, LONGEST_FIRST.index(path.name))
        return (2 + (path not in slow_files), 0)

    order = {id(item): (rank(item.path), first_seen[item.path], i) for i, item in enumerate(items)}
    items.sort(key=lambda item: order[id(item)])


@pytest.hookimpl(optionalhook=True)   # xdist's hook: without xdist, nothing to schedule
def pytest_xdist_make_scheduler(config, log):
    """Under `--dist loadfile`: LaunchesTogether (below) in place of xdist's file scheduler."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class LaunchesTogether(LoadFileScheduling):
        """xdist's `loadfile` (a test file is a unit of work, run on one worker, its module fixtures
        set up once), except that the files of LAUNCH_FILES are one unit: their tests run one after
        the other on one worker while the other workers run one-process files. On 2 cores, two launches
        side by side took 12% more CPU time and 15% more wall time than one after the other (a
        13-process and a 6-process launch, measured 2026-12-02), and a lock that made one worker wait
        for the other's launch instead left the waiting worker idle (175 s of worker time in a full
        run, 2026-12-04). (xdist's `loadgroup` would do this from marks, but it renames test ids
        through an attribute pytest 9 no longer has.)"""

        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return "launches" if path.rsplit("/", 1)[-1] in LAUNCH_FILES else path

    return LaunchesTogether(config, log)
