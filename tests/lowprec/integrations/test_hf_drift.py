"""Blame before rollback under the Hugging Face Trainer: a loss gap to the BF16 baseline is
judged by its window before anything is demoted.

A real `Trainer` on CPU trains a small `LlamaForCausalLM` on Shakespeare bytes, in order (an
iterable dataset: step k sees examples 8k..8k+7), with the MLP stage promoted to FP8 early and
`loss_gap` against the same run in BF16. Two faults, each in its own run, both after the
promotion:

* a non-precision drift fault: from step 25, ten batches of shuffled bytes (a stretch of bad
  data, the same in BF16). The loss drifts away from the baseline; the window since the last
  snapshot, trained again with every site in high precision on the same batches, drifts
  alike: a `not_precision` event, and the stage stays promoted;
* a precision drift fault: from step 25, one FP8 layer's input rounded to an ever coarser
  grid (4096 steps of its amax, halved every step down to 2: a format too coarse for it,
  slowly), only while it runs below BF16. The loss drifts a little; the first look (the current
  weights with every site in BF16) closes the gap, and the layer falls back.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from llama_helpers import shakespeare_blocks, tiny_llama  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from lowprec.policy.events import EventKind  # noqa: E402
from lowprec.integrations.hf import LowprecCallback  # noqa: E402

STEPS, FAULT_AT, BAD_STEPS, LEVELS = 45, 25, 10, 2
SITE = "model.layers.0.mlp.down_proj"
PRECISION = """\
precision:
  backend: emulated
  default: bf16
  keep_high_precision: [{fqns: [lm_head]}]
  rules:
    - {name: all, select: {module_type: Linear}, format: bf16, ladder: [fp8_tensorwise, bf16]}
tracking: {enabled: false}
"""
ROLLOUT = """\
rollout:
  check_every: 5
  min_steps: 10
  rewind: {enabled: false, snapshot_every: 10, keep: 2}
  # spikes at 20 sigmas: the small model's grad norm is so steady after warm-up that 6 sigmas
  # fire on the first steps of a slow fault (the per-step path, not what this test is about)
  thresholds: {loss_gap: 0.015, loss_gap_smoothing: 0.5, spike_sigmas: 20}
  baseline: {losses: unused.json}
  stages:
    - {name: mlp_fp8, select: {glob: "*.mlp.*"}, format: fp8_tensorwise}
"""


class Ordered(torch.utils.data.IterableDataset):
    """The examples in order; with `shuffled`, those of steps [FAULT_AT, FAULT_AT + BAD_STEPS)
    have their bytes permuted (a stretch of bad data)."""

    def __init__(self, examples, shuffled: bool):
        self.examples, self.shuffled = examples, shuffled

    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for i, ex in enumerate(self.examples):
            if self.shuffled and FAULT_AT * 8 <= i < (FAULT_AT + BAD_STEPS) * 8:
                x = ex["input_ids"][torch.randperm(len(ex["input_ids"]), generator=g)]
                ex = {"input_ids": x, "labels": x.clone()}
            yield ex


class CoarseInput(TrainerCallback):
    """From FAULT_AT, `SITE`'s input rounded to a grid of 4096 steps of its amax, half as many
    each step down to LEVELS (a format ever too coarse for the layer, slowly: the precision
    fault), only while it runs below BF16."""

    def __init__(self, model):
        self.step = 0
        model.get_submodule(SITE).register_forward_pre_hook(self.pre)

    def pre(self, mod, args):
        if self.step >= FAULT_AT and not mod.format.is_high_precision:
            x = args[0]
            grid = x.detach().abs().amax() / max(LEVELS, 2.0 ** (12 - (self.step - FAULT_AT)))
            return (x + ((x / grid).round() * grid - x).detach(),) + tuple(args[1:])

    def on_step_begin(self, args, state, control, **kw):
        self.step = state.global_step


def _train(tmp, config: str, *, shuffled=False, scale_fault=False, baseline=None) -> LowprecCallback:
    (tmp / "lowprec.yaml").write_text(config)
    model = tiny_llama()
    lp = LowprecCallback.from_yaml(tmp / "lowprec.yaml", model, baseline=baseline)
    args = TrainingArguments(output_dir=str(tmp / "out"), max_steps=STEPS, per_device_train_batch_size=8,
                             learning_rate=3e-3, warmup_steps=5, report_to=[], use_cpu=True, save_strategy="no",
                             seed=0, disable_tqdm=True, logging_steps=1000)
    Trainer(model=model, args=args, train_dataset=Ordered(shakespeare_blocks(8 * STEPS), shuffled),
            callbacks=[lp] + ([CoarseInput(model)] if scale_fault else [])).train()
    return lp


@pytest.fixture(scope="module")
def baseline(tmp_path_factory):
    """The BF16 run's loss per step (no fault), what `loss_gap` compares with."""
    return dict(enumerate(_train(tmp_path_factory.mktemp("bf16"), PRECISION).hosted.losses))


def test_a_stretch_of_bad_data_after_promotion_leaves_the_stage_promoted(tmp_path, baseline):
    lp = _train(tmp_path, PRECISION + ROLLOUT, shuffled=True, baseline=baseline)
    ev = lp.session.events
    assert [e.stage for e in ev if e.kind == EventKind.PROMOTE] == ["mlp_fp8"]
    judged = [e for e in ev if e.kind == EventKind.NOT_PRECISION]
    assert judged and all(e.step >= FAULT_AT for e in judged)
    first = judged[0].evidence
    # the evidence: both windows' losses (as trained, and trained again in BF16) and the baseline's
    window = [x for x in first["looks"] if x["retrained"]]
    assert first["decided_by"] == "window_replay" and len(window) == 1 == first["window_replays"]
    assert first["losses_as_trained"] and len(window[0]["losses"]) == len(first["losses_as_trained"])
    assert window[0]["closed"] < 0.3
    assert not [e for e in ev if e.kind in (EventKind.FALLBACK, EventKind.ROLLBACK)]
    assert all(f == "fp8_tensorwise" for s, f in lp.state.formats().items() if ".mlp." in s)
    # the session's record of every judgment: one window per suspicion, its cost
    assert all(j.windows <= 1 for j in lp.session.window.judged if not j.precision_to_blame)


def test_a_wrong_scale_on_one_layer_after_promotion_demotes_it(tmp_path, baseline):
    lp = _train(tmp_path, PRECISION + ROLLOUT, scale_fault=True, baseline=baseline)
    ev = lp.session.events
    assert [e.stage for e in ev if e.kind == EventKind.PROMOTE] == ["mlp_fp8"]
    demoted = [e for e in ev if e.kind in (EventKind.FALLBACK, EventKind.ROLLBACK)]
    assert demoted and demoted[0].step >= FAULT_AT and SITE in demoted[0].sites
    assert demoted[0].evidence["precision_to_blame"] and "loss_gap" in demoted[0].evidence
    assert lp.state.formats()[SITE] == "bf16"
    assert not [e for e in ev if e.kind == EventKind.NOT_PRECISION and e.step < demoted[0].step]
