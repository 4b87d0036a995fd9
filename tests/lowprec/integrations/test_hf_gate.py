"""`lowprec gate` between two Hugging Face Trainer runs: a BF16 run and the staged rollout,
each with lowprec's callback, an `eval:` suite (lm-eval tasks over local text) at the end,
and the Trainer's MLflow reporting on. The gate reads both runs like any other pair."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from llama_helpers import CONFIG, shakespeare_blocks, tiny_llama  # noqa: E402

ROOT = Path(__file__).resolve().parents[3]
LOWPREC = Path(sys.executable).with_name("lowprec")
EVAL = "eval: {suite: default, every: 0, mode: fast, final_mode: fast, gates: null, high_precision: false}\n"
BF16 = """\
precision:
  backend: emulated
  default: bf16
  keep_high_precision: [{fqns: [lm_head]}]
  rules:
    - {name: all, select: {module_type: Linear}, format: bf16}
"""


def _train(tmp: Path, name: str, config: str, monkeypatch) -> str:
    import mlflow
    from transformers import Trainer, TrainingArguments

    from lowprec.integrations.hf import LowprecCallback
    (tmp / f"{name}.yaml").write_text(config + EVAL)
    model = tiny_llama()
    lp = LowprecCallback.from_yaml(tmp / f"{name}.yaml", model)
    args = TrainingArguments(output_dir=str(tmp / name), run_name=name, max_steps=40, per_device_train_batch_size=8,
                             learning_rate=3e-3, warmup_steps=5, logging_steps=10, report_to=["mlflow"],
                             use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=shakespeare_blocks(8 * 50), callbacks=[lp]).train()
    run = mlflow.last_active_run()
    assert lp.hosted.tracker.run_id == run.info.run_id   # lowprec tracked into the Trainer's run
    return run.info.run_id


@pytest.mark.slow
def test_gate_compares_a_rollout_trainer_run_with_a_bf16_one(tmp_path, monkeypatch):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)   # the Trainer's MLflow reporting reads these
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hf-gate")
    baseline = _train(tmp_path, "bf16", BF16, monkeypatch)
    candidate = _train(tmp_path, "rollout", CONFIG.replace("tracking: {experiment: hf-integration}\n", ""),
                       monkeypatch)
    assert baseline != candidate
    p = subprocess.run([str(LOWPREC), "gate", "--baseline", baseline, "--candidate", candidate,
                        "--gates", str(ROOT / "gates" / "inloop.yaml"), "--tracking-uri", uri,
                        "--markdown", str(tmp_path / "gate.md")], capture_output=True, text=True, timeout=300)
    assert p.returncode in (0, 1), p.stdout + p.stderr   # a verdict (pass or regression), not unusable input
    table = (tmp_path / "gate.md").read_text()
    for metric in ("eval/heldout_shakespeare/bits_per_byte", "eval/cloze_shakespeare/acc", "eval/shift_milton/bits_per_byte"):
        assert metric in table
