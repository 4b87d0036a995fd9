"""`lowprec profile` on a user's tiny LM in a project folder: the written config plans and
runs, the out folder holds the table/CSV/JSON/picture, the MLflow run, checkpoints, and bad
arguments (exit 2, the option named, nothing written)."""

from __future__ import annotations

import copy
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from lowprec.cli import main

GOOD = {
    "model": {"factory": "tinylm:build", "args": {"vocab": 64, "width": 32}},
    "data": {"factory": "tinylm:tokens", "block_size": 16},
    "train": {"steps": 4, "batch_size": 4, "warmup": 2, "ckpt_every": 2, "log_every": 2},
    "precision": {"backend": "emulated", "default": "bf16", "keep_high_precision": [{"fqns": ["head"]}],
                  "rules": [{"name": "mlp", "select": {"fqns": ["up", "down"]}, "format": "bf16",
                             "ladder": ["nvfp4", "fp8_tensorwise", "bf16"]}]},
    "rollout": {"check_every": 2, "min_steps": 2,
                "stages": [{"name": "mlp", "select": {"fqns": ["up", "down"]}, "format": "fp8_tensorwise"}]},
    "tracking": {"enabled": False},
}


@pytest.fixture
def project(tmp_path, monkeypatch, tiny_lm):
    tiny_lm(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "good.yaml").write_text(yaml.safe_dump(GOOD))
    return tmp_path


def _profile(*args):
    return main(["profile", "good.yaml", "--batches", "2", "--write", "w/p.yaml", "--out", "out",
                 "--no-tracking", *args])


@pytest.mark.slow
def test_profile_writes_a_config_that_plans_and_runs(project, capsys):
    assert _profile("--steps", "2") == 0
    out = capsys.readouterr().out
    assert "written: w/p.yaml" in out and "up" in out and "down" in out
    written = yaml.safe_load((project / "w" / "p.yaml").read_text())
    assert written["tracking"]["run_name"] == "good-profiled"
    stages = written["rollout"]["stages"]
    assert stages and {f for s in stages for f in s["select"]["fqns"]} <= {"up", "down"}
    assert {"profile.txt", "profile.csv", "profile.json", "profile.png", "profiled.yaml"} <= {
        p.name for p in (project / "out").iterdir()}
    prof = json.loads((project / "out" / "profile.json").read_text())
    assert {(e["fqn"], e["format"]) for e in prof["entries"]} == {
        (f, x) for f in ("up", "down") for x in ("nvfp4", "fp8_tensorwise")}
    assert prof["passes_per_rank"] == 2 * (1 + 4)
    assert (project / "out" / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    csv_lines = (project / "out" / "profile.csv").read_text().splitlines()
    assert len(csv_lines) == 1 + 4
    assert main(["plan", "w/p.yaml"]) == 0
    assert main(["run", "w/p.yaml", "--steps", "4", "--out", "run"]) == 0
    assert (project / "run" / "losses.json").is_file()


@pytest.mark.slow
def test_budget_zero_keeps_everything_bf16_and_writes_no_rollout(project, capsys):
    assert _profile("--steps", "0", "--budget", "0") == 0
    written = yaml.safe_load((project / "w" / "p.yaml").read_text())
    assert "rollout" not in written
    assert [r["ladder"] for r in written["precision"]["rules"]] == [["bf16"]]
    assert main(["plan", "w/p.yaml"]) == 0


@pytest.mark.slow
def test_profile_recorded_in_mlflow(project, sqlite_store):
    from mlflow.tracking import MlflowClient
    uri = sqlite_store(project)
    cfg = copy.deepcopy(GOOD)
    cfg["tracking"] = {"uri": uri, "experiment": "prof"}
    (project / "good.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["profile", "good.yaml", "--steps", "0", "--batches", "2", "--write", "w/p.yaml",
                 "--out", "out"]) == 0
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("prof")
    runs = client.search_runs([exp.experiment_id], "attributes.run_name = 'profile-good'")
    assert len(runs) == 1
    run = runs[0]
    assert run.data.metrics["profile/passes_per_rank"] == 2 * (1 + 4)
    names = {a.path for a in client.list_artifacts(run.info.run_id, "profile")}
    assert {f"profile/{n}" for n in ("profile.txt", "profile.csv", "profile.json", "profile.png",
                                     "profiled.yaml")} <= names


# option, arguments, a piece of the message
BAD = {
    "unknown_format": (["--formats", "fp9"], "--formats"),
    "share_above_one": (["--max-share", "nvfp4=2"], "--max-share"),
    "sample_below_roles": (["--sample", "1"], "--sample"),
    "missing_checkpoint": (["--checkpoint", "nope/step_00000002.pt"], "--checkpoint"),
    "zero_stages": (["--stages", "0"], "--stages"),
    "missing_profile": (["--from-profile", "nope/profile.json"], "--from-profile"),
    "profile_and_checkpoint": (["--from-profile", "good.yaml", "--checkpoint", "good.yaml"], "--from-profile"),
    "not_a_profile": (["--from-profile", "good.yaml"], "--from-profile"),
}


@pytest.mark.parametrize("name", sorted(BAD))
def test_bad_arguments_exit_2_and_write_nothing(project, capsys, name):
    args, expected = BAD[name]
    assert _profile("--steps", "0", *args) == 2
    err = capsys.readouterr().err
    assert err.startswith("lowprec profile: ") and expected in err, err
    assert len(err.strip().splitlines()) == 1
    assert not (project / "w").exists() and not (project / "out").exists()


def test_replan_from_a_saved_profile_measures_nothing(project, capsys):
    """--from-profile: another budget and stage count from the same numbers, no pass run; a
    profile of other sites is refused with nothing written."""
    assert _profile("--steps", "0") == 0
    saved = json.loads((project / "out" / "profile.json").read_text())
    capsys.readouterr()
    fp8 = max(e["sensitivity"] for e in saved["entries"] if e["format"] == "fp8_tensorwise")
    assert main(["profile", "good.yaml", "--from-profile", "out/profile.json", "--budget", str(fp8 * 1.01),
                 "--max-share", "nvfp4=0", "--stages", "1", "--write", "w/re.yaml", "--out", "re",
                 "--no-tracking"]) == 0
    out = capsys.readouterr().out
    assert "nothing is measured again" in out and "warm-up" not in out and "forward+backward passes per rank on" not in out.split("cost:")[0]
    assert "cost: no passes now (re-planned from out/profile.json; its measurement took: " in out
    assert json.loads((project / "re" / "profile.json").read_text()) == saved   # the same numbers, re-planned
    written = yaml.safe_load((project / "w" / "re.yaml").read_text())
    assert [s["format"] for s in written["rollout"]["stages"]] == ["fp8_tensorwise"]
    assert {r["ladder"][0] for r in written["precision"]["rules"]} == {"fp8_tensorwise"}
    assert main(["plan", "w/re.yaml"]) == 0
    saved["entries"] = [dict(e, fqn="other." + e["fqn"]) for e in saved["entries"]]
    (project / "other.json").write_text(json.dumps(saved))
    assert main(["profile", "good.yaml", "--from-profile", "other.json", "--write", "w/x.yaml", "--out", "x",
                 "--no-tracking"]) == 2
    assert "does not profile this config's sites" in capsys.readouterr().err
    assert not (project / "w" / "x.yaml").exists() and not (project / "x").exists()


@pytest.mark.slow
def test_bad_argument_as_a_subprocess_no_traceback(project, lowprec_forks):
    p = lowprec_forks.run(["profile", "good.yaml", "--steps", "0", "--formats", "fp9", "--write", "w/p.yaml",
                           "--out", "out", "--no-tracking"], project, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("lowprec profile: ") and "--formats" in p.stderr
    assert not (project / "w").exists() and not (project / "out").exists()
    assert not (project / "runs").exists()


def _reference_loss(cfg_path: Path, weights: dict | None, n: int) -> float:
    """The mean loss of the config's model (all sites BF16) on its first `n` batches."""
    from lowprec.config import LowprecConfig
    from lowprec.runtime.engines.engine import loss_of
    from lowprec.runtime.trainer.run import prepare_run
    cfg = LowprecConfig.from_yaml(cfg_path)
    prepared = prepare_run(replace(cfg, rollout=None, eval=None), controller=False)
    if weights is not None:
        prepared.model.load_state_dict(weights)
    prepared.state.set_format(list(prepared.state.sites), "bf16")
    batches = [prepared.data.next() for _ in range(n)]
    with torch.no_grad():
        return sum(float(loss_of(prepared.model(x, y))) for x, y in batches) / n


@pytest.mark.slow
def test_profile_of_a_run_checkpoint(project, capsys):
    cfg = copy.deepcopy(GOOD)
    cfg["train"].update(steps=6, lr=3e-2)
    (project / "good.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", "good.yaml", "--out", "run"]) == 0
    ckpt = sorted((project / "run" / "checkpoints").glob("step_*.pt"))[-1]
    assert _profile("--checkpoint", str(ckpt)) == 0
    prof = json.loads((project / "out" / "profile.json").read_text())
    weights = torch.load(ckpt, weights_only=True)["model"]
    expected = _reference_loss(project / "good.yaml", weights, 2)
    untrained = _reference_loss(project / "good.yaml", None, 2)
    assert prof["reference_loss"] == pytest.approx(expected, rel=1e-6)
    assert abs(expected - untrained) > 1e-3 * abs(untrained)   # the checkpoint's weights, not the built ones
