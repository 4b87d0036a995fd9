"""One writer per run folder (issue 42): a live `lowprec run` is never resumed beside itself.

A tracked run trains (slowly: each step sleeps while the file `slow` exists); while it trains, a
`--resume`, a plain run on its folder and a `lowprec sync` of its outbox are started at once: all
three exit 2 with one line that names the live run's pid and host. The run is then SIGKILLed and
its folder is free at once: resumes with another model width and another seed are refused (exit 2,
one line naming the key and both values and the commands that work) before MLflow is touched, and
the right `--resume` continues the run at full speed (`slow` removed, the config unchanged): one
MLflow run, FINISHED, exactly one point per (key, step), every event once, the losses bit for bit
those of an uninterrupted run. The `lowprec` processes are forked from the session's pre-imported
server (`lowprec_forks`, tests/cli_forks.py): each is a process of its own with its own pid.
"""

from __future__ import annotations

import json
import signal
import socket
import time
from collections import Counter
from pathlib import Path

import pytest
import yaml

from cli_forks import CliForks, Forked
from lowprec.cli import main

STEPS = 60


def _config(uri: str, *, width: int = 32, seed: int = 0, step_seconds: float = 0.5, tracked: bool = True,
            slow_while: str | None = None) -> dict:
    return {
        "model": {"factory": "tinylm:build", "args": {"vocab": 64, "width": width, "step_seconds": step_seconds,
                                                      "slow_while": slow_while}},
        "data": {"factory": "tinylm:tokens", "block_size": 16},
        "train": {"steps": STEPS, "batch_size": 4, "warmup": 2, "ckpt_every": 4, "log_every": 1, "seed": seed},
        "precision": {"backend": "emulated", "default": "bf16", "keep_high_precision": [{"fqns": ["head"]}],
                      "rules": [{"name": "mlp", "select": {"fqns": ["up", "down"]}, "format": "bf16",
                                 "ladder": ["fp8_tensorwise", "bf16"]}]},
        "rollout": {"check_every": 2, "min_steps": 2,
                    "stages": [{"name": "mlp", "select": {"fqns": ["up", "down"]}, "format": "fp8_tensorwise"}]},
        "tracking": {"uri": uri, "experiment": "one-writer", "run_name": "w"} if tracked else {"enabled": False},
        "telemetry": {"energy": "off"},   # no codecarbon meter per process: nothing here reads energy
    }


def _loss_steps(journal: Path) -> list[int]:
    if not journal.exists():
        return []
    lines = [x for x in journal.read_bytes().splitlines() if x.endswith(b"}")]
    return [m[3] for x in lines for m in json.loads(x).get("metrics", ()) if m[0] == "train/loss"]


def _files(d: Path) -> dict:
    """Every file's bytes, but lock files' (they name their latest holder)."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file() and p.suffix != ".lock"}


def _event_keys(path: Path) -> list[tuple]:
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    return [(r["step"], r["kind"], tuple(r["sites"])) for r in rows]


@pytest.fixture
def project(tmp_path, monkeypatch, tiny_lm, sqlite_store, lowprec_forks):
    tiny_lm(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    uri = sqlite_store(tmp_path / "store")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(_config(uri, slow_while=str(tmp_path / "slow"))))
    return tmp_path, uri, lowprec_forks


def _refused_while_alive(forks: CliForks, root: Path, first: Forked) -> None:
    """A --resume, a plain run and a sync on the live run's folder, started together: all exit 2."""
    others = {"resume": forks.start(["run", "run.yaml", "--out", "out", "--resume"], root),
              "plain": forks.start(["run", "run.yaml", "--out", "out"], root),
              "sync": forks.start(["sync", "out/tracking"], root)}
    done = {k: (q.communicate(timeout=300), q.returncode) for k, q in others.items()}
    assert first.poll() is None, "the first run ended before the others were refused: the machine is too slow"
    host = socket.gethostname()
    for k in ("resume", "plain"):
        (out, err), rc = done[k]
        assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, (k, err)
        assert err.startswith("lowprec run: out is in use: a live run writes it") and \
            f"pid {first.pid} on host {host}" in err and f"kill {first.pid}" in err and "--resume" in err, (k, err)
    (out, err), rc = done["sync"]
    assert rc == 2 and err.count("\n") == 1 and f"pid {first.pid} on host {host}" in err and \
        "sends its records itself" in err and "Nothing was sent" in err, err


def _refused_mismatch(root: Path, uri: str, capsys, change: dict, key: str, was, now) -> None:
    """A resume with another config: exit 2, one line, nothing written, MLflow untouched."""
    (root / "other.yaml").write_text(yaml.safe_dump(_config(uri, slow_while=str(root / "slow"), **change)))
    files, store = _files(root / "out"), _files(root / "store")
    capsys.readouterr()
    assert main(["run", "other.yaml", "--out", "out", "--resume"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"lowprec run: --resume: {key} is {now!r} in other.yaml but "
                                                   f"{was!r} in the run out holds"), err
    assert "`lowprec run out/config.yaml --out out --resume`" in err and \
        "`lowprec run other.yaml --out NEW_DIR`" in err, err
    assert _files(root / "out") == files and _files(root / "store") == store


@pytest.mark.slow   # a run of half-second steps until killed, four more `lowprec` processes
def test_a_live_run_has_one_writer_and_a_killed_one_resumes_exactly(project, capsys):
    from mlflow.tracking import MlflowClient
    root, uri, forks = project
    journal = root / "out" / "tracking" / "outbox.jsonl"
    (root / "slow").touch()
    first = forks.start(["run", "run.yaml", "--out", "out"], root)
    deadline = time.monotonic() + 240
    while first.poll() is None and max(_loss_steps(journal), default=-1) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert first.poll() is None, first.communicate()[1][-3000:]
    _refused_while_alive(forks, root, first)

    first.send_signal(signal.SIGKILL)
    first.communicate(timeout=60)
    (root / "slow").unlink()   # the resume need not sleep: numbers do not depend on it
    run_id = json.loads((root / "out" / "tracking" / "run.json").read_text())["run_id"]
    client = MlflowClient(uri)
    assert client.get_run(run_id).info.status == "RUNNING"
    # at once: the folder is free (these get past the lock to the config check)
    _refused_mismatch(root, uri, capsys, {"width": 16}, "model.args.width", 32, 16)
    _refused_mismatch(root, uri, capsys, {"seed": 7}, "train.seed", 0, 7)
    exp = client.get_experiment_by_name("one-writer")
    assert len(client.search_runs([exp.experiment_id])) == 1 and client.get_run(run_id).info.status == "RUNNING"

    again = forks.start(["run", "run.yaml", "--out", "out", "--resume"], root)
    out, err = again.communicate(timeout=600)
    assert again.returncode == 0, err[-3000:]
    assert (root / "out" / "run_id").read_text().strip() == run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and len(client.search_runs([exp.experiment_id])) == 1
    for key in run.data.metrics:   # exactly one point per (key, step)
        steps = Counter(m.step for m in client.get_metric_history(run_id, key))
        assert max(steps.values()) == 1, (key, [s for s, n in steps.items() if n > 1])
    assert sorted(m.step for m in client.get_metric_history(run_id, "train/loss")) == list(range(STEPS))

    # the same config, never stopped (untracked, no sleeping steps: the numbers do not depend on either)
    (root / "ref.yaml").write_text(yaml.safe_dump(_config(uri, step_seconds=0.0, tracked=False)))
    assert main(["run", "ref.yaml", "--out", "ref"]) == 0
    assert (root / "out" / "losses.json").read_text() == (root / "ref" / "losses.json").read_text()
    events = _event_keys(root / "ref" / "events.jsonl")
    assert events and _event_keys(root / "out" / "events.jsonl") == events
    assert _event_keys(root / "out" / "tracking" / "events.jsonl") == events   # what MLflow's events.jsonl holds
