"""`lowprec run` on a disk that fills up, and what a `--resume` says and refuses.

The full disk is real: a tmpfs of 4 MB mounted for the test (it needs the right to mount,
root here; skipped with the reason elsewhere), filled with a file that leaves room for the
first two checkpoints and not the third. The run must stop with one line naming the
checkpoint, its folder and the space free (exit 4), mark its MLflow run KILLED with the
reason, keep the earlier checkpoints and go on with `--resume` once space is freed. Before
that resume, two that must be refused (exit 2, one line, the MLflow run untouched): `--steps`
below the checkpoint's step, and a model factory that now builds another model under the
same saved config. The resume itself trains further with a larger `--steps` and says so.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from lowprec.cli import main
from tests.snapshots import folder_snapshot

CFG = {
    "model": {"factory": "tinylm:build", "args": {"vocab": 64, "width": 32}},
    "data": {"factory": "tinylm:tokens", "block_size": 16},
    "train": {"steps": 6, "batch_size": 4, "warmup": 2, "ckpt_every": 2, "log_every": 1},
    "precision": {"backend": "emulated", "default": "bf16", "keep_high_precision": [{"fqns": ["head"]}],
                  "rules": []},
    "telemetry": {"enabled": False},
}


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MB tmpfs at tmp_path/fs, unmounted afterwards (skipped where mounting is not allowed)."""
    fs = tmp_path / "fs"
    fs.mkdir()
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(fs)], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({p.stderr.strip() or p.returncode}): needs root")
    yield fs
    subprocess.run(["umount", "-l", str(fs)], check=False)


@pytest.fixture
def project(tmp_path, monkeypatch, tiny_lm):
    tiny_lm(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("tinylm", None)   # the test may swap the module's code


def _lines(err: str) -> list[str]:
    """What the command said, the progress lines left out."""
    return [ln for ln in err.splitlines() if ln.strip() and " step " not in ln[:24] and "%)" not in ln]


_tree = folder_snapshot


def _swap_code(src: Path, text: str) -> None:
    """Give the factory module new code, imported afresh: its compiled cache goes too (Python checks
    a cache by the source's size and mtime in whole seconds, and this edit keeps the size)."""
    src.write_text(text)
    Path(importlib.util.cache_from_source(str(src))).unlink(missing_ok=True)
    sys.modules.pop(src.stem, None)


def test_a_full_disk_stops_the_run_with_one_line_and_resume_continues(project, small_disk, sqlite_store, capsys):
    from mlflow.tracking import MlflowClient
    from lowprec.state.checkpoint import list_checkpoints, verify_checkpoint
    uri = sqlite_store(project / "store")   # the store is on another disk, as it would be
    (project / "run.yaml").write_text(yaml.safe_dump({**CFG, "tracking": {"uri": uri, "experiment": "disk"}}))
    free = os.statvfs(small_disk).f_bavail * os.statvfs(small_disk).f_frsize
    # room for step_0 (~65 KB) and step_2 (~140 KB) and the run's small files, not for step_4
    (small_disk / "filler").write_bytes(b"\0" * (free - 300_000))
    out = small_disk / "run"

    assert main(["run", "run.yaml", "--out", str(out)]) == 4
    err = capsys.readouterr().err
    said = _lines(err)
    assert len(said) == 1 and "Traceback" not in err, err
    assert "step_00000004.pt could not be written in" in said[0] and str(out / "checkpoints") in said[0], said
    assert "free there now" in said[0] and "--resume" in said[0] and "exit 4" in said[0], said
    steps = [s for s, _ in list_checkpoints(out / "checkpoints")]
    assert steps == [0, 2] and not list((out / "checkpoints").glob("*.tmp"))
    for _, p in list_checkpoints(out / "checkpoints"):
        verify_checkpoint(p)   # the earlier checkpoints are whole
    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name("disk").experiment_id])
    assert run.info.status == "KILLED"
    assert run.data.tags["lowprec.stopped"].startswith("the disk is full: step_00000004.pt could not be written")
    (small_disk / "filler").unlink()

    # --steps below the checkpoint's step: refused before anything is touched
    before = _tree(out)
    assert main(["run", "run.yaml", "--out", str(out), "--resume", "--steps", "1"]) == 2
    said = _lines(capsys.readouterr().err)
    assert len(said) == 1 and "train.steps is 1, below step 2" in said[0] and "--steps 2 or more" in said[0], said
    assert _tree(out) == before and client.get_run(run.info.run_id).info.status == "KILLED"

    # the same saved config, but the factory's code now builds another model: refused the same way
    src = project / "tinylm.py"
    original = src.read_text()
    _swap_code(src, original.replace("2 * width", "3 * width"))
    assert main(["run", "run.yaml", "--out", str(out), "--resume"]) == 2
    err = capsys.readouterr().err
    said = _lines(err)
    assert len(said) == 1 and "Traceback" not in err, err
    assert "up.weight is (96, 32) in this model but (64, 32) in the checkpoint step_00000002.pt" in said[0], said
    assert _tree(out) == before and client.get_run(run.info.run_id).info.status == "KILLED"
    _swap_code(src, original)

    # free space, a larger --steps: it says where it continues and what MLflow keeps
    assert main(["run", "run.yaml", "--out", str(out), "--resume", "--steps", "8"]) == 0
    err = capsys.readouterr().err
    assert err.count("--resume: continuing from") == 1, err
    assert (f"continuing from {out / 'checkpoints' / 'step_00000002.pt'} at step 2 of 8; train.steps is 8, the run "
            f"started with 6: MLflow keeps the param train.steps=6, the tag train.steps says 8") in err, err
    run = client.get_run(run.info.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.steps"] == "6" and run.data.tags["train.steps"] == "8"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == list(range(8))
    assert not (out / "tracking" / "rejected.jsonl").exists()   # nothing refused by MLflow


def test_a_resume_names_its_checkpoint_and_warns_once_per_skipped_one(project, capsys):
    from test_cli_run import _flip_a_weight_bit
    (project / "run.yaml").write_text(yaml.safe_dump({**CFG, "tracking": {"enabled": False}}))
    assert main(["run", "run.yaml", "--out", "run"]) == 0
    (project / "run" / "summary.json").unlink()   # as if killed before the end: the folder is STOPPED
    _flip_a_weight_bit(project / "run" / "checkpoints" / "step_00000006.pt")   # the last step's
    capsys.readouterr()
    assert main(["run", "run.yaml", "--out", "run", "--resume"]) == 0
    err = capsys.readouterr().err
    assert err.count("skipping checkpoint") == 1 and "step_00000006.pt" in err, err
    assert "--resume: continuing from run/checkpoints/step_00000004.pt at step 4 of 6" in err, err
    assert err.index("skipping checkpoint") < err.index("continuing from")


def test_a_resume_does_not_write_the_checkpoint_it_loaded_again(project):
    """Writing it again cost a whole checkpoint's time on every resume and, after a full disk, room
    for a second copy. (A newer checkpoint that was skipped as corrupt is another case: then the
    step is written again, which moves the newer one aside, as after a rewind.)"""
    (project / "run.yaml").write_text(yaml.safe_dump({**CFG, "tracking": {"enabled": False}}))
    assert main(["run", "run.yaml", "--out", "run"]) == 0
    ckpts = project / "run" / "checkpoints"

    def stamp(p: Path) -> tuple[int, int]:
        return p.stat().st_ino, p.stat().st_mtime_ns

    (ckpts / "step_00000006.pt").unlink()   # as if killed before the last step's checkpoint
    (project / "run" / "summary.json").unlink()
    four = stamp(ckpts / "step_00000004.pt")
    assert main(["run", "run.yaml", "--out", "run", "--resume"]) == 0
    assert stamp(ckpts / "step_00000004.pt") == four and (ckpts / "step_00000006.pt").is_file()
    (project / "run" / "summary.json").unlink()   # as if stopped in the final eval: the final eval only
    six = stamp(ckpts / "step_00000006.pt")
    assert main(["run", "run.yaml", "--out", "run", "--resume"]) == 0
    assert stamp(ckpts / "step_00000006.pt") == six
