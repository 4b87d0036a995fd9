"""The Tracker and `lowprec gate` against an `mlflow server` backed by PostgreSQL.

A private cluster of Debian's `postgresql` (conftest.py `postgres`: initdb into a temporary
folder, started on a free port on 127.0.0.1; skipped with the reason where it is not
installed) serves as MLflow's backend store. Two runs log at once (the recorded rollout's
metrics, signals, events and evals, from two threads, each Tracker with its own journal and
sender) and keep logging a metric every few milliseconds while `lowprec gate` processes read
finished runs from the same server. Then: every metric step is there once, every event
once, both runs FINISHED, and each gate exited as its runs call for.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

import postgres_helpers
from lowprec.tracking.tracker import Tracker
from tracking_helpers import check_run_over_rest, recorded_rollout, replay

LOWPREC = Path(sys.executable).with_name("lowprec")
STEPS, HOLD = 10, 5        # the live runs keep logging at step HOLD until the gates are done
FAST = dict(flush_interval_s=0.2, retry_max_s=1.0, probe_timeout_s=1.0)
N = 200
GATES = """
gates:
  - metric: eval/heldout/bits_per_byte
    direction: lower_is_better
    max_regression: {relative: 0.02}
  - metric: eval/cloze/acc
    direction: higher_is_better
    max_regression: {absolute: 0.05}
defaults: {min_samples: 50, bootstrap_samples: 500}
"""
LIVE_GATES = """
gates:
  - metric: eval/next_byte/acc
    direction: higher_is_better
    max_regression: {absolute: 0.05}
"""


def _evals(kind: str, step: int) -> tuple[dict, dict]:
    """Per-example bits per byte and 0/1 answers; `bad` is 5% worse and 15 points less accurate."""
    rng = np.random.default_rng(0)
    bpb, acc = rng.gamma(20.0, 0.08, size=N), (rng.random(N) < 0.6).astype(float)
    if kind != "baseline":
        other = np.random.default_rng({"good": 2, "bad": 3}[kind] * 100 + step)
        bpb = bpb * (1 + other.normal(0, 0.003, size=N)) * (1.05 if kind == "bad" else 1.0)
        if kind == "bad":
            acc[np.flatnonzero(acc)[:30]] = 0.0
    keys = [f"doc{i:04d}" for i in range(N)]
    results = {"heldout": {"bits_per_byte": bpb.mean(), "bits_per_byte_stderr": bpb.std(ddof=1) / N ** .5},
               "cloze": {"acc,none": acc.mean(), "acc_stderr,none": acc.std(ddof=1) / N ** .5}}
    samples = {"heldout": {"bits_per_byte": dict(zip(keys, bpb))}, "cloze": {"acc,none": dict(zip(keys, acc))}}
    return results, samples


def _finished_run(url: str, kind: str, buffer_dir: Path) -> str:
    tracker = Tracker(url, "pg-gate", f"{kind}-run", buffer_dir=buffer_dir, **FAST)
    for step in (5, 10):
        tracker.log_metrics(step, {"train/loss": 2.0})
        tracker.log_eval(step, *_evals(kind, step))
    st = tracker.finish("FINISHED", timeout=120, report=False)
    assert st["pending"] == 0, st
    return tracker.run_id


def _gate(url: str, baseline: str, candidate: str, gates: Path) -> subprocess.Popen:
    cmd = [str(LOWPREC), "gate", "--baseline", baseline, "--candidate", candidate, "--gates", str(gates),
           "--tracking-uri", url]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=gates.parent)


def test_without_postgresql_the_skip_says_why_and_how(monkeypatch):
    monkeypatch.setattr(postgres_helpers, "bindir", lambda: None)
    why = postgres_helpers.missing()
    assert why.startswith("PostgreSQL is not installed (no /usr/lib/postgresql/*/bin/initdb)")
    assert "apt-get install -y -q postgresql" in why and "make test" in why


@pytest.mark.slow   # a PostgreSQL cluster, an MLflow server and `lowprec gate` processes
def test_two_runs_log_at_once_while_gates_read_the_postgres_backed_server(mlflow_postgres, tmp_path):
    server = mlflow_postgres
    assert server.backend_store_uri.startswith("postgresql+psycopg2://")
    finished = {kind: _finished_run(server.url, kind, tmp_path / kind) for kind in ("baseline", "good", "bad")}
    (tmp_path / "gates.yaml").write_text(GATES)
    (tmp_path / "live_gates.yaml").write_text(LIVE_GATES)
    recorded_rollout(STEPS)   # trained once here, before the threads replay its tracker calls

    trackers = [Tracker(server.url, "pg-live", f"live-{i}", buffer_dir=tmp_path / f"live{i}", **FAST) for i in (0, 1)]
    at_hold = [threading.Event(), threading.Event()]
    gates_done = threading.Event()
    rollouts, beats, errors = [None, None], [0, 0], []

    def live(i: int) -> None:
        tracker = trackers[i]

        def on_step(step: int) -> None:
            if step != HOLD:
                return
            assert tracker.flush(timeout=60)     # its first eval (step 3) is on the server
            at_hold[i].set()
            while not gates_done.is_set():       # logging goes on while the gates read
                tracker.log_metrics(beats[i], {"live/beat": float(beats[i])})
                beats[i] += 1
                gates_done.wait(0.01)
        try:
            rollouts[i] = replay(tracker, STEPS, on_step=on_step, step_seconds=0.02)
        except BaseException as e:  # noqa: BLE001  (reported by the test thread)
            errors.append(e)
            at_hold[i].set()

    threads = [threading.Thread(target=live, args=(i,), daemon=True) for i in (0, 1)]
    for t in threads:
        t.start()
    try:
        assert all(e.wait(180) for e in at_hold) and not errors, errors
        live_ids = [t.run_id for t in trackers]
        gates = {"good": _gate(server.url, finished["baseline"], finished["good"], tmp_path / "gates.yaml"),
                 "bad": _gate(server.url, finished["baseline"], finished["bad"], tmp_path / "gates.yaml"),
                 "live": _gate(server.url, live_ids[0], live_ids[1], tmp_path / "live_gates.yaml")}
        out = {name: p.communicate(timeout=180)[0] for name, p in gates.items()}
        codes = {name: p.returncode for name, p in gates.items()}
        still_running = [server.get("/api/2.0/mlflow/runs/get", run_id=r)["run"]["info"]["status"] for r in live_ids]
    finally:
        gates_done.set()
        for t in threads:
            t.join(timeout=120)
    assert not errors, errors
    assert codes == {"good": 0, "bad": 1, "live": 2}, out
    assert "REGRESS" in out["bad"] and "did not finish" in out["live"], out
    assert still_running == ["RUNNING", "RUNNING"]
    assert min(beats) > 10, beats       # the runs really logged while the gates read

    for i, tracker in enumerate(trackers):
        assert tracker.finish("FINISHED", timeout=120, report=False)["pending"] == 0
        run = check_run_over_rest(server, tracker.run_id, list(range(STEPS)), rollouts[i].events)
        assert run["info"]["status"] == "FINISHED" and run["info"]["run_name"] == f"live-{i}"
        assert sorted(m["step"] for m in server.history(tracker.run_id, "live/beat")) == list(range(beats[i]))
        assert sorted(m["step"] for m in server.history(tracker.run_id, "eval/next_byte/acc")) == [3, STEPS - 1]
    # the finished runs the gates read are untouched
    for kind, run_id in finished.items():
        assert sorted(m["step"] for m in server.history(run_id, "eval/heldout/bits_per_byte")) == [5, 10]
