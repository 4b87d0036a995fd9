"""`lowprec gate` refuses what it must not compare, and checks its output paths first (issue 12).

Runs in a real SQLite store: a baseline logged with lowprec's Tracker (a fast eval at step 5,
the final full eval at step 10, `log_eval(mode=, suite=)`), and candidates written with
MlflowClient the way a run would leave them: one killed half-way (still RUNNING, last eval at
step 9), one whose last eval is a fast one, one evaluated on another suite, one good. The
`lowprec gate` processes are forked from the session's pre-imported server (`lowprec_forks`,
tests/cli_forks.py).
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from lowprec.tracking.tracker import Tracker

GATES = """
gates:
  - metric: eval/t/acc
    direction: higher_is_better
    max_regression: {absolute: 0.5}
"""
FAST = dict(flush_interval_s=0.2, retry_max_s=1.0, probe_timeout_s=0.5)


def _results(acc: float) -> dict:
    return {"t": {"acc": acc, "acc_stderr": 0.01}}


def _client_run(client, exp_id: str, name: str, evals: list[tuple[int, str]], *, finished: bool = True,
                suite: str = "default", limit: int | None = None) -> str:
    run = client.create_run(exp_id, run_name=name)
    rid = run.info.run_id
    client.log_param(rid, "eval.suite", suite)
    if limit is not None:
        client.log_param(rid, "eval.limit", str(limit))
    for step, mode in evals:
        client.log_metric(rid, "eval/t/acc", 0.6, step=step)
        client.log_metric(rid, "eval/t/acc_stderr", 0.01, step=step)
        client.log_metric(rid, "eval_mode/eval", 1.0 if mode == "full" else 0.0, step=step)
    if finished:
        client.set_terminated(rid, "FINISHED")
    return rid


@pytest.fixture(scope="module")
def store(tmp_path_factory, sqlite_store, lowprec_forks):
    from mlflow.tracking import MlflowClient

    root = tmp_path_factory.mktemp("gate-refusals")
    uri = sqlite_store(root)   # a copy of the session's migrated store
    client = MlflowClient(uri)
    tracker = Tracker(uri, "refusals", "baseline", buffer_dir=root / "baseline", **FAST)
    tracker.log_config({"eval": {"suite": "default"}})
    tracker.log_eval(5, _results(0.6), samples=None, mode="fast", suite="default")
    tracker.log_eval(10, _results(0.6), samples={"t": {"acc": {"a": 1.0, "b": 0.0}}}, mode="full", suite="default")
    assert tracker.finish("FINISHED", timeout=120, report=False)["pending"] == 0
    exp = client.get_experiment_by_name("refusals").experiment_id
    runs = {"baseline": tracker.run_id,
            "killed": _client_run(client, exp, "killed", [(5, "fast"), (9, "fast")], finished=False),
            "fastend": _client_run(client, exp, "fastend", [(5, "fast"), (10, "fast")]),
            "othersuite": _client_run(client, exp, "othersuite", [(10, "full")], suite="other"),
            "capped": _client_run(client, exp, "capped", [(5, "fast"), (10, "full")], limit=8),
            "good": _client_run(client, exp, "good", [(5, "fast"), (10, "full")]),
            # a framework run whose lowprec count trailed the framework's (before one step for everyone)
            "ends9": _client_run(client, exp, "ends9", [(5, "fast"), (9, "full")])}
    gates = root / "gates.yaml"
    gates.write_text(GATES)
    return {"uri": uri, "root": root, "gates": str(gates), "client": client, "forks": lowprec_forks, **runs}


def _args(store, candidate: str, *extra: str) -> list[str]:
    return ["gate", "--baseline", store["baseline"], "--candidate", store[candidate], "--gates", store["gates"],
            "--tracking-uri", store["uri"], *extra]


def _gate(store, candidate: str, *extra: str) -> subprocess.CompletedProcess:
    return store["forks"].run(_args(store, candidate, *extra), store["root"], timeout=180)


def test_log_eval_records_mode_and_suite(store):
    client = store["client"]
    hist = {m.step: m.value for m in client.get_metric_history(store["baseline"], "eval_mode/eval")}
    assert hist == {5: 0.0, 10: 1.0}
    doc = json.loads(Path(client.download_artifacts(store["baseline"], "evals/eval_step000010.json",
                                                    str(store["root"]))).read_text())
    assert doc["mode"] == "full" and doc["suite"] == "default"


@pytest.mark.slow
def test_killed_candidate_is_refused(store):
    p = _gate(store, "killed")
    assert p.returncode == 2, p.stdout + p.stderr
    err = p.stderr
    assert "Traceback" not in err and err.startswith("lowprec gate: refusing to compare")
    assert "did not finish (MLflow status RUNNING)" in err and "step 9" in err
    assert "--step N (N one of 5)" in err   # the one step both runs have: a fix that is not refused again
    assert p.stdout == ""


@pytest.mark.slow
def test_fast_eval_is_not_compared_with_a_full_one(store):
    p = _gate(store, "fastend")
    assert p.returncode == 2, p.stdout + p.stderr
    assert "of mode 'full'" in p.stderr and "of mode 'fast'" in p.stderr and "Traceback" not in p.stderr


def test_other_suite_refused_even_at_a_named_step(store, capsys):
    from lowprec.cli import main

    for extra in ((), ("--step", "10")):
        assert main(_args(store, "othersuite", *extra)) == 2
        err = capsys.readouterr().err
        assert "of suite 'default'" in err and "of suite 'other'" in err


def test_evals_capped_by_another_eval_limit_are_refused_even_at_a_named_step(store, capsys):
    """A run evaluated with `eval.limit: 8` scored other (fewer) examples than one without: its
    aggregate is another sample's, so the two never compare, as two suites do not."""
    from lowprec.cli import main

    for extra in ((), ("--step", "10")):
        assert main(_args(store, "capped", *extra)) == 2
        err = capsys.readouterr().err
        assert "of eval.limit 'null'" in err and "of eval.limit '8'" in err, err
        assert "one eval.limit" in err and "Traceback" not in err


def test_good_candidate_passes_and_a_named_step_lifts_the_refusal(store, capsys):
    from lowprec.cli import main

    assert main(_args(store, "good")) == 0
    assert "at step 10" in capsys.readouterr().out
    assert main(_args(store, "killed", "--step", "5")) == 0     # the user chose the evals to compare
    assert main(_args(store, "fastend", "--step", "5")) == 0


@pytest.mark.parametrize("flag", ["--junit", "--markdown"])
def test_unwritable_output_fails_before_reading_any_run(tmp_path, flag, lowprec_forks):
    missing_db = tmp_path / "none.db"
    gates = tmp_path / "g.yaml"
    gates.write_text(GATES)
    target = tmp_path / "no" / "such" / "out.xml" if flag == "--junit" else tmp_path   # a folder, not a file
    p = lowprec_forks.run(["gate", "--baseline", "a" * 32, "--candidate", "b" * 32, "--gates", str(gates),
                           "--tracking-uri", f"sqlite:///{missing_db}", flag, str(target)], tmp_path, timeout=180)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.startswith(f"lowprec gate: {flag} {target}: ") and "Traceback" not in p.stderr
    assert ("does not exist" if flag == "--junit" else "is a folder") in p.stderr
    assert "tracking store" not in p.stderr                       # no run was looked for
    assert not missing_db.exists() and not (tmp_path / "no").exists()
    assert sorted(x.name for x in tmp_path.iterdir()) == ["g.yaml"]


def test_final_evals_are_compared_by_default_and_a_named_step_both_lack_suggests_one_both_have(store, capsys):
    """`--step final` (the default) compares each run's final evals, even at different steps;
    `--step N` needs N in both runs, and its refusal names only steps both runs have, so
    following it is never refused again (issue 54: 189 and 200 each named the other's)."""
    from lowprec.cli import main

    assert main(_args(store, "ends9")) == 0
    out = capsys.readouterr().out
    assert "at step 10" in out and "at step 9" in out
    assert main(_args(store, "ends9", "--step", "final")) == 0
    capsys.readouterr()
    for named in ("9", "10"):
        assert main(_args(store, "ends9", "--step", named)) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err and "--step N (N one of 5)" in err and "--step final" in err
    assert main(_args(store, "ends9", "--step", "5")) == 0        # the suggested one is not refused
    assert main(_args(store, "ends9", "--step", "last")) == 2
    assert "--step must be final or a step number" in capsys.readouterr().err
