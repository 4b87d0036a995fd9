"""`lowprec run`'s tracking when the store is shared or away.

Two runs started together against one new SQLite store: MLflow creates the store's tables
when a process first opens it, without a lock, and the second process used to fail
(`table ... already exists`) and keep every record in its outbox for the whole run. Both
must now track live: every metric in the store, nothing left in either outbox, and no
"not taking records" warning. A run whose records cannot be sent ends with a line that
says how many wait in the outbox and the command that sends them, and exits 3 (0 with
`--tracking-optional`); that command sends them. `tracking.report: false` leaves the run's
report pictures undrawn. The `lowprec run` processes are forked from the
session's pre-imported server (`lowprec_forks`, tests/cli_forks.py).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from lowprec.cli import main
from lowprec.tracking.outbox import OUTBOX, REJECTED, Outbox

CONFIG = {
    "model": {"factory": "tinylm:build", "args": {"vocab": 64, "width": 32}},
    "data": {"factory": "tinylm:tokens", "block_size": 16},
    "train": {"steps": 6, "batch_size": 4, "warmup": 2, "ckpt_every": 10, "log_every": 2},
    "precision": {"backend": "emulated", "default": "bf16", "keep_high_precision": [{"fqns": ["head"]}],
                  "rules": [{"name": "mlp", "select": {"fqns": ["up", "down"]}, "format": "bf16",
                             "ladder": ["fp8_tensorwise", "bf16"]}]},
    "rollout": {"check_every": 2, "min_steps": 2,
                "stages": [{"name": "mlp", "select": {"fqns": ["up", "down"]}, "format": "fp8_tensorwise"}]},
    "telemetry": {"enabled": False},
}


def _write(folder: Path, uri: str, name: str = "tiny.yaml", **tracking) -> Path:
    path = folder / name
    path.write_text(yaml.safe_dump({**CONFIG, "tracking": {"uri": uri, "experiment": "together", **tracking}}))
    return path


def _journal_metrics(run_dir: Path) -> dict[str, set[tuple[int, float]]]:
    out: dict[str, set[tuple[int, float]]] = {}
    for line in (run_dir / "tracking" / OUTBOX).read_text().splitlines():
        rec = json.loads(line)
        for key, value, _ts, step in rec.get("metrics", []):
            out.setdefault(key, set()).add((int(step), float(value)))
    return out


@pytest.mark.slow
def test_two_runs_started_together_on_one_new_sqlite_store_both_track_live(tmp_path, tiny_lm, lowprec_forks):
    from mlflow.tracking import MlflowClient
    tiny_lm(tmp_path)
    db = tmp_path / "store" / "mlflow.db"
    uri = f"sqlite:///{db}"
    _write(tmp_path, uri)
    _write(tmp_path, uri, "no_report.yaml", report=False)   # b: no report pictures at its end
    assert not db.exists()
    procs = {name: lowprec_forks.start(["run", config, "--out", name, "--run-name", name], tmp_path)
             for name, config in (("a", "tiny.yaml"), ("b", "no_report.yaml"))}
    client = None
    for name, p in procs.items():
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        assert "not taking records" not in err and "tracking failed" not in err, err   # never offline
        run_dir = tmp_path / name
        assert Outbox(run_dir / "tracking").n_pending() == 0
        assert not (run_dir / "tracking" / REJECTED).exists()
        client = client or MlflowClient(uri)
        run_id = (run_dir / "run_id").read_text().strip()
        assert client.get_run(run_id).info.status == "FINISHED"
        journal = _journal_metrics(run_dir)
        assert "train/loss" in journal
        for key, points in journal.items():   # every metric point the run recorded is in the store
            stored = {(m.step, m.value) for m in client.get_metric_history(run_id, key)}
            assert stored == points, key
        pictures = sorted(a.path for a in client.list_artifacts(run_id, "report"))
        if name == "a":
            assert {"report/loss.png", "report/precision_timeline.png"} <= set(pictures), pictures
        else:
            assert pictures == [] and not (run_dir / "tracking" / "files" / "report").exists(), pictures


@pytest.mark.slow
def test_a_run_whose_records_cannot_be_sent_says_so_last_and_exits_3(tmp_path, tiny_lm, sqlite_store, free_port,
                                                                      lowprec_forks):
    tiny_lm(tmp_path)
    _write(tmp_path, f"http://127.0.0.1:{free_port()}")   # nothing listens there
    p = lowprec_forks.run(["run", "tiny.yaml", "--out", "away"], tmp_path)
    assert p.returncode == 3, p.stderr
    assert (tmp_path / "away" / "losses.json").is_file()   # it trained
    pending = Outbox(tmp_path / "away" / "tracking").n_pending()
    last = p.stderr.strip().splitlines()[-1]
    m = re.fullmatch(r"lowprec run: tracking failed \(.+\): (\d+) records wait in the outbox (\S+); "
                     r"send them with `(lowprec sync \S+)` \(exit 3; --tracking-optional exits 0\)", last)
    assert m, last
    assert int(m.group(1)) == pending > 0 and Path(tmp_path / m.group(2)) == tmp_path / "away" / "tracking"

    # the command it names sends them (here to another store: the server is still away)
    uri = sqlite_store(tmp_path / "elsewhere")
    sync = m.group(3).split()[1:]
    assert main([*sync[:1], str(tmp_path / sync[1]), "--tracking-uri", uri]) == 0
    assert Outbox(tmp_path / "away" / "tracking").n_pending() == 0


def test_tracking_optional_exits_0_with_the_same_last_line(tmp_path, tiny_lm, free_port, monkeypatch, capsys):
    tiny_lm(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    _write(tmp_path, f"http://127.0.0.1:{free_port()}")
    assert main(["run", "tiny.yaml", "--out", "away", "--tracking-optional", "--steps", "2"]) == 0
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(r"lowprec run: tracking failed \(.+\): \d+ records wait in the outbox away/tracking; "
                        r"send them with `lowprec sync away/tracking`", last), last
