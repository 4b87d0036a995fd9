"""`lowprec plan` and `lowprec run` reject the same configs, with the same message, exit 2.

`plan` promises to validate a config exactly as `run` does before step 0. Every bad config
below is walked through both commands (in process, for speed; two of them again as processes of
their own, forked from the session's pre-imported server `lowprec_forks`, to see the exit code and
that no traceback reaches the user).
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import yaml

from lowprec.cli import main
from tests.snapshots import folder_snapshot

GOOD = {
    "model": {"factory": "tinylm:build", "args": {"vocab": 64, "width": 32}},
    "data": {"factory": "tinylm:tokens", "block_size": 16},
    "train": {"steps": 4, "batch_size": 4, "warmup": 2, "ckpt_every": 2, "log_every": 2},
    "precision": {"backend": "emulated", "default": "bf16", "keep_high_precision": [{"fqns": ["head"]}],
                  "rules": [{"name": "mlp", "select": {"fqns": ["up", "down"]}, "format": "bf16",
                             "ladder": ["fp8_tensorwise", "bf16"]}]},
    "rollout": {"check_every": 2, "min_steps": 2,
                "stages": [{"name": "mlp", "select": {"fqns": ["up", "down"]}, "format": "fp8_tensorwise"}]},
    "tracking": {"enabled": False},
}

# name: (change, a piece of the message)
BAD = {
    "string_lr": ({"train.lr": "fast"}, "train.lr"),
    "zero_steps": ({"train.steps": 0}, "train.steps"),
    "unknown_section": ({"trian": {}}, "trian"),
    "stdlib_factory": ({"model.factory": "os:system"}, "standard library"),
    "missing_function": ({"model.factory": "tinylm:nope"}, "nope"),
    "missing_module": ({"model.factory": "no_such_module:build"}, "no_such_module"),
    "bad_model_arg_type": ({"model.args": {"vocab": 64, "width": "wide"}}, "model.args"),
    "unknown_model_arg": ({"model.args": {"vocab": 64, "colour": 1}}, "colour"),
    "not_a_module": ({"model": {"factory": "tinylm:tokens"}}, "not a torch.nn.Module"),
    "unknown_format": ({"precision.rules": [{"name": "mlp", "select": {"fqns": ["up"]}, "format": "fp9"}]}, "fp9"),
    "stage_selects_nothing": ({"rollout.stages": [{"name": "x", "select": {"glob": "nothing.*"},
                                                   "format": "fp8_tensorwise"}]}, "selects no"),
    "stage_format_off_ladder": ({"rollout.stages": [{"name": "x", "select": {"fqns": ["up"]}, "format": "nvfp4"}]},
                                "ladder"),
    "loss_gap_without_baseline": ({"rollout.thresholds": {"loss_gap": 0.01}}, "baseline"),
    "missing_data_function": ({"data.factory": "tinylm:nothing"}, "nothing"),
    "no_block_size": ({"data": {"factory": "tinylm:tokens"}}, "data.block_size"),
    "missing_gate_file": ({"eval": {"suite": "shakespeare", "gates": "no_such_gates.yaml"}}, "no_such_gates.yaml"),
    "unknown_suite": ({"eval": {"suite": "no_such_suite", "gates": None}}, "no_such_suite"),
    "unknown_evaluator": ({"eval": {"evaluator": "no_such_evaluator", "gates": None}}, "no_such_evaluator"),
    "gate_on_absent_task": ({"eval": {"suite": "shakespeare", "gates": "absent_task_gates.yaml"}}, "no_such_task"),
    # the in-loop gate `inloop` needs 8 documents of each gated task (min_samples): a cap of 4 leaves it blind
    "limit_below_the_gates_min_samples": ({"eval": {"suite": "default", "limit": 4}}, "eval.limit: 4 documents"),
    "limit_zero": ({"eval": {"suite": "default", "limit": 0}}, "eval.limit"),
    "snapshots_too_few": ({"rollout.rewind": {"enabled": True, "snapshot_every": 2, "keep": 1}}, "rollout.rewind.keep"),
    "empty_experiment": ({"tracking": {"experiment": ""}}, "tracking.experiment"),
}


def _config(change: dict) -> dict:
    cfg = copy.deepcopy(GOOD)
    for path, value in change.items():
        node = cfg
        *head, last = path.split(".")
        for k in head:
            node = node.setdefault(k, {})
        node[last] = value
    return cfg


@pytest.fixture
def project(tmp_path, monkeypatch, tiny_lm):
    tiny_lm(tmp_path)
    (tmp_path / "absent_task_gates.yaml").write_text(
        "gates:\n  - {metric: eval/no_such_task/bits_per_byte, direction: lower_is_better, "
        "max_regression: {relative: 0.03}}\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    return tmp_path


def test_the_good_config_plans_and_runs(project, capsys):
    (project / "good.yaml").write_text(yaml.safe_dump(GOOD))
    assert main(["plan", "good.yaml"]) == 0
    out = capsys.readouterr().out
    assert "up" in out and "fp8_tensorwise" in out and "rollout stages" in out
    assert main(["run", "good.yaml", "--out", "run", "--steps", "6"]) == 0   # the stage promotes after step 3
    assert (project / "run" / "losses.json").is_file()
    # the emulated backend's FP8 runs the reference GEMMs (slow path) once the stage promoted; one process gathers nothing
    paths = json.loads((project / "run" / "summary.json").read_text())["site_paths"]
    assert set(paths) == {"up", "down"}, paths
    assert all(p["fast_calls"] == 0 and p["slow_calls"] > 0 and p["all_gather"] is None for p in paths.values()), paths


@pytest.mark.parametrize("name", sorted(BAD))
def test_plan_and_run_reject_the_same_bad_config(project, capsys, name):
    change, expected = BAD[name]
    path = project / f"{name}.yaml"
    path.write_text(yaml.safe_dump(_config(change)))
    assert main(["plan", str(path)]) == 2
    plan_err = capsys.readouterr().err
    assert main(["run", str(path), "--out", str(project / "out")]) == 2
    run_err = capsys.readouterr().err
    assert expected in plan_err, plan_err
    assert plan_err.replace("lowprec plan:", "") == run_err.replace("lowprec run:", "")
    assert not (project / "out" / "checkpoints").exists()   # nothing was trained or written


def test_plan_lists_a_missing_baseline_file_that_run_refuses(project, capsys):
    """A baseline is a runtime input: `plan` prints the plan and lists it as missing (exit 0)."""
    path = project / "missing_baseline_file.yaml"
    path.write_text(yaml.safe_dump(_config({"rollout.baseline": {"losses": "missing.json"}})))
    assert main(["plan", str(path)]) == 0
    out = capsys.readouterr().out
    assert "still missing before `lowprec run` (1;" in out and "rollout.baseline.losses: 'missing.json' not found" in out
    assert main(["run", str(path), "--out", str(project / "out")]) == 2
    assert "missing.json" in capsys.readouterr().err
    assert not (project / "out" / "checkpoints").exists()


@pytest.mark.parametrize("name", ["string_lr", "stdlib_factory"])
def test_as_a_subprocess_no_traceback(project, name, lowprec_forks):
    path = project / f"{name}.yaml"
    path.write_text(yaml.safe_dump(_config(BAD[name][0])))
    for cmd in ("plan", "run"):
        p = lowprec_forks.run([cmd, str(path)], project, timeout=300)
        assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
        assert p.stderr.startswith(f"lowprec {cmd}: ")
    assert not (project / "runs").exists()


def _flip_a_weight_bit(path: Path) -> None:
    import torch
    w = torch.load(path, weights_only=True)["model"]["embed.weight"]
    raw = w.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    data = bytearray(path.read_bytes())
    at = data.find(raw[:256])
    assert at >= 0
    data[at + 100] ^= 0x01
    path.write_bytes(bytes(data))


def _tree(root: Path) -> dict:
    """Every file's size and mtime (tests/snapshots.py: no lock files, no bytecode caches)."""
    return folder_snapshot(root, contents=False)


def test_resume_skips_a_corrupt_checkpoint_and_exits_2_when_all_are(project, capsys, lowprec_forks):
    (project / "good.yaml").write_text(yaml.safe_dump(_config({"train.steps": 6})))
    assert main(["run", "good.yaml", "--out", "run"]) == 0
    ckpts = sorted((project / "run" / "checkpoints").glob("step_*.pt"))
    # every train.ckpt_every steps and the last step's (the trained weights)
    assert [p.name for p in ckpts] == ["step_00000000.pt", "step_00000002.pt", "step_00000004.pt", "step_00000006.pt"]
    full = (project / "run" / "losses.json").read_text()

    _flip_a_weight_bit(ckpts[-1])   # the newest: resume goes back to step 4 and redoes the rest
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step_00000006.pt"):
        assert main(["run", "good.yaml", "--out", "run", "--resume"]) == 0
    assert (project / "run" / "losses.json").read_text() == full   # the same losses, bit for bit
    assert (project / "run" / "checkpoints" / "abandoned" / "step_00000006.pt").is_file()  # kept aside

    for p in sorted((project / "run" / "checkpoints").glob("step_*.pt")):
        _flip_a_weight_bit(p)
    before = _tree(project)
    p = lowprec_forks.run(["run", "good.yaml", "--out", "run", "--resume"], project, timeout=300)
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert p.stderr.startswith("lowprec run: --resume: every checkpoint in run/checkpoints is unusable"), p.stderr
    for name in ("step_00000000.pt", "step_00000002.pt", "step_00000004.pt", "step_00000006.pt"):
        assert name in p.stderr
    assert _tree(project) == before   # nothing written, nothing removed


class MetricsTracker:
    """A tracker that keeps what `log_metrics` is given and takes every other call silently."""

    def __init__(self):
        self.metrics = []

    def log_metrics(self, step, metrics):
        self.metrics.append((step, dict(metrics)))

    def __getattr__(self, name):
        return lambda *a, **k: None


def test_the_loss_that_caused_a_rewind_is_tracked_under_its_own_names(project):
    from lowprec.policy.events import EventKind
    from lowprec.runtime.trainer.faults import parse_injection
    from lowprec.runtime.trainer.run import run_config

    cfg = _config({"train.steps": 20, "train.log_every": 1, "rollout.check_every": 2,
                   "rollout.rewind": {"enabled": True, "snapshot_every": 2, "keep": 4},
                   "rollout.thresholds": {"spike_min_history": 4}})
    tracker = MetricsTracker()
    res = run_config(cfg, project / "out", tracker=tracker, faults=[parse_injection("loss_spike::12:14:1000")])
    rewinds = [e.step for e in res.events if e.kind is EventKind.REWIND]
    assert res.rewinds >= 1 and rewinds
    logged = [(s, m) for s, m in tracker.metrics if "train/loss_rewound" in m]
    assert sorted(s for s, _ in logged) == sorted(set(rewinds))        # once per step that rewound
    for s, m in logged:
        assert set(m) == {"train/loss_rewound", "train/rewound_to"} and m["train/rewound_to"] < s
    # the redone step logs train/loss again; the rewound loss never shares a name with it
    assert not any("train/loss_rewound" in m and "train/loss" in m for _, m in tracker.metrics)


def test_loss_gap_baseline_named_by_mlflow_run(project, capsys):
    """The baseline run trained with --as-baseline is found by name in the store; its losses
    become the candidate's loss-gap curve (the make run flow, on a tiny model)."""
    cfg = _config({"tracking": {"uri": f"sqlite:///{project}/mlflow.db", "experiment": "gap"},
                   "rollout.thresholds": {"loss_gap": 0.5}, "rollout.baseline": {"mlflow_run": "base"}})
    (project / "gap.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["plan", "gap.yaml"]) == 0       # a plan needs no baseline: listed as missing, nothing created
    said = capsys.readouterr()
    assert "still missing" in said.out and "no tracking store" in said.out + said.err, said
    assert not (project / "mlflow.db").exists()
    assert main(["run", "gap.yaml", "--as-baseline", "--run-name", "base", "--out", "base"]) == 0
    capsys.readouterr()
    assert main(["run", "gap.yaml", "--out", "cand"]) == 0
    out = capsys.readouterr().out
    assert "baseline" in out and "gap" in out and (project / "cand" / "run_id").is_file()


def test_a_skipped_nan_step_leaves_no_hole_in_the_logged_loss_nor_in_the_summary(project):
    """A NaN step the controller skipped trained nothing: the logged window mean of
    `train/loss` and the summary's loss are over the finite steps (a NaN there left the
    report's loss curve with a gap of a whole logging window on each side)."""
    import math
    from types import SimpleNamespace
    from lowprec.policy.events import EventKind
    from lowprec.runtime.trainer.faults import parse_injection
    from lowprec.runtime.trainer.loop import RunResult
    from lowprec.runtime.trainer.run import run_config, summary_text

    cfg = _config({"train.steps": 12, "train.log_every": 4})
    tracker = MetricsTracker()
    res = run_config(cfg, project / "out", tracker=tracker, faults=[parse_injection("nan:up:5:6")])
    assert any(e.kind is EventKind.SKIP_STEP for e in res.events) and not all(map(math.isfinite, res.losses))
    logged = [m["train/loss"] for _, m in tracker.metrics if "train/loss" in m]
    assert logged and all(math.isfinite(v) for v in logged), logged
    mine = RunResult(losses=list(res.losses), seconds_per_step=0.1, events=[])   # its losses, no telemetry
    text = summary_text("r", mine, SimpleNamespace(baseline=None), project, None, "sqlite:///x.db")
    assert "finite)" in text and " nan" not in text, text


def test_plan_of_a_parallel_config_says_the_layout_and_how_to_launch_it(project, capsys):
    (project / "job.yaml").write_text(yaml.safe_dump({**GOOD, "parallel": {"dp_replicate": 2, "dp_shard": 2}}))
    assert main(["plan", "job.yaml"]) == 0
    out = capsys.readouterr().out
    assert ("parallel: dp_replicate 2 x dp_shard 2 = 4 processes: HSDP (FSDP2 sharded over dp_shard, replicated "
            "over dp_replicate)") in out, out
    assert "mesh: (dp_replicate 2, dp_shard 2); 4 data-parallel ranks, each 1 rows of train.batch_size 4" in out
    assert "launch: lowprec run --nproc-per-node 4 job.yaml --out DIR" in out
    assert "or: torchrun --nproc-per-node 4 -m lowprec.cli run job.yaml --out DIR" in out
    assert "torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d" in out
    (project / "one.yaml").write_text(yaml.safe_dump(GOOD))
    assert main(["plan", "one.yaml"]) == 0
    assert "parallel:" not in capsys.readouterr().out   # one process: no layout
