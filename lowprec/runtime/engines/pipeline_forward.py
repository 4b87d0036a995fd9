"""Forwards through pipeline stages outside the training step, and the last stage's tensor on every rank.

Under pipeline parallelism no rank holds the whole model, yet an eval suite needs the
model's logits on every rank (lm-eval runs the same requests on each, and rank 0 keeps the
results) and the LR probe needs a held batch's loss on every rank (each rank's controller
decides on it). Two pieces serve both of lowprec's pipeline hosts:

* `last_stage_tensor(values, group, stages)`: the last stage's tensor (logits, a loss) on
  every rank of the pp group: its shape in one broadcast, then its values in float32 in a
  second (`from_last_stage`). The torchtitan host
  (`lowprec.integrations.torchtitan_forward`) hands it the outputs of its schedule's
  evaluation step; `lowprec run`'s Pipeline engine the output of `chain_forward`.
* `chain_forward(stage, x, index, stages, group)`: one forward of `x` through the stages in
  order, with no schedule: the first stage takes `x`, each stage sends its output (a header
  of dtype and shape, then the tensor) to the next, the last returns the model's output.
  Any batch shape goes (nothing is sized at a first step), so an eval batch is neither padded
  nor split: a tensor-wise scale sees the same activations as the whole model's forward on
  one process, and the logits are the same bits. `lowprec run`'s Pipeline engine uses it.

Every rank of the group calls these alike and in the same order: they are collective.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["from_last_stage", "chain_forward", "last_stage_tensor"]

_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32)
_MAX_DIMS = 6


def from_last_stage(loss: torch.Tensor, group, stages: int) -> torch.Tensor:
    """The last pipeline stage's `loss` on every stage of `group` (`stages` ranks): one broadcast,
    in place (the same shape and dtype on every rank). The loss exists on the last stage only;
    every rank must measure the same step to decide alike (`lowprec run`'s Pipeline engine,
    torchtitan's pipeline schedule in `lowprec.integrations.torchtitan_stages`, and the
    forwards of this module)."""
    dist.broadcast(loss, group_src=stages - 1, group=group)
    return loss


def _send(t: torch.Tensor, dst: int, group) -> None:
    if t.dtype not in _DTYPES or t.dim() > _MAX_DIMS:
        raise ValueError(f"a pipeline stage returned a {t.dtype} tensor of {t.dim()} dims; stages may pass "
                         f"tensors of {', '.join(map(str, _DTYPES))} with at most {_MAX_DIMS} dims")
    head = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=t.device)
    head[0], head[1] = _DTYPES.index(t.dtype), t.dim()
    head[2:2 + t.dim()] = torch.tensor(t.shape, dtype=torch.int64)
    dist.send(head, group_dst=dst, group=group)
    dist.send(t.detach().contiguous(), group_dst=dst, group=group)


def _recv(src: int, group, device: torch.device) -> torch.Tensor:
    head = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(head, group_src=src, group=group)
    dtype, ndim = _DTYPES[int(head[0])], int(head[1])
    t = torch.empty(tuple(head[2:2 + ndim].tolist()), dtype=dtype, device=device)
    dist.recv(t, group_src=src, group=group)
    return t


def chain_forward(stage: nn.Module, x: torch.Tensor | None, index: int, stages: int, group=None
                  ) -> torch.Tensor | None:
    """`stage` (this rank's, number `index` of `stages` in `group`) run on `x` (the first stage's
    input; ignored elsewhere) or on what the stage before it sends; the model's output on the
    last stage, None on the others (see the module docstring). What it receives lands on the
    stage's device (its parameters')."""
    device = next((p.device for p in stage.parameters()), torch.device("cpu"))
    h = x if index == 0 else _recv(index - 1, group, device)
    out = stage(h)
    if index < stages - 1:
        _send(out, index + 1, group)
        return None
    return out


def last_stage_tensor(values: torch.Tensor | None, group, stages: int, *, ndim: int,
                      device: torch.device | str = "cpu") -> torch.Tensor:
    """The last stage's `values` (an `ndim`-dim tensor there, None on the other ranks) as float32
    on every rank of `group` (`stages` ranks): two broadcasts, its shape then its values."""
    shape = torch.zeros(ndim, dtype=torch.int64, device=device)
    if values is not None:
        values = values.float()
        if values.dim() != ndim:
            raise ValueError(f"the last stage's output has {values.dim()} dims, expected {ndim}")
        shape.copy_(torch.tensor(values.shape))
    from_last_stage(shape, group, stages)
    if values is None:
        values = torch.empty(tuple(shape.tolist()), dtype=torch.float32, device=device)
    return from_last_stage(values.contiguous(), group, stages)
