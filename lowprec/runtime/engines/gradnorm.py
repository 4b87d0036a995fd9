"""The global gradient norm of a model split over ranks, and the clip by it.

    total = clip_global(params, max_norm)              # DTensor gradients: FSDP2, HSDP, TP
    total = clip_stages(slots, group, max_norm)        # whole parameters on pipeline stages

`clip_global` is torch's: `torch.nn.utils.get_total_norm` over the DTensor gradients
(DTensor reduces a sharded gradient's norm over its mesh, a replicated one counts once),
then `torch.nn.utils.clip_grads_with_norm_`, as torchtitan's `clip_grad_norm_` does. The
GPT's tensor-parallel plan leaves embeddings and norms out of DTensor, so FSDP2 puts them
on the data-parallel mesh and the tp-sharded weights on the (data, tp) mesh: each mesh's
gradients get their own total norm, and the total is the norm of those.

`clip_stages` is the one lowprec reduction left: under pipeline stages each rank holds
whole parameters of its own stage, and the norm is formed exactly as
`torch.nn.utils.clip_grad_norm_` forms it in one process (the 2-norm of the per-parameter
2-norms, in the whole model's parameter order) with one SUM all-reduce over the stages: a
stage writes the norms of its parameters into their slots, the others zeros. The pipeline's
losses equal one process's bit for bit through it (tests/experiments/test_parallel_parity.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

__all__ = ["clip_global", "clip_stages"]


def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of `grads` (plain tensors, or DTensors of one mesh) as a plain tensor on every rank."""
    total = torch.nn.utils.get_total_norm(grads, 2.0, foreach=True)
    return total.full_tensor() if hasattr(total, "full_tensor") else total


@torch.no_grad()
def clip_global(params, max_norm: float | None) -> torch.Tensor:
    """Clip the gradients of `params` by their global 2-norm (max_norm None: measure only);
    returns the norm before clipping, a plain tensor, the same on every rank."""
    by_mesh: dict = {}
    for p in params:
        if p.grad is not None:
            by_mesh.setdefault(getattr(p.grad, "device_mesh", None), []).append(p)
    if not by_mesh:
        return torch.zeros(())
    parts = [_norm([p.grad for p in ps]) for ps in by_mesh.values()]
    total = parts[0] if len(parts) == 1 else torch.linalg.vector_norm(torch.stack(parts), 2.0)
    for ps in by_mesh.values():   # DTensor multiplies tensors of one mesh at a time
        torch.nn.utils.clip_grads_with_norm_(ps, math.inf if max_norm is None else max_norm, total, foreach=True)
    return total


@torch.no_grad()
def clip_stages(slots: list[torch.nn.Parameter | None], group, max_norm: float | None) -> torch.Tensor:
    """Clip by the global 2-norm of a model split into pipeline stages; returns it (before clipping).

    slots: per parameter of the whole model, in its order, this rank's Parameter, or None where
        it lives on another stage. One SUM all-reduce of the per-parameter norms over `group`
        gives every rank the same number.
    """
    slots = [p if p is not None and p.grad is not None else None for p in slots]
    mine = [p for p in slots if p is not None]
    norms = iter(torch._foreach_norm([p.grad for p in mine], 2.0)) if mine else iter(())
    per_param = torch.zeros(len(slots), dtype=torch.float32, device=mine[0].device if mine else None)
    for i, p in enumerate(slots):
        if p is not None:
            per_param[i] = next(norms).float()
    if group is not None and dist.get_world_size(group) > 1:
        dist.all_reduce(per_param, group=group)
    total = torch.linalg.vector_norm(per_param, 2.0)
    if mine:
        torch.nn.utils.clip_grads_with_norm_(mine, math.inf if max_norm is None else max_norm, total, foreach=True)
    return total
