"""`lowprec gate` between two Hugging Face Trainer runs: a BF16 run and the staged rollout,
each with lowprec's callback, an `eval:` suite (lm-eval tasks over local text) at the end,
and the Trainer's MLflow reporting on. The gate reads both runs like any other pair."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from llama_helpers import BF16_CONFIG, CONFIG, FINAL_EVAL, gate_table, shakespeare_blocks, tiny_llama  # noqa: E402

GATED = ("eval/heldout_shakespeare/bits_per_byte", "eval/cloze_shakespeare/acc", "eval/shift_milton/bits_per_byte")


def _train(tmp: Path, name: str, config: str) -> tuple[str, list[str]]:
    import mlflow
    from transformers import Trainer, TrainingArguments

    from lowprec.integrations.hf import LowprecCallback
    (tmp / f"{name}.yaml").write_text(config + FINAL_EVAL)
    model = tiny_llama()
    lp = LowprecCallback.from_yaml(tmp / f"{name}.yaml", model)
    args = TrainingArguments(output_dir=str(tmp / name), run_name=name, max_steps=25, per_device_train_batch_size=8,
                             learning_rate=3e-3, warmup_steps=5, logging_steps=10, report_to=["mlflow"],
                             use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=shakespeare_blocks(8 * 50), callbacks=[lp]).train()
    run = mlflow.last_active_run()
    assert lp.hosted.tracker.run_id == run.info.run_id   # lowprec tracked into the Trainer's run
    return run.info.run_id, [str(e.kind) for e in lp.hosted.session.events]


@pytest.mark.slow
def test_gate_compares_a_rollout_trainer_run_with_a_bf16_one(tmp_path, monkeypatch, sqlite_store, lowprec_forks):
    uri = sqlite_store(tmp_path)   # a copy of the session's migrated store: no schema migration here
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)   # the Trainer's MLflow reporting reads these
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hf-gate")
    baseline, _ = _train(tmp_path, "bf16", BF16_CONFIG)
    candidate, kinds = _train(tmp_path, "rollout", CONFIG.replace("tracking: {experiment: hf-integration}\n", ""))
    assert baseline != candidate
    assert kinds.count("promote") == 2, kinds   # 25 steps: both stages promoted (steps 14 and 24) before the eval
    table = gate_table(lowprec_forks, baseline, candidate, uri, tmp_path / "gate.md")
    assert all(metric in table for metric in GATED)
