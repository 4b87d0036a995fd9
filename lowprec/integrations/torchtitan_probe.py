"""The LR probe (`rollout.lr_probe`) inside torchtitan's Trainer: its held batch and its two losses.

The probe (`lowprec.runtime.session.lrprobe.LRProbe`) needs a batch training never draws, the same on
every rank of a data-parallel group, and a forward-only loss. Under torchtitan the held batch
is the first batch of torchtitan's validation data (`validator.dataloader`, built as its
`Validator` builds it), and both losses go through torchtitan (`forward_backward_step`; the forward-only loss through
`torchtitan_forward.held_loss`), reduced over the data-parallel ranks as the step's loss is.
Under pipeline parallelism the held batch is split into the micro-batches of one pipeline
step, both losses are steps of torchtitan's pipeline schedule on every stage, and the probe
steps every optimizer of this rank (one per stage it holds) as one.
"""

from __future__ import annotations

from collections.abc import MutableMapping

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


def _micro_batches(trainer, input_dict: dict, labels: torch.Tensor) -> list[tuple[dict, torch.Tensor]]:
    """The held batch as one pipeline step's micro-batches (split along the batch, as many as
    training's), or as itself without pipeline parallelism."""
    if trainer.pp_mesh is None:
        return [(input_dict, labels)]
    n = trainer.num_pipeline_parallel_microbatches
    parts = {k: v.tensor_split(n) if isinstance(v, torch.Tensor) else [v] * n for k, v in input_dict.items()}
    return [({k: parts[k][i] for k in input_dict}, y) for i, y in enumerate(labels.tensor_split(n))]


class _JoinedState(MutableMapping):
    """The optimizer state of several optimizers as one mapping, each parameter's at its owner's."""

    def __init__(self, optimizers: list):
        self.optimizers = optimizers
        self._owners = {p: o for o in optimizers for g in o.param_groups for p in g["params"]}

    def _owner(self, p):
        return self._owners[p]   # KeyError: not a parameter of these optimizers

    def __getitem__(self, p):
        return self._owner(p).state[p]

    def __setitem__(self, p, value):
        self._owner(p).state[p] = value

    def __delitem__(self, p):
        del self._owner(p).state[p]

    def __iter__(self):
        return (p for o in self.optimizers for p in list(o.state))

    def __len__(self):
        return sum(len(o.state) for o in self.optimizers)


class _Joined:
    """This rank's optimizers (one per pipeline stage it holds) as the one optimizer the probe steps."""

    def __init__(self, optimizers: list):
        self.optimizers = optimizers
        self.param_groups = [g for o in optimizers for g in o.param_groups]
        self.state = _JoinedState(optimizers)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()


def lr_probe_for(trainer, rollout, clip):
    """The LRProbe of a LowprecTrainer when `rollout.lr_probe` is on, else None."""
    if rollout is None or not rollout.lr_probe.enabled:
        return None
    from lowprec.integrations.torchtitan_forward import held_loss
    from lowprec.runtime.session.lrprobe import LRProbe
    from torchtitan.components.loss import IGNORE_INDEX
    input_dict, labels = _held_batch(trainer)
    tokens = trainer.global_loss((labels != IGNORE_INDEX).sum())   # the global count, as train_step computes it
    batches = _micro_batches(trainer, input_dict, labels)

    def forward_backward() -> torch.Tensor:
        with trainer.not_recorded(), torch.enable_grad():
            if trainer.pp_mesh is None:
                (d, y), = batches
                loss = trainer.forward_backward_step(input_dict=dict(d), labels=y, global_valid_tokens=tokens)
            else:
                loss = trainer.forward_backward_step(input_dict=[dict(d) for d, _ in batches],
                                                     labels=[y for _, y in batches], global_valid_tokens=tokens)
        return trainer.global_loss(loss.detach())

    optimizers = trainer.optimizers.optimizers
    optimizer = optimizers[0] if len(optimizers) == 1 else _Joined(optimizers)
    return LRProbe(trainer.hosted.model, optimizer, forward_backward, lambda: held_loss(trainer, batches, tokens),
                   state=trainer.hosted.state, clip=clip, factors=rollout.lr_probe.factors,
                   every_checks=rollout.lr_probe.every_checks)
