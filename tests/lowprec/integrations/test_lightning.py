"""lowprec's Lightning callback in a real `lightning.Trainer` on CPU: the tiny Llama on
Shakespeare, AdamW and a warmup LambdaLR stepped every step. One faulted run (lightning_helpers.train)
serves the rollout, skip, rewind and MLflow tests; short runs check clipping, lowprec's own
tracking and the refusals."""

from __future__ import annotations

import importlib
import os
import signal
import sys

import pytest

# real framework runs (a Trainer each): in `make test`, not in the fast subset
pytestmark = pytest.mark.slow
import torch

pytest.importorskip("lightning")
pytest.importorskip("transformers")

import lightning  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException  # noqa: E402
from mlflow.tracking import MlflowClient  # noqa: E402

from lightning_helpers import (NAN_AT, NAN_SITE, SPIKE_AT, STEPS, LlamaModule, Watch, experiment,  # noqa: E402
                               loader, params, train)
from llama_helpers import CONFIG, same_state  # noqa: E402
from lowprec.base.parse import ConfigError  # noqa: E402
from lowprec.policy.events import EventKind  # noqa: E402
from lowprec.integrations.extras import MissingExtraError  # noqa: E402
from lowprec.integrations.lightning import LowprecCallback  # noqa: E402
from lowprec.runtime.trainer.faults import FaultKind, Faults, Injection  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    return train(tmp_path_factory.mktemp("lightning"))


def _kinds(cb, kind):
    return [e for e in cb.session.events if e.kind == kind]


def test_stages_promote(run):
    cb = run.callback
    assert [e.stage for e in _kinds(cb, EventKind.PROMOTE)] == ["mlp_fp8", "attn_fp8"]
    formats = cb.state.formats()
    assert {f for s, f in formats.items() if ".self_attn." in s} == {"fp8_tensorwise"}
    assert {f for s, f in formats.items() if ".mlp." in s and s != NAN_SITE} == {"fp8_tensorwise"}


def test_nan_skips_the_step_and_demotes_its_layer(run):
    cb, watch = run.callback, run.watch
    assert [s[0] for s in watch.skips][0] == NAN_AT
    _, (w_before, opt_before, lr_before), (w_after, opt_after, lr_after) = watch.skips[0]
    assert same_state(opt_before, opt_after)          # AdamW's moments and step count untouched
    assert all(torch.equal(w_before[k], w_after[k]) for k in w_before)
    # the step after it is applied: the comparison above can tell a step from none
    assert lr_after == lr_before + 1                 # Lightning stepped the scheduler, as lowprec's loop does
    _, opt_next, _ = watch.at_step[NAN_AT + 2]
    assert not same_state(opt_after, opt_next)
    fallbacks = _kinds(cb, EventKind.FALLBACK)
    assert [(e.step, list(e.sites)) for e in fallbacks] == [(NAN_AT, [NAN_SITE])]
    assert cb.state.formats()[NAN_SITE] == "bf16"
    skip = [e for e in _kinds(cb, EventKind.SKIP_STEP) if e.step == NAN_AT]
    assert len(skip) == 1


def test_loss_spike_rewinds_to_the_weights_of_that_step(run):
    cb, watch = run.callback, run.watch
    assert cb.session.rewinds == 1 and len(watch.rewinds) == 1
    back, weights, opt, lr_steps = watch.rewinds[0]
    assert back < SPIKE_AT and [e.step for e in _kinds(cb, EventKind.REWIND)] == [SPIKE_AT + 1]
    then_weights, then_opt, then_lr_steps = watch.at_step[back]
    assert all(torch.equal(weights[k], then_weights[k]) for k in weights)
    assert same_state(opt, then_opt)
    assert lr_steps == then_lr_steps == back          # the scheduler went back too
    # Lightning's count never goes back; lowprec's is short by the steps undone
    assert run.trainer.global_step == STEPS
    assert cb.step == STEPS - (SPIKE_AT + 2 - back)


def test_one_mlflow_run_with_lightning_and_lowprec(run):
    client = MlflowClient(run.tracking_uri)
    runs = [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])]
    assert len(runs) == 1
    r = runs[0]
    assert r.info.run_id == run.trainer.logger.run_id and r.info.status == "FINISHED"
    # the logger's experiment, not the YAML's (hf-integration): lowprec's tracker knows where it logs
    assert run.callback.hosted.tracker.experiment == "lightning-integration"
    tags = r.data.tags
    assert tags["lowprec.fallbacks"] == "1" and NAN_SITE in tags["lowprec.fallback_sites"]
    assert tags["lowprec.rewinds"] == "1" and tags["lowprec.stages_promoted"] == "mlp_fp8, attn_fp8"
    metrics = r.data.metrics
    # Lightning's self.log, with the values the steps logged (a replay's training_step logs nothing)
    logged = client.get_metric_history(r.info.run_id, "train_loss")
    assert len(logged) >= STEPS // 5 - 1
    assert all(m.value == pytest.approx(run.watch.losses[m.step], rel=1e-6) for m in logged)
    assert "train/loss" in metrics and any(k.startswith("signal/") for k in metrics)   # lowprec's
    pictures = [a.path for a in client.list_artifacts(r.info.run_id, "report")]
    assert "report/loss.png" in pictures and len([p for p in pictures if p.endswith(".png")]) >= 2


class _Norms(lightning.pytorch.Callback):
    """After lowprec's on_before_optimizer_step: the clip value Lightning would use, and the
    gradients' norm as the optimizer will see it."""
    def __init__(self):
        self.clip_vals, self.norms = [], []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        self.clip_vals.append(trainer.gradient_clip_val)
        grads = [p.grad for p in pl_module.parameters() if p.grad is not None]
        self.norms.append(float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))))


def test_clipping_is_lowprecs_and_sees_the_norm_before_it(tmp_path, sqlite_store):
    """gradient_clip_val=0.05: lowprec clips at that value (Lightning's is off meanwhile),
    measures the norm before clipping, and tracks into its own run (no MLflow logger)."""
    uri = sqlite_store(tmp_path / "store")
    cfg = CONFIG.replace("tracking: {experiment: hf-integration}", f"tracking: {{experiment: own, uri: '{uri}'}}")
    (tmp_path / "lowprec.yaml").write_text(cfg)
    experiment(uri, "own", tmp_path)
    module = LlamaModule()
    cb = LowprecCallback.from_yaml(tmp_path / "lowprec.yaml", module.model)
    norms = _Norms()
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=6, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, logger=False,
                                gradient_clip_val=0.05, default_root_dir=str(tmp_path), callbacks=[cb, norms])
    trainer.fit(module, loader(48))
    assert norms.clip_vals == [None] * 6 and trainer.gradient_clip_val == 0.05   # restored at the end
    assert max(norms.norms) <= 0.05 * (1 + 1e-4)
    client = MlflowClient(uri)
    (r,) = client.search_runs([client.get_experiment_by_name("own").experiment_id])
    seen = [m.value for m in client.get_metric_history(r.info.run_id, "train/grad_norm")]
    assert len(seen) == 6 and min(seen) > 0.05     # the norms before clipping


class _Stopped(LlamaModule):
    """Stopped in its third step as a user stops a run: Ctrl-C (KeyboardInterrupt) or SIGTERM."""
    def __init__(self, how: str):
        super().__init__()
        self.how = how

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 2:
            if self.how == "SIGINT":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)   # Lightning's handler: SIGTERMException at the batch's end
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("how", ["SIGINT", "SIGTERM"])
def test_a_signal_ends_the_run_killed_with_the_reason_not_failed(tmp_path, how, sqlite_store):
    """Lightning hands Ctrl-C and SIGTERM to on_exception: the MLflow run is KILLED and tagged
    `lowprec.stopped` with the signal (resumable), as `lowprec run` marks a stopped run, never FAILED."""
    uri = sqlite_store(tmp_path / "store")
    cfg = CONFIG.replace("tracking: {experiment: hf-integration}", f"tracking: {{experiment: stop, uri: '{uri}'}}")
    (tmp_path / "lowprec.yaml").write_text(cfg)
    experiment(uri, "stop", tmp_path)
    module = _Stopped(how)
    cb = LowprecCallback.from_yaml(tmp_path / "lowprec.yaml", module.model)
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=6, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, logger=False,
                                default_root_dir=str(tmp_path), callbacks=[cb])
    with pytest.raises(SystemExit):   # Lightning's own exit for both
        trainer.fit(module, loader(48))
    client = MlflowClient(uri)
    (r,) = client.search_runs([client.get_experiment_by_name("stop").experiment_id])
    assert r.info.status == "KILLED"
    assert r.data.tags["lowprec.stopped"].startswith(f"{how}")
    assert "ckpt_path" in r.data.tags["lowprec.stopped"]


@pytest.mark.parametrize("extra, match", [
    ("rollout:\n  lr_probe: {enabled: true}\n", "lr_probe"),
    ("model: {name: llama}\n", "model"),
])
def test_config_the_framework_cannot_run_is_refused(tmp_path, extra, match):
    text = CONFIG.replace("rollout:\n", "rollout:\n  lr_probe: {enabled: true}\n") if "lr_probe" in extra \
        else CONFIG + extra
    (tmp_path / "lowprec.yaml").write_text(text)
    with pytest.raises(ConfigError, match=match):
        LowprecCallback.from_yaml(tmp_path / "lowprec.yaml", LlamaModule().model)


class _Manual(LlamaModule):
    def __init__(self):
        super().__init__()
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = self.model(**batch).loss
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()


def test_manual_optimization_is_refused(tmp_path):
    module = _Manual()
    (tmp_path / "lowprec.yaml").write_text(CONFIG)
    cb = LowprecCallback.from_yaml(tmp_path / "lowprec.yaml", module.model)
    before = params(module)
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=2, enable_checkpointing=False,
                                enable_progress_bar=False, logger=False, default_root_dir=str(tmp_path),
                                callbacks=[cb])
    with pytest.raises(MisconfigurationException, match="manual optimization"):
        trainer.fit(module, loader(16))
    assert all(torch.equal(before[k], v) for k, v in params(module).items())   # refused before any step


def test_without_lightning_the_import_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.delitem(sys.modules, "lowprec.integrations.lightning", raising=False)
    with pytest.raises(MissingExtraError, match=r"lowprec\[lightning\]"):
        importlib.import_module("lowprec.integrations.lightning")


def test_lightning_module_with_accumulation_and_evals(tmp_path, sqlite_store):
    """The callback on the LightningModule itself (FQNs relative to it), two micro-batches per
    step: the NaN step's replays re-run both through training_step, demote exactly its layer
    and skip the step; the `eval:` suite runs at its checkpoints through eval_forward."""
    uri = sqlite_store(tmp_path / "store")
    cfg = (CONFIG.replace("fqns: [lm_head]", "fqns: [model.lm_head]")
           .replace("tracking: {experiment: hf-integration}", f"tracking: {{experiment: acc, uri: '{uri}'}}")
           + "eval: {suite: shakespeare, every: 10, mode: fast, final_mode: fast, gates: null, batch_size: 8, limit: 8}\n")
    (tmp_path / "lowprec.yaml").write_text(cfg)
    experiment(uri, "acc", tmp_path)
    module = LlamaModule()
    with pytest.raises(MisconfigurationException, match="eval_forward"):
        LowprecCallback.from_yaml(tmp_path / "lowprec.yaml", module)   # no forward() to evaluate with
    cb = LowprecCallback.from_yaml(tmp_path / "lowprec.yaml", module,
                                   eval_forward=lambda tokens: module.model(tokens).logits)
    nan_at = 16
    faults = Faults(module.model, [Injection(FaultKind.NAN, nan_at, nan_at + 1, NAN_SITE)])
    watch = Watch(cb, faults)
    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=nan_at + 2, accumulate_grad_batches=2,
                                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                                logger=False, default_root_dir=str(tmp_path), callbacks=[cb, watch])
    trainer.fit(module, loader(2 * 8 * (nan_at + 2), batch_size=8))
    site = "model." + NAN_SITE
    assert [(e.step, list(e.sites)) for e in _kinds(cb, EventKind.FALLBACK)] == [(nan_at, [site])]
    assert [e.step for e in _kinds(cb, EventKind.SKIP_STEP)] == [nan_at]
    # the skipped step's two micro-batches: the second one's end is where the step concluded
    (_, (w_before, opt_before, _), (w_after, opt_after, _)), = watch.skips
    assert same_state(opt_before, opt_after) and all(torch.equal(w_before[k], w_after[k]) for k in w_before)
    assert cb.state.formats()[site] == "bf16" and cb.step == nan_at + 2
    # the replays ran both micro-batches, each divided by 2 as Lightning divides them: a clean
    # replay's loss is the loss of a step like its neighbours (twice it with no division)
    clean = [e.evidence["loss"] for e in _kinds(cb, EventKind.REPLAY) if not e.evidence["anomalous"]]
    around = cb.hosted.losses[nan_at - 1]
    assert clean and all(abs(loss - around) < 0.1 * around for loss in clean)
    client = MlflowClient(uri)
    (r,) = client.search_runs([client.get_experiment_by_name("acc").experiment_id])
    history = client.get_metric_history(r.info.run_id, "eval/heldout_shakespeare/bits_per_byte")
    assert {m.step for m in history} >= {10, nan_at + 2}   # every 10 steps and the final eval
