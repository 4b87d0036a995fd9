"""The global gradient norm of a model split over ranks, formed as one process forms it.

`torch.nn.utils.clip_grad_norm_` takes the 2-norm of the per-parameter 2-norms, in the
model's parameter order. When the parameters are split over ranks (DTensor shards under
tensor parallel or FSDP2, whole parameters on different pipeline stages), `grad_norm`
forms the same number with one SUM all-reduce: a whole tensor contributes its norm from one
rank, a shard its squared norm (the shards' squares sum to the whole's). Every rank gets
the same result. `clip_` then scales the local gradients as `clip_grad_norm_` does.
The engines of `lowprec.runtime.fsdp` and `lowprec.runtime.parallel` use it.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["local_grad", "is_sharded", "grad_norm", "clip_"]


def local_grad(t: torch.Tensor) -> torch.Tensor:
    """The local tensor of a gradient; a partial sum (Partial placement) is refused, since
    its local values are not this rank's share of the gradient."""
    if not hasattr(t, "to_local"):
        return t
    if any(p.is_partial() for p in t.placements):
        raise ValueError(f"a gradient has placements {t.placements}; reduce it (redistribute to "
                         f"Replicate or Shard) before the data-parallel reduction and the norm")
    return t.to_local()


def is_sharded(t: torch.Tensor) -> bool:
    """A DTensor sharded over its mesh (a replicated one counts once, not per rank)."""
    return any(p.is_shard() for p in getattr(t, "placements", ()))


@torch.no_grad()
def grad_norm(slots: list[torch.Tensor | None], whole: list[bool], group) -> torch.Tensor:
    """The global 2-norm of the gradients of all parameters of the model.

    slots: per parameter of the whole model, in its order, this rank's gradient (a DTensor
        shard, a whole tensor) or None where the parameter lives on another rank.
    whole: per slot, whether this rank contributes that whole tensor's norm (one rank per
        replicated parameter). A sharded gradient contributes its shard's squared norm.
    One SUM all-reduce over `group` combines them; every rank gets the same number.
    """
    local = [local_grad(g) for g in slots if g is not None]
    norms = iter(torch._foreach_norm(local, 2.0)) if local else iter(())
    n = len(slots)
    packed = torch.zeros(2 * n, dtype=torch.float32, device=local[0].device if local else None)
    for i, g in enumerate(slots):
        if g is None:
            continue
        v = next(norms).float()
        if is_sharded(g):
            packed[n + i] = v * v
        elif whole[i]:
            packed[i] = v
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(packed, group=group)
    per_param = packed[:n] + packed[n:].sqrt()
    return torch.linalg.vector_norm(per_param, 2.0)


@torch.no_grad()
def clip_(grads: list[torch.Tensor], total: torch.Tensor, max_norm: float | None) -> None:
    """Scale the gradients by min(max_norm / (total + 1e-6), 1), as clip_grad_norm_ does
    (max_norm None: leave them as they are)."""
    coef = torch.clamp((math.inf if max_norm is None else max_norm) / (total + 1e-6), max=1.0)
    for g in grads:
        local_grad(g).mul_(coef)
