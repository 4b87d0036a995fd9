"""The Hugging Face Trainer with lowprec's callback on a mixture of experts: a tiny Qwen3-MoE
(transformers 5's fused experts, random init) on Shakespeare bytes, whose experts are sites
(lowprec.sites.experts).

One run: the dense layers are promoted to FP8 first, the experts next, each expert on its own;
a NaN planted in expert 2 of layer 1 while it runs in FP8 skips the step and demotes exactly
that expert (its neighbours and the other layer's expert 2 stay in FP8); a fault in the router
(its input NaN in every format, so the replay in high precision meets it too) skips its step and
demotes nothing; a router collapse (layer 0's router sends every token to experts 0 and 1 for the
last steps, a check among them) is named a router fault at that check and demotes nothing (layer
1's random router is collapsed from the start: named once, at the first check); the precision map
MLflow keeps names every expert.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow
pytest.importorskip("transformers")

from llama_helpers import shakespeare_blocks  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from lowprec.integrations.hf import LowprecCallback  # noqa: E402
from lowprec.policy.events import EventKind  # noqa: E402
from lowprec.runtime.trainer.faults import FaultKind, Faults, Injection  # noqa: E402
from tests.lowprec.moe_models import tiny_qwen3_moe  # noqa: E402

EXPERT = "model.layers.1.mlp.experts.2"
ROUTER = "model.layers.0.mlp.gate"
NAN_AT, ROUTER_AT = 30, 36
COLLAPSE_AT = 37   # to the end (40 steps): layer 0's router collapsed at the check of step 39

CONFIG = """\
precision:
  backend: emulated
  default: bf16
  keep_high_precision: [{fqns: [lm_head]}]
  rules:
    - {name: dense, select: {module_type: Linear}, format: bf16, ladder: [fp8_tensorwise, bf16]}
    - {name: experts, select: {kind: experts}, format: bf16, ladder: [fp8_tensorwise, bf16]}
rollout:
  check_every: 5
  min_steps: 10
  thresholds: {spike_sigmas: 100.0}   # a tiny random-init MoE's grad norm jumps: only the planted faults count
  stages:
    - {name: dense_fp8, select: {kind: dense}, format: fp8_tensorwise}
    - {name: experts_fp8, select: {kind: experts}, format: fp8_tensorwise}
tracking: {enabled: false}
"""


class Ticker(TrainerCallback):
    def __init__(self, faults: Faults):
        self.faults = faults

    def on_step_begin(self, args, state, control, **kw):
        self.faults.tick(state.global_step)


@pytest.fixture(scope="module")
def moe_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf_moe")
    (tmp / "lowprec.yaml").write_text(CONFIG)
    model = tiny_qwen3_moe(vocab=256)
    lp = LowprecCallback.from_yaml(tmp / "lowprec.yaml", model)
    faults = Faults(model, [Injection(FaultKind.NAN, NAN_AT, NAN_AT + 1, EXPERT),
                            Injection(FaultKind.INPUT, ROUTER_AT, ROUTER_AT + 1, ROUTER, factor=float("nan")),
                            Injection(FaultKind.ROUTER, COLLAPSE_AT, 40, ROUTER)])
    args = TrainingArguments(output_dir=str(tmp / "out"), max_steps=40, per_device_train_batch_size=4,
                             learning_rate=3e-3, warmup_steps=5, logging_steps=5, report_to=[], use_cpu=True,
                             save_strategy="no", seed=0, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=shakespeare_blocks(4 * 50, block=32),
                      callbacks=[lp, Ticker(faults)])
    trainer.train()
    return lp


def test_dense_layers_first_then_each_expert(moe_run):
    lp = moe_run
    promoted = [e for e in lp.session.events if e.kind == EventKind.PROMOTE]
    assert [e.stage for e in promoted] == ["dense_fp8", "experts_fp8"]
    assert promoted[0].step < promoted[1].step
    assert set(promoted[1].sites) == {f"model.layers.{i}.mlp.experts.{e}" for i in (0, 1) for e in range(4)}


def test_a_nan_in_one_expert_demotes_exactly_that_expert(moe_run):
    lp = moe_run
    fallbacks = [e for e in lp.session.events if e.kind == EventKind.FALLBACK]
    assert [(e.step, e.sites) for e in fallbacks] == [(NAN_AT, (EXPERT,))]
    assert any(e.kind == EventKind.SKIP_STEP and e.step == NAN_AT for e in lp.session.events)
    formats = lp.state.formats()
    assert formats[EXPERT] == "bf16"
    assert {f: v for f, v in formats.items() if ".experts." in f and f != EXPERT} == {
        f"model.layers.{i}.mlp.experts.{e}": "fp8_tensorwise" for i in (0, 1) for e in range(4)
        if f"model.layers.{i}.mlp.experts.{e}" != EXPERT}
    assert all(torch.isfinite(p).all() for p in lp.model.parameters())


def test_a_router_fault_demotes_nothing(moe_run):
    lp = moe_run
    at = [e for e in lp.session.events if e.step == ROUTER_AT]
    assert any(e.kind == EventKind.SKIP_STEP for e in at), [(e.kind, e.step) for e in lp.session.events]
    assert not [e for e in at if e.kind == EventKind.FALLBACK]


def test_a_router_collapse_is_named_a_router_fault_and_demotes_nothing(moe_run):
    """Every token of layer 0 to experts 0 and 1 (top 2 of 4): the check's routing (the window's
    tokens) is collapsed there and named a router fault at that check; layer 1's router, collapsed
    by its random init (its experts 0 and 3 take every token), is named once, at the first check,
    and not again while it stays so. Nothing falls back after the planted NaN's
    (test_a_nan_in_one_expert_demotes_exactly_that_expert holds the fallbacks)."""
    lp = moe_run
    faults = [(e.step, e.evidence["layer"]) for e in lp.session.events if e.kind == EventKind.ROUTER_FAULT]
    assert faults[0][1] == "model.layers.1.mlp.experts" and faults[0][0] < NAN_AT, faults
    assert faults[1:] == [(39, "model.layers.0.mlp.experts")], faults
    fault = [e for e in lp.session.events if e.kind == EventKind.ROUTER_FAULT][-1]
    assert fault.evidence["router/collapse"] == 1.0 and fault.evidence["router/busiest"] in (
        "model.layers.0.mlp.experts.0", "model.layers.0.mlp.experts.1"), fault
    assert "router fault" in fault.reason and not fault.sites
    assert not [e for e in lp.session.events if e.step >= COLLAPSE_AT and e.kind in EventKind.CHANGES_FORMATS]
