"""`lowprec gate` between two Lightning runs: a BF16 run and the staged rollout, each with
lowprec's callback, an `eval:` suite at the end, and Lightning's MLFlowLogger (lowprec tracks
into the logger's run). The rollout's console holds none of lm-eval's, datasets' or MLflow's own
lines: they go to `default_root_dir/lowprec/lowprec.log` (issue 54)."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("lightning")

from lightning_helpers import LlamaModule, experiment, loader  # noqa: E402
from llama_helpers import BF16_CONFIG, CONFIG, FINAL_EVAL, NO_PICTURES, gate_table  # noqa: E402
from test_hf_gate import GATED  # noqa: E402

# what lm-eval, datasets and MLflow print while lowprec evaluates and tracks (Lightning's own lines,
# which a lowprec-free run prints alike, are not lowprec's to route)
LIBRARY_NOISE = ("bootstrapping for stddev", "Generating test split", "it/s]", " INFO mlflow", "examples/s]")


def _train(tmp: Path, name: str, config: str, uri: str) -> tuple[str, list[str]]:
    import lightning
    from lightning.pytorch.loggers import MLFlowLogger

    from lowprec.integrations.lightning import LowprecCallback
    (tmp / f"{name}.yaml").write_text(config + FINAL_EVAL + NO_PICTURES)
    module = LlamaModule()
    callback = LowprecCallback.from_yaml(tmp / f"{name}.yaml", module.model)
    logger = MLFlowLogger(experiment_name="lightning-gate", tracking_uri=uri, run_name=name)
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=25, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, logger=logger,
                                log_every_n_steps=10, default_root_dir=str(tmp / name), callbacks=[callback])
    trainer.fit(module, loader(8 * 50))
    assert callback.hosted.tracker.run_id == logger.run_id   # one run: the logger's
    return logger.run_id, [str(e.kind) for e in callback.hosted.session.events]


@pytest.mark.slow
def test_gate_compares_a_rollout_lightning_run_with_a_bf16_one(tmp_path, sqlite_store, lowprec_forks, capfd):
    uri = sqlite_store(tmp_path)   # a copy of the session's migrated store: no schema migration here
    experiment(uri, "lightning-gate", tmp_path)
    baseline, _ = _train(tmp_path, "bf16", BF16_CONFIG, uri)
    capfd.readouterr()
    candidate, kinds = _train(tmp_path, "rollout", CONFIG.replace("tracking: {experiment: hf-integration}\n", ""), uri)
    out, err = capfd.readouterr()
    noise = [line for line in (out + err).replace("\r", "\n").splitlines()
             if any(mark in line for mark in LIBRARY_NOISE)]
    assert not noise, noise
    assert "bootstrapping for stddev" in (tmp_path / "rollout" / "lowprec" / "lowprec.log").read_text()
    assert baseline != candidate
    assert kinds.count("promote") == 2, kinds   # 25 steps: both stages promoted (steps 14 and 24) before the eval
    table = gate_table(lowprec_forks, baseline, candidate, uri, tmp_path / "gate.md")
    assert all(metric in table for metric in GATED)
