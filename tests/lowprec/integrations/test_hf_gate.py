"""`lowprec gate` between two Hugging Face Trainer runs: a BF16 run and the staged rollout,
each with lowprec's callback, an `eval:` suite (lm-eval tasks over local text) at the end,
and the Trainer's MLflow reporting on. The rollout rewinds once (a loss spike on two steps),
so lowprec's own count ends short of the Trainer's; its evals are recorded at the Trainer's
step, and the gate reads both runs like any other pair (issue 54: it exited 2).

The rollout's console holds only the Trainer's lines and lowprec's: lm-eval's, datasets' and
MLflow's own lines (issue 54: "bootstrapping for stddev", "Generating test split" bars, MLflow
INFO records) go to the run's `lowprec/lowprec.log`."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from llama_helpers import (BF16_CONFIG, CONFIG, FINAL_EVAL, NO_PICTURES, gate_table, shakespeare_blocks,  # noqa: E402
                           tiny_llama)

# the Trainer's own lines (its logged metrics; disable_tqdm) and lowprec's (`lowprec`, a name, a colon)
TRAINER_LINE, LOWPREC_LINE = re.compile(r"^\{'\w+': "), re.compile(r"^lowprec( [\w.-]+)*: ")
GATED = ("eval/heldout_shakespeare/bits_per_byte", "eval/cloze_shakespeare/acc", "eval/shift_milton/bits_per_byte")


def _train(tmp: Path, name: str, config: str, spike_at: int | None = None) -> tuple[str, list[str]]:
    import mlflow
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from lowprec.integrations.hf import LowprecCallback
    from lowprec.runtime.trainer.faults import FaultKind, Faults, Injection

    class Tick(TrainerCallback):
        def __init__(self, faults):
            self.faults = faults

        def on_step_begin(self, args, state, control, **kw):
            self.faults.tick(state.global_step)
    (tmp / f"{name}.yaml").write_text(config + FINAL_EVAL + NO_PICTURES)
    model = tiny_llama()
    lp = LowprecCallback.from_yaml(tmp / f"{name}.yaml", model)
    spikes = [Injection(FaultKind.LOSS_SPIKE, spike_at, spike_at + 2, factor=100.0)] if spike_at is not None else []
    tick = Tick(Faults(model, spikes))
    args = TrainingArguments(output_dir=str(tmp / name), run_name=name, max_steps=25, per_device_train_batch_size=8,
                             learning_rate=3e-3, warmup_steps=5, logging_steps=10, report_to=["mlflow"],
                             use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=shakespeare_blocks(8 * 50), callbacks=[lp, tick]).train()
    run = mlflow.last_active_run()
    assert lp.hosted.tracker.run_id == run.info.run_id   # lowprec tracked into the Trainer's run
    assert lp.session.rewinds == (1 if spike_at is not None else 0) and (lp.step < 25) == (spike_at is not None)
    return run.info.run_id, [str(e.kind) for e in lp.hosted.session.events]


@pytest.mark.slow
def test_gate_compares_a_rollout_trainer_run_with_a_bf16_one(tmp_path, monkeypatch, sqlite_store, lowprec_forks,
                                                             capfd):
    uri = sqlite_store(tmp_path)   # a copy of the session's migrated store: no schema migration here
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)   # the Trainer's MLflow reporting reads these
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hf-gate")
    baseline, _ = _train(tmp_path, "bf16", BF16_CONFIG)
    capfd.readouterr()   # the first run: imports' and the new experiment's lines
    candidate, kinds = _train(tmp_path, "rollout", CONFIG.replace("tracking: {experiment: hf-integration}\n", ""),
                              spike_at=17)
    out, err = capfd.readouterr()
    lines = [line for line in (out + err).replace("\r", "\n").splitlines() if line.strip()]
    assert any(TRAINER_LINE.match(line) for line in lines) and any(LOWPREC_LINE.match(line) for line in lines)
    assert not [line for line in lines if not (TRAINER_LINE.match(line) or LOWPREC_LINE.match(line))], lines
    assert "bootstrapping for stddev" in (tmp_path / "rollout" / "lowprec" / "lowprec.log").read_text()
    assert baseline != candidate
    assert kinds.count("promote") >= 1 and "rewind" in kinds, kinds   # the MLP stage promoted (step 14), a rewind
    from mlflow.tracking import MlflowClient
    client = MlflowClient(uri)
    final = {rid: {m.step for m in client.get_metric_history(rid, "eval/heldout_shakespeare/bits_per_byte")}
             for rid in (baseline, candidate)}
    assert {rid: max(steps) for rid, steps in final.items()} == {baseline: 25, candidate: 25}   # the Trainer's last step
    table = gate_table(lowprec_forks, baseline, candidate, uri, tmp_path / "gate.md")
    assert all(metric in table for metric in GATED)
