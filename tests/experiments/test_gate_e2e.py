"""End to end: real training runs in a real MLflow SQLite store, then `lowprec gate` on them.

A small GPT is trained on Shakespeare three times with the same seed and data: in BF16 (the
baseline), with every block's linear layers in FP8 (tensor-wise current scaling: the
candidate that should pass), and with every linear layer in FP4 E2M1 with one scale per
tensor and none of the NVFP4 tricks (the planted regression). Each run is tracked with
lowprec.tracking.tracker.Tracker and ends with a full-mode `shakespeare` eval (held-out plays,
cloze; the first 128 documents of each) logged with per-example scores. The pass and the fail
verdicts come from the gate command run as a real subprocess, so their exit codes are the ones CI sees; the unusable-input cases call
`lowprec.cli.main`, the function the `lowprec` command exits with, in this process (the same
handler, status and stderr line, without three more process starts; tests/lowprec/gates/
test_gate_cli.py runs such cases as subprocesses).
"""

import copy
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from lowprec.runtime.trainer.run import run_config
from lowprec.tracking.tracker import Tracker

pytestmark = pytest.mark.slow

CFG = {
    "model": {"factory": "experiments.model:build_gpt",
              "args": {"vocab_size": 256, "block_size": 64, "n_layer": 2, "n_head": 2, "d_model": 64}},
    "data": {"factory": "experiments.data:shakespeare_tokens", "args": {"max_bytes": 2_000_000}, "block_size": 64},
    # 60 steps are enough to tell them apart: held-out bits per byte 3.83 (BF16), 3.82 (FP8), 5.12 (FP4)
    "train": {"steps": 60, "batch_size": 16, "lr": 3e-3, "warmup": 10, "ckpt_every": 1000, "seed": 0},
    "precision": {"backend": "emulated", "rules": [
        {"name": "every_linear", "select": {"module_type": "Linear"}, "format": "bf16"}]},
    # the full sets' first 128 documents a task (eval.limit): enough for the gates' min_samples and their power
    "eval": {"suite": "shakespeare", "every": 0, "final_mode": "full", "high_precision": False, "gates": None,
             "limit": 128},
}
GATES = """
defaults: {statistic: paired_bootstrap, confidence: 0.95, min_samples: 50}
gates:
  - metric: eval/heldout_shakespeare/bits_per_byte
    direction: lower_is_better
    max_regression: {relative: 0.03}
  - metric: eval/cloze_shakespeare/acc
    direction: higher_is_better
    max_regression: {absolute: 0.05}
    informational: true      # ~0.1% on this small model: it cannot fire, so `lowprec gate` would refuse it
"""


def _config(blocks: str, lm_head: str) -> dict:
    cfg = copy.deepcopy(CFG)
    cfg["precision"]["rules"] = [
        {"name": "lm_head", "select": {"fqns": ["lm_head"]}, "format": lm_head},
        {"name": "blocks", "select": {"glob": "blocks.*"}, "format": blocks}]
    return cfg


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("gate_e2e")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    runs = {}
    for name, cfg in (("bf16", _config("bf16", "bf16")),
                      ("fp8", _config("fp8_tensorwise", "bf16")),
                      ("fp4_planted", _config("fp4_tensorwise", "fp4_tensorwise"))):
        tracker = Tracker(uri, "gate-e2e", name, buffer_dir=root / name / "tracking")
        res = run_config(cfg, root / name, controller=False, tracker=tracker)
        tracker.finish("FINISHED", report=False)   # the gate reads numbers: no pictures
        runs[name] = (tracker.run_id, res)
    gates = root / "gates.yaml"
    gates.write_text(GATES)
    return root, uri, runs, gates


def _gate(uri, base, cand, gates, *extra):
    cmd = [str(Path(sys.executable).parent / "lowprec"), "gate", "--baseline", base, "--candidate", cand,
           "--gates", str(gates), "--tracking-uri", uri, *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_fp8_candidate_passes(store):
    root, uri, runs, gates = store
    md, junit = root / "summary.md", root / "gate.xml"
    p = _gate(uri, runs["bf16"][0], runs["fp8"][0], gates, "--markdown", str(md), "--junit", str(junit))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "PASS" in p.stdout and "eval/heldout_shakespeare/bits_per_byte" in p.stdout
    assert "pass" in md.read_text()
    cases = ET.parse(junit).getroot().iter("testcase")
    assert sorted(c.get("name") for c in cases) == ["eval/cloze_shakespeare/acc",
                                                    "eval/heldout_shakespeare/bits_per_byte"]


def test_planted_fp4_regression_fails_and_names_the_metric(store):
    root, uri, runs, gates = store
    base, bad = runs["bf16"][1], runs["fp4_planted"][1]
    # the planted candidate is really worse: far more bits per byte on held-out text
    bpb = lambda r: r.final_eval.results["heldout_shakespeare"]["bits_per_byte"]  # noqa: E731
    assert bpb(bad) > 1.05 * bpb(base)
    p = _gate(uri, runs["bf16"][0], runs["fp4_planted"][0], gates)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "REGRESS" in p.stdout
    assert "eval/heldout_shakespeare/bits_per_byte" in p.stdout.split("REGRESS")[-1]


def test_logged_numbers_are_the_suites(store):
    """What MLflow holds for a run is what lm-eval computed for it (through the adapter)."""
    from mlflow.tracking import MlflowClient
    _, uri, runs, _ = store
    run_id, res = runs["bf16"]
    metrics = MlflowClient(uri).get_run(run_id).data.metrics
    for task, values in res.final_eval.results.items():
        for name, v in values.items():
            assert metrics[f"eval/{task}/{name}"] == pytest.approx(v, rel=1e-12, abs=1e-12)
    acc = res.final_eval.samples["cloze_shakespeare"]["acc"]
    assert metrics["eval/cloze_shakespeare/acc"] == pytest.approx(sum(acc.values()) / len(acc), abs=1e-12)


@pytest.mark.parametrize("case", ["bad_run", "bad_metric", "bad_file"])
def test_unusable_input_exits_2(store, case, capsys):
    from lowprec.cli import main

    root, uri, runs, gates = store
    base, cand = runs["bf16"][0], runs["fp8"][0]
    if case == "bad_run":
        cand, expect = "0" * 32, ["0" * 32]
    elif case == "bad_metric":
        gates = root / "bad_metric.yaml"
        gates.write_text(GATES.replace("eval/cloze_shakespeare/acc", "eval/cloze_shakespeare/accuracy"))
        expect = ["eval/cloze_shakespeare/accuracy", "eval/cloze_shakespeare/acc"]
    else:
        gates = root / "bad_file.yaml"
        gates.write_text(GATES.replace("lower_is_better", "lower"))
        expect = ["lower_is_better"]
    capsys.readouterr()
    code = main(["gate", "--baseline", base, "--candidate", cand, "--gates", str(gates), "--tracking-uri", uri])
    out, err = capsys.readouterr()
    assert code == 2, out + err
    assert "Traceback" not in err and err.startswith("lowprec gate: "), err
    for part in expect:
        assert part in err, (part, err)
