"""How one step's forward and backward run: the engine the training loop is given.

An engine owns the parallel layout of a model; the loop (`lowprec.runtime.trainer.loop`) only
asks it for a step's loss and the global gradient norm:

    engine.module                     this rank's part of the model (all of it in one process)
    engine.params                     this rank's parameters (what the optimizer steps)
    engine.forward_backward(x, y)     forward and backward of one batch; the global batch-mean loss
    engine.clip_grad_norm(max_norm)   clip by the global gradient norm; returns it (before clipping)
    engine.loss(x, y)                 optional: the global batch-mean loss of a forward without
                                      gradients (the LR probe, `lowprec.runtime.session.lrprobe`, needs it)

`SingleProcess` is the engine of one process, with gradient accumulation over row
chunks. The engines of `lowprec run` under torchrun (data x tensor parallel, FSDP2 x tensor
parallel, pipeline stages: `lowprec.runtime.engines.parallel`) follow the same protocol.

A model's loss: `model(x, y)` returns the loss, or a tuple whose last item is the loss,
or an object with a `.loss` (Hugging Face outputs).
"""

from __future__ import annotations

import math
from typing import Protocol

import torch
from torch import nn

from lowprec.tracking.phases import NULL_CLOCK, LapClock, Phase

__all__ = ["Engine", "Clocked", "SingleProcess", "loss_of", "forward_backward"]


class Engine(Protocol):
    module: nn.Module
    params: list[nn.Parameter]

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor: ...

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor: ...


class Clocked:
    """An engine that laps its phases (forward, backward, collectives) on the run's clock,
    given to its constructor (`clock=`; the run's telemetry's, which counts from its `begin()`)."""

    clock: LapClock = NULL_CLOCK


def loss_of(out) -> torch.Tensor:
    """The loss in a model's output (see the module docstring)."""
    if isinstance(out, torch.Tensor):
        return out
    if isinstance(out, (tuple, list)) and out and isinstance(out[-1], torch.Tensor):
        return out[-1]
    loss = getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    raise TypeError(f"the model returned a {type(out).__name__}; lowprec needs model(x, y) to return the loss "
                    f"(a scalar tensor), a tuple whose last item is the loss, or an object with .loss")


def forward_backward(model: nn.Module, x: torch.Tensor, y: torch.Tensor, microbatches: int = 1,
                     world: int = 1, clock: LapClock = NULL_CLOCK) -> torch.Tensor:
    """Forward and backward of one batch in `microbatches` row chunks; returns the loss.

    Each chunk's loss is divided by microbatches * world (world: data-parallel ranks that
    each hold 1/world of the batch), so that summed gradients are those of the global
    batch mean; the returned loss (detached) is this rank's share of that mean.
    """
    scale = microbatches * world
    total = None
    chunks = zip(x.tensor_split(microbatches), y.tensor_split(microbatches)) if microbatches > 1 else [(x, y)]
    for xc, yc in chunks:
        loss = loss_of(model(xc, yc))
        part = loss / scale if scale != 1 else loss
        clock.lap(Phase.FORWARD)
        part.backward()
        clock.lap(Phase.BACKWARD)
        total = part.detach() if total is None else total + part.detach()
    return total


class SingleProcess(Clocked):
    """One process: the whole model, gradient accumulation over `microbatches` row chunks.
    `clock`: where forward and backward time is lapped (the run's telemetry's)."""

    data_parallel_size = 1

    def __init__(self, model: nn.Module, microbatches: int = 1, clock: LapClock = NULL_CLOCK):
        if microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches}")
        self.module = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.microbatches = microbatches
        self.clock = clock

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return forward_backward(self.module, x, y, self.microbatches, clock=self.clock)

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.params, math.inf if max_norm is None else max_norm)

    @torch.no_grad()
    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The batch-mean loss without gradients, in the row chunks `forward_backward` uses."""
        n = self.microbatches
        chunks = zip(x.tensor_split(n), y.tensor_split(n)) if n > 1 else [(x, y)]
        total = None
        for xc, yc in chunks:
            part = loss_of(self.module(xc, yc)).detach()
            part = part / n if n > 1 else part
            total = part if total is None else total + part
        return total
