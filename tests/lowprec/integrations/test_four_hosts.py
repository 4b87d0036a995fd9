"""One fault trace through the four hosts lowprec runs in gives the same decisions.

The hosts: a user's own loop (`lowprec.runtime.Session`, what `lowprec run`'s loop drives),
the Hugging Face Trainer callback, the Lightning callback and torchtitan's real Trainer
(`torchtitan.train` under torchrun with `LowprecTrainer`: the converter prepares the model
when torchtitan builds it, the trainer hosts the rollout). Each
trains the tiny Llama from the same initial weights on the same batches in the same order with
AdamW (constant LR, gradients clipped to norm 1), under one config: two stages promoted on
schedule, then an overflow injected into one MLP site's input (delayed scaling saturates
it) at the same steps. The decisions (promotions, the fallback: kind, step, stage, sites)
must be the same in all four (the numbers in their evidence may differ in the last bits:
each framework computes the loss in its own way).

The trace is the quantizers' statistics, not loss spikes (the loss detectors are set out of
reach here, and the overflow's loss is applied by every host alike): each host computes the
loss in its own way, so loss-based decisions could differ in the last bits.
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
from lowprec.runtime.trainer.faults import FaultKind, Faults, Injection  # noqa: E402

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


def torchtitan_trainer(config, tmp, port) -> list[tuple]:
    """torchtitan's real Trainer (`torchtitan.train`'s main under torchrun, one rank, gloo, CPU),
    built by `lowprec_trainer`: the job module titan_tiny_llama.py trains the same tiny Llama
    (as a torchtitan model) on the same batches with the same optimizer and overflow."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from titan_helpers import HERE, REPO, write_tokenizer
    job = tmp / "titan"
    job.mkdir()
    (job / "titan_tiny_llama.json").write_text(json.dumps({
        "plan": str(config), "events": "", "tokenizer": str(write_tokenizer(job / "tokenizer")),
        "dump": str(job / "dump"), "steps": STEPS, "lr": LR,
        "faults": [{"kind": OVERFLOW.kind.value, "site": OVERFLOW.site, "start": OVERFLOW.start,
                    "stop": OVERFLOW.stop, "factor": OVERFLOW.factor}]}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(REPO)]), "OMP_NUM_THREADS": "1"}
    p = subprocess.run([str(Path(sys.executable).with_name("torchrun")), "--nproc-per-node", "1", "--master-addr",
                        "127.0.0.1", "--master-port", str(port), str(HERE / "titan_launch.py"), "--module",
                        "titan_tiny_llama", "--config", "tiny_llama_lowprec"],
                       cwd=job, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    from lowprec.policy.events import Event
    return _decisions(Event.from_dict(json.loads(x)) for x in json.loads((job / "dump" / "events.json").read_text()))


def test_one_fault_trace_gives_the_same_decisions_in_all_four_hosts(tmp_path, monkeypatch, free_port):
    pytest.importorskip("torchtitan")
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "lowprec.yaml"     # what a Session reads
    config.write_text(CONFIG)
    framework = tmp_path / "framework.yaml"   # the HF, Lightning and torchtitan hosts' file: the same, untracked
    framework.write_text(CONFIG + "tracking: {enabled: false}\n")
    got = {"own loop (Session)": own_loop(config), "HF Trainer": hf_trainer(framework, tmp_path),
           "Lightning": lightning_trainer(framework, tmp_path),
           "torchtitan Trainer": torchtitan_trainer(framework, tmp_path, free_port())}
    want = got["own loop (Session)"]
    kinds = [d[0] for d in want]
    # the trace is not empty: both stages promoted, then the overflowing site fell back
    assert kinds.count(str(EventKind.PROMOTE)) == 2 and str(EventKind.FALLBACK) in kinds, want
    assert any(d[0] == str(EventKind.FALLBACK) and d[3] == (SITE,) for d in want), want
    for host, decisions in got.items():
        assert decisions == want, f"{host} decided {decisions}, the own loop {want}"
