"""One fault trace through the four hosts lowprec runs in gives the same decisions.

The hosts: a user's own loop (`lowprec.runtime.Session`, what `lowprec run`'s loop drives),
the Hugging Face Trainer callback, the Lightning callback and the torchtitan converter (its
model-config converter and post-optimizer-build function, as torchtitan 0.3 calls them). Each
trains the tiny Llama from the same initial weights on the same batches in the same order with
AdamW (constant LR, gradients clipped to norm 1), under one config: two stages promoted on
schedule, then an overflow injected into one MLP site's input (delayed scaling saturates
it) at the same steps. The decisions (promotions, the fallback: kind, step, stage, sites)
must be the same in all four (the numbers in their evidence may differ in the last bits:
each framework computes the loss in its own way).

torchtitan's converter sees no loss, so the trace is one every host can see: statistics
from the quantizers, not loss spikes (the loss detectors are set out of reach here, and the
overflow's loss is applied by every host alike).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
pytest.importorskip("lightning")

from llama_helpers import shakespeare_blocks, tiny_llama  # noqa: E402

from lowprec.policy.events import EventKind  # noqa: E402
from lowprec.runtime.faults import FaultKind, Faults, Injection  # noqa: E402

STEPS = 40
SITE = "model.layers.1.mlp.down_proj"
OVERFLOW = Injection(FaultKind.OVERFLOW, 24, 40, SITE, factor=1e4)
CONFIG = """\
precision:
  backend: emulated
  default: bf16
  keep_high_precision: [{fqns: [lm_head]}]
  rules:
    - {name: all, select: {module_type: Linear}, format: bf16, ladder: [fp8_delayed, bf16]}
rollout:
  check_every: 5
  min_steps: 10
  cooldown_steps: 1000
  attribution: {replay: false}
  thresholds: {max_saturated_frac: 0.01, site_patience: 2, spike_sigmas: 1.0e+9, large_factor: 1.0e+12}
  stages:
    - {name: mlp_fp8, select: {glob: "*.mlp.*"}, format: fp8_delayed}
    - {name: attn_fp8, select: {glob: "*.self_attn.*"}, format: fp8_delayed}
"""
LR = 1e-3


def _decisions(events) -> list[tuple]:
    """Every event as (kind, step, stage, sites): what was decided, when, and about what."""
    return [(str(e.kind), e.step, e.stage, tuple(sorted(e.sites))) for e in events]


def _batches():
    blocks = shakespeare_blocks(8 * STEPS)
    return [{k: torch.stack([b[k] for b in blocks[i:i + 8]]) for k in blocks[0]} for i in range(0, 8 * STEPS, 8)]


class InOrder(torch.utils.data.IterableDataset):
    """The examples in their order (the HF Trainer shuffles a map-style dataset)."""

    def __iter__(self):
        return iter(shakespeare_blocks(8 * STEPS))


def own_loop(config) -> list[tuple]:
    from lowprec.runtime import Session
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    session = Session.from_yaml(config, model, opt)
    faults = Faults(model, [OVERFLOW])
    for i, batch in enumerate(_batches()):
        faults.tick(i)

        def closure(batch=batch):
            opt.zero_grad()
            loss = model(**batch).loss
            loss.backward()
            return loss
        session.step(closure(), closure)
    return _decisions(session.events)


def hf_trainer(config, tmp) -> list[tuple]:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from lowprec.integrations.hf import LowprecCallback
    model = tiny_llama()
    lp = LowprecCallback.from_yaml(config, model)
    faults = Faults(model, [OVERFLOW])

    class Tick(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            faults.tick(state.global_step)

    args = TrainingArguments(output_dir=str(tmp / "hf"), max_steps=STEPS, per_device_train_batch_size=8,
                             learning_rate=LR, lr_scheduler_type="constant", report_to=[], use_cpu=True,
                             save_strategy="no", seed=0, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=InOrder(), callbacks=[lp, Tick()]).train()
    return _decisions(lp.session.events)


def lightning_trainer(config, tmp) -> list[tuple]:
    import lightning
    from torch.utils.data import DataLoader

    from lowprec.integrations.lightning import LowprecCallback

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = tiny_llama()

        def training_step(self, batch, batch_idx):
            return self.model(**batch).loss

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=LR)

    module = Module()
    lp = LowprecCallback.from_yaml(config, module.model)
    faults = Faults(module.model, [OVERFLOW])

    class Tick(lightning.pytorch.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            faults.tick(trainer.global_step)

    trainer = lightning.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False, logger=False,
                                default_root_dir=str(tmp / "lightning"), callbacks=[lp, Tick()])
    trainer.fit(module, DataLoader(shakespeare_blocks(8 * STEPS), batch_size=8, shuffle=False))
    return _decisions(lp.session.events)


def torchtitan_converter(config, tmp) -> list[tuple]:
    """The converter as torchtitan 0.3 drives it: `LowprecConverter.Config` built and applied to
    the model config (what a model's `model_registry(..., converters=[...])` does), the model
    built from that config, then the model spec's `post_optimizer_build_fn` (`with_rollout`'s)
    given the optimizer, whose step post-hook concludes each step. The model is the same tiny
    Llama, as a torchtitan model whose config builds it (its modules keep their HF names)."""
    from dataclasses import dataclass

    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model import BaseModel
    from torchtitan.protocols.model_spec import ModelSpec

    from lowprec.integrations.torchtitan import LowprecConverter, rollout_of, with_rollout

    class TinyLlama(BaseModel):
        @dataclass(kw_only=True, slots=True)
        class Config(BaseModel.Config):
            def update_from_config(self, *, config, **kwargs) -> None:
                pass

            def get_nparams_and_flops(self, model, seq_len: int) -> tuple[int, int]:
                return 0, 0

        def __init__(self, config):
            super().__init__()
            hf = tiny_llama()
            self.model, self.lm_head = hf.model, hf.lm_head   # the same modules, under the same names
            self._hf = (hf,)                                  # its forward and loss, not a submodule

        def forward(self, **batch):
            return self._hf[0](**batch).loss

    model_config = LowprecConverter.Config(config=str(config)).build().convert(TinyLlama.Config())
    spec = with_rollout(ModelSpec(name="tiny_llama", flavor="test", model=model_config, parallelize_fn=None,
                                  pipelining_fn=None, post_optimizer_build_fn=None, state_dict_adapter=None))
    model = spec.model.build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    spec.post_optimizer_build_fn(opt, [model], ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1,
                                                            world_size=1))
    faults = Faults(model, [OVERFLOW])
    for i, batch in enumerate(_batches()):
        faults.tick(i)
        opt.zero_grad()
        model(**batch).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)   # as torchtitan's train_step does
        opt.step()
    rollout = rollout_of(model)
    rollout.close()
    return _decisions(rollout.events)


def test_one_fault_trace_gives_the_same_decisions_in_all_four_hosts(tmp_path, monkeypatch):
    pytest.importorskip("torchtitan")
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "lowprec.yaml"     # what a Session and torchtitan's converter read
    config.write_text(CONFIG)
    framework = tmp_path / "framework.yaml"   # the HF and Lightning callbacks' file: the same, untracked
    framework.write_text(CONFIG + "tracking: {enabled: false}\n")
    got = {"own loop (Session)": own_loop(config), "HF Trainer": hf_trainer(framework, tmp_path),
           "Lightning": lightning_trainer(framework, tmp_path), "torchtitan": torchtitan_converter(config, tmp_path)}
    want = got["own loop (Session)"]
    kinds = [d[0] for d in want]
    # the trace is not empty: both stages promoted, then the overflowing site fell back
    assert kinds.count(str(EventKind.PROMOTE)) == 2 and str(EventKind.FALLBACK) in kinds, want
    assert any(d[0] == str(EventKind.FALLBACK) and d[3] == (SITE,) for d in want), want
    for host, decisions in got.items():
        assert decisions == want, f"{host} decided {decisions}, the own loop {want}"
