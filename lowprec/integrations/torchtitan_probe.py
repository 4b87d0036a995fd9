"""The LR probe (`rollout.lr_probe`) inside torchtitan's Trainer: its held batch and its two losses.

The probe (`lowprec.runtime.lrprobe.LRProbe`) needs a batch training never draws, the same on
every rank of a data-parallel group, and a forward-only loss. Under torchtitan the held batch
is the first batch of torchtitan's validation data (`validator.dataloader`, built as its
`Validator` builds it), and both losses go through torchtitan's own `forward_backward_step`
and loss function, reduced over the data-parallel ranks as the step's loss is. The probe
steps torchtitan's first (and, without pipeline stages, only) optimizer, whose param groups
hold the learning rates.
"""

from __future__ import annotations

import torch

from lowprec.base.parse import ConfigError

__all__ = ["lr_probe_for"]


def _held_batch(trainer):
    """The first batch of torchtitan's validation data, on the trainer's device."""
    cfg = trainer.config
    if not cfg.validator.enable:
        raise ConfigError("rollout.lr_probe", (
            "is enabled, and under torchtitan its held batch is the first batch of torchtitan's validation data, "
            "which this job has not configured. Fix: set validator.enable (and validator.dataloader) in the "
            "torchtitan job, or lr_probe.enabled: false"))
    dims = trainer.parallel_dims
    mesh = dims.get_optional_mesh("batch") if dims.dp_enabled else None
    loader = cfg.validator.dataloader.build(
        dp_world_size=mesh.size() if mesh is not None else 1, dp_rank=mesh.get_local_rank() if mesh is not None else 0,
        tokenizer=trainer.tokenizer, seq_len=cfg.training.seq_len, local_batch_size=cfg.training.local_batch_size)
    input_dict, labels = next(iter(loader))
    return ({k: v.to(trainer.device) if isinstance(v, torch.Tensor) else v for k, v in input_dict.items()},
            labels.to(trainer.device))


def lr_probe_for(trainer, rollout, clip):
    """The LRProbe of a LowprecTrainer when `rollout.lr_probe` is on, else None."""
    if rollout is None or not rollout.lr_probe.enabled:
        return None
    from lowprec.runtime.lrprobe import LRProbe
    from torchtitan.components.loss import IGNORE_INDEX
    input_dict, labels = _held_batch(trainer)
    local_tokens = (labels != IGNORE_INDEX).sum()
    tokens = trainer.global_loss(local_tokens)   # the global count, as train_step computes it

    def forward_backward() -> torch.Tensor:
        with trainer.not_recorded(), torch.enable_grad():
            loss = trainer.forward_backward_step(input_dict=dict(input_dict), labels=labels, global_valid_tokens=tokens)
        return trainer.global_loss(loss.detach())

    def held_loss() -> torch.Tensor:
        with trainer.not_recorded(), torch.no_grad():
            inputs, y, extra = trainer.post_dataloading_process(dict(input_dict), labels)
            with trainer.train_context():
                pred = trainer.model_parts[0](inputs, **extra)
                kw = {"positions": extra["positions"]} if "positions" in extra else {}
                loss, _ = trainer.loss_fn(pred, y, tokens, **kw)
        return trainer.global_loss(loss.detach())

    optimizer = trainer.optimizers.optimizers[0]
    return LRProbe(trainer.model_parts[0], optimizer, forward_backward, held_loss,
                   state=trainer.hosted.state, clip=clip, factors=rollout.lr_probe.factors,
                   every_checks=rollout.lr_probe.every_checks)
