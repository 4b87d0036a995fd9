"""The Hugging Face Trainer with lowprec's callback: a real `Trainer` on CPU training a small
`LlamaForCausalLM` (random init) on Shakespeare bytes.

One run shows it all: the two stages promote; a NaN injected into one layer's output while
that layer runs in FP8 skips the step (optimizer state and weights bit-identical across it)
and demotes exactly that layer; a loss spike on two consecutive steps rewinds, and the
weights and optimizer state after the rewind equal the ones the run had at the step it went
back to; the Trainer's MLflow reporting and lowprec share one run, which holds the events,
the signals, the pictures and the Trainer's own metrics.
"""

from __future__ import annotations

import importlib
import sys

import pytest

# real framework runs (a Trainer each): in `make test`, not in the fast subset
pytestmark = pytest.mark.slow
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from llama_helpers import CONFIG, optimizer_state, same_state, shakespeare_blocks, tiny_llama  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from lowprec.base.parse import ConfigError  # noqa: E402
from lowprec.policy.events import EventKind  # noqa: E402
from lowprec.integrations.hf import LowprecCallback  # noqa: E402
from lowprec.runtime.trainer.faults import FaultKind, Faults, Injection  # noqa: E402

NAN_SITE = "model.layers.0.mlp.down_proj"
NAN_AT, SPIKE_AT = 30, 40   # Trainer steps


class Recorder(TrainerCallback):
    """After lowprec's callback: ticks the faults and records what each step did to the
    optimizer state and the weights."""

    def __init__(self, lowprec: LowprecCallback, faults: Faults, nan_at: int = NAN_AT):
        self.lp, self.faults, self.nan_at = lowprec, faults, nan_at
        self.before: dict[int, tuple] = {}      # Trainer step -> (optimizer state, weights) before optimizer.step
        self.after: dict[int, tuple] = {}
        self.at_step: dict[int, tuple] = {}     # lowprec step -> (optimizer state, weights) at its start
        self.rewinds: list[tuple[int, bool, bool]] = []   # (back, weights equal, optimizer state equal)
        self._rewinds = 0

    def _now(self, optimizer):
        return optimizer_state(optimizer.optimizer), {k: v.detach().clone() for k, v in self.lp.model.state_dict().items()}

    def on_step_begin(self, args, state, control, **kw):
        self.faults.tick(state.global_step)

    def on_pre_optimizer_step(self, args, state, control, optimizer=None, **kw):
        if state.global_step in (self.nan_at, self.nan_at - 1):
            self.before[state.global_step] = self._now(optimizer)

    def on_step_end(self, args, state, control, optimizer=None, **kw):
        now = self._now(optimizer)
        if state.global_step - 1 in self.before:
            self.after[state.global_step - 1] = now
        if self.lp.session.rewinds > self._rewinds:
            self._rewinds = self.lp.session.rewinds
            back = self.lp.step
            opt, weights = self.at_step[back]
            self.rewinds.append((back, all(torch.equal(weights[k], now[1][k]) for k in weights),
                                 same_state(opt, now[0])))
        self.at_step[self.lp.step] = now


@pytest.fixture(scope="module")
def hf_run(tmp_path_factory, sqlite_store):
    tmp = tmp_path_factory.mktemp("hf")
    (tmp / "lowprec.yaml").write_text(CONFIG)
    uri = sqlite_store(tmp)   # a migrated store (a copy of the session's)
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", uri)   # the Trainer's MLflow reporting is configured this way
    mp.setenv("MLFLOW_EXPERIMENT_NAME", "hf-integration")
    try:
        model = tiny_llama()
        lp = LowprecCallback.from_yaml(tmp / "lowprec.yaml", model)
        faults = Faults(model, [Injection(FaultKind.NAN, NAN_AT, NAN_AT + 1, NAN_SITE),
                                Injection(FaultKind.LOSS_SPIKE, SPIKE_AT, SPIKE_AT + 2, factor=100.0)])
        rec = Recorder(lp, faults)
        args = TrainingArguments(output_dir=str(tmp / "out"), max_steps=50, per_device_train_batch_size=8,
                                 learning_rate=3e-3, warmup_steps=5, logging_steps=5, report_to=["mlflow"],
                                 use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=shakespeare_blocks(8 * 60), callbacks=[lp, rec])
        trainer.train()
    finally:
        mp.undo()
    return lp, rec, trainer, uri


def test_stages_promote(hf_run):
    lp = hf_run[0]
    promoted = [e.stage for e in lp.session.events if e.kind == EventKind.PROMOTE]
    assert promoted == ["mlp_fp8", "attn_fp8"]
    assert lp.state.formats()["model.layers.1.mlp.down_proj"] == "fp8_tensorwise"
    assert lp.state.formats()["model.layers.0.self_attn.q_proj"] == "fp8_tensorwise"


def test_nan_skips_the_step_and_demotes_that_layer(hf_run):
    lp, rec = hf_run[0], hf_run[1]
    at_nan = [e for e in lp.session.events if e.step == NAN_AT]
    fallbacks = [e for e in at_nan if e.kind == EventKind.FALLBACK]
    assert [e.sites for e in fallbacks] == [(NAN_SITE,)]
    assert any(e.kind == EventKind.SKIP_STEP for e in at_nan)
    assert lp.state.formats()[NAN_SITE] == "bf16"
    # the skipped step changed nothing: AdamW's moments, step counts and the weights are as before it
    (opt_b, w_b), (opt_a, w_a) = rec.before[NAN_AT], rec.after[NAN_AT]
    assert same_state(opt_b, opt_a)
    assert all(torch.equal(w_b[k], w_a[k]) for k in w_b)
    # while the step before it was applied (the check above can fail)
    (opt_b, w_b), (opt_a, w_a) = rec.before[NAN_AT - 1], rec.after[NAN_AT - 1]
    assert not same_state(opt_b, opt_a)
    # the layer's weights are finite: the NaN never reached them
    assert all(torch.isfinite(p).all() for p in lp.model.parameters())


def test_loss_spike_rewinds_to_the_snapshot(hf_run):
    lp, rec = hf_run[0], hf_run[1]
    rewinds = [e for e in lp.session.events if e.kind == EventKind.REWIND]
    assert len(rewinds) == 1 and rewinds[0].step == SPIKE_AT + 1
    assert lp.session.rewinds == 1
    back, weights_equal, optimizer_equal = rec.rewinds[0]
    assert back < SPIKE_AT
    assert weights_equal and optimizer_equal
    # the Trainer's data went on: 50 Trainer steps, lowprec's count went back (and skipped the NaN step)
    assert hf_run[2].state.global_step == 50
    assert lp.step == 50 - (SPIKE_AT + 2 - back)


def test_one_mlflow_run_holds_both(hf_run):
    from mlflow.tracking import MlflowClient
    lp, uri = hf_run[0], hf_run[3]
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("hf-integration")
    runs = client.search_runs([exp.experiment_id])
    assert len(runs) == 1
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.tags["lowprec.fallbacks"] == "1" and run.data.tags["lowprec.rewinds"] == "1"
    metrics = run.data.metrics
    assert "loss" in metrics and "train_runtime" in metrics            # the Trainer's own
    assert "train/loss" in metrics and "train/rewound_to" in metrics  # lowprec's
    assert any(k.startswith(f"signal/{NAN_SITE}/") for k in metrics)
    report = {a.path for a in client.list_artifacts(run.info.run_id, "report")}
    assert {"report/loss.png", "report/precision_timeline.png"} <= report
    events = client.download_artifacts(run.info.run_id, "events.jsonl", str(lp.hosted.tracker.run_dir / "dl"))
    kinds = [line for line in open(events).read().splitlines() if '"fallback"' in line]
    assert len(kinds) == 1 and NAN_SITE in kinds[0]


def test_config_sections_the_trainer_owns_are_refused(tmp_path):
    (tmp_path / "a.yaml").write_text("model: {factory: 'x:y'}\n" + CONFIG)
    with pytest.raises(ConfigError, match="model.*framework"):
        LowprecCallback.from_yaml(tmp_path / "a.yaml", tiny_llama())
    (tmp_path / "b.yaml").write_text(CONFIG.replace("  min_steps: 10\n", "  min_steps: 10\n  lr_probe: {enabled: true}\n"))
    with pytest.raises(ConfigError, match="lr_probe"):
        LowprecCallback.from_yaml(tmp_path / "b.yaml", tiny_llama())


def test_missing_transformers_names_the_extra(monkeypatch):
    from lowprec.integrations.extras import MissingExtraError
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "lowprec.integrations.hf", raising=False)
    with pytest.raises(MissingExtraError, match=r"pip install 'lowprec\[hf\]'"):
        importlib.import_module("lowprec.integrations.hf")


def test_skip_without_replay_withholds_the_gradients(tmp_path):
    """Without replays the NaN step's gradients are still there when the Trainer calls
    optimizer.step(): the callback must keep them from it."""
    cfg = CONFIG.replace("  min_steps: 10\n", "  min_steps: 10\n  attribution: {replay: false}\n")
    (tmp_path / "lowprec.yaml").write_text(cfg.replace("tracking: {experiment: hf-integration}",
                                                       "tracking: {enabled: false}"))
    at = 16   # soon after the MLP stage's promotion (step 14): without replays, grad-norm spikes of this small
    # model later on would roll stages back by their statistics (what replays cure), which is not this test
    model = tiny_llama()
    lp = LowprecCallback.from_yaml(tmp_path / "lowprec.yaml", model)
    # two steps: without a replay the site is blamed by the next step's statistics (a forced check)
    rec = Recorder(lp, Faults(model, [Injection(FaultKind.NAN, at, at + 2, NAN_SITE)]), nan_at=at)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=at + 3, per_device_train_batch_size=8,
                             learning_rate=3e-3, warmup_steps=5, report_to=[], use_cpu=True, save_strategy="no",
                             seed=0, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=shakespeare_blocks(8 * 40), callbacks=[lp, rec]).train()
    assert [e.kind for e in lp.session.events if e.step == at] == [EventKind.SKIP_STEP]
    assert [(e.step, e.sites) for e in lp.session.events if e.kind == EventKind.FALLBACK] == [(at + 1, (NAN_SITE,))]
    assert lp.state.formats()[NAN_SITE] == "bf16"
    (opt_b, w_b), (opt_a, w_a) = rec.before[at], rec.after[at]
    assert same_state(opt_b, opt_a)
    assert all(torch.equal(w_b[k], w_a[k]) for k in w_b)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_fsdp_under_the_trainer_is_refused(tmp_path):
    (tmp_path / "lowprec.yaml").write_text(CONFIG.replace("tracking: {experiment: hf-integration}",
                                                          "tracking: {enabled: false}"))
    model = tiny_llama()
    lp = LowprecCallback.from_yaml(tmp_path / "lowprec.yaml", model)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=1, report_to=[], use_cpu=True)
    args.fsdp = "full_shard"   # what the Trainer would be asked for; refused before any step
    from transformers.trainer_callback import TrainerControl, TrainerState
    with pytest.raises(ValueError, match="does not support the Trainer's fsdp"):
        lp.on_train_begin(args, TrainerState(), TrainerControl(), optimizer=None, lr_scheduler=None)


def test_the_trainers_own_evaluation_is_an_eval_checkpoint(tmp_path):
    """Each `trainer.evaluate()` in training is compared with the same eval set in high
    precision: no gap while every layer is BF16; at step 20 an eval-only fault in an FP8 layer
    (its output x1000 while it runs in FP8 without autograd) is a regression that rolls the
    newest stage back; at the last step every layer is BF16 again."""
    (tmp_path / "lowprec.yaml").write_text(CONFIG.replace("tracking: {experiment: hf-integration}",
                                                          "tracking: {enabled: false}"))
    model = tiny_llama()
    lp = LowprecCallback.from_yaml(tmp_path / "lowprec.yaml", model)
    site = model.get_submodule("model.layers.1.mlp.down_proj")
    trainer_step = [0]

    def eval_fault(mod, args, out):
        if trainer_step[0] == 20 and not torch.is_grad_enabled() and not mod.format.is_high_precision:
            return out * 1000.0
    site.register_forward_hook(eval_fault)

    class Step(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            trainer_step[0] = state.global_step
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=22, per_device_train_batch_size=8,
                             per_device_eval_batch_size=8, eval_strategy="steps", eval_steps=10, learning_rate=3e-3,
                             warmup_steps=5, report_to=[], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=shakespeare_blocks(8 * 30),
            eval_dataset=shakespeare_blocks(16, offset=8 * 30 * 64), callbacks=[lp, Step()]).train()
    gates = [(e.step, e.evidence.get("verdict")) for e in lp.session.events if e.kind == EventKind.GATE]
    assert gates == [(10, "pass"), (20, "regress"), (22, "pass")]   # 22: the Trainer's eval at the last step
    rollbacks = [e for e in lp.session.events if e.kind == EventKind.ROLLBACK]
    assert [(e.step, e.stage) for e in rollbacks] == [(20, "mlp_fp8")]
    assert lp.state.formats()["model.layers.1.mlp.down_proj"] == "bf16"


def test_mlflow_steps_are_the_trainers_global_steps_after_a_rewind(hf_run):
    """One step counter in the run: lowprec's metrics, evals and events carry the Trainer's
    global step (1-based, never going back), and lowprec's own count is kept beside it where a
    rewind made the two differ (`train/lowprec_step`, an event's `lowprec_step`)."""
    import json

    from mlflow.tracking import MlflowClient
    lp, trainer, uri = hf_run[0], hf_run[2], hf_run[3]
    client = MlflowClient(uri)
    run = client.search_runs([client.get_experiment_by_name("hf-integration").experiment_id])[0]
    rid = run.info.run_id
    steps = {k: {m.step for m in client.get_metric_history(rid, k)} for k in ("train/loss", "loss", "train/lowprec_step",
                                                                             "train/loss_rewound")}
    assert trainer.state.global_step == 50 and max(steps["train/loss"]) == 50   # lowprec's own count ends short
    assert steps["train/loss"] | steps["train/loss_rewound"] == set(range(1, 51))
    assert steps["loss"] <= steps["train/loss"]                        # the Trainer's logging steps are among them
    last = client.get_metric_history(rid, "train/lowprec_step")
    assert max(last, key=lambda m: m.step).value == lp.step < 50      # lowprec's count, where it differs
    assert min(steps["train/lowprec_step"]) >= SPIKE_AT + 2                  # only after the rewind
    path = client.download_artifacts(rid, "events.jsonl", str(lp.hosted.tracker.run_dir / "dl-steps"))
    logged = [json.loads(line) for line in open(path).read().splitlines()]
    (rewind,) = [e for e in logged if e["kind"] == EventKind.REWIND]
    assert rewind["step"] == SPIKE_AT + 2                               # the Trainer's step, not lowprec's 41
    later = [e for e in logged if e["step"] > SPIKE_AT + 2]
    assert all(e["evidence"]["lowprec_step"] < e["step"] - 1 for e in later)


def test_the_runs_artifacts_go_beside_the_store_as_with_lowprec_run(hf_run):
    """The callback creates the YAML's experiment the way `lowprec run` does: artifacts beside the
    SQLite database (`<db dir>/mlruns/<experiment>`), not in the launch folder's ./mlruns."""
    from pathlib import Path

    from mlflow.tracking import MlflowClient
    uri = hf_run[3]
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("hf-integration")
    where = (Path(uri[len("sqlite:///"):]).parent / "mlruns" / "hf-integration").as_uri()
    assert exp.artifact_location == where
    run = client.search_runs([exp.experiment_id])[0]
    assert run.info.artifact_uri.startswith(where + "/")
    assert any(client.list_artifacts(run.info.run_id, "report"))   # and they are there
