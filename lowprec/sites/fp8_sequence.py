"""Sequence parallel in FP8: a column-parallel site gathers its sequence-sharded input as FP8.

With sequence parallelism the activations between tensor-parallel regions are sharded
along the sequence, and a column-parallel linear layer's input is all-gathered first. The
tensor-parallel style `FP8SequenceColwiseParallel` hands the layer its input still
sharded (`Shard(1)`); `SequenceGatherFP8Fn` casts each rank's part to FP8 with the scale
of the whole gathered input (its amax all-reduced over the tensor-parallel group, and over
the data-parallel group under `amax_scope: group`; once for all the sites that read the same
input, through the model's `lowprec.sites.shared_amax.SharedAmax`), all-gathers the FP8 bytes (one byte
per element, not two), and runs the GEMM on the gathered FP8 input and the local weight
rows: the output is the local columns of the full sequence, as `ColwiseParallel` gives.
The backward casts the output gradient, reduce-scatters the input gradient (high
precision) back to the sequence shards, and forms the weight gradient from the gathered
FP8 input (its transpose: one scale). torchao's `Float8ColwiseParallel` is the model.

The gathered bytes equal the FP8 cast of the gathered high-precision input (one scale for
all shards), so the forward equals `ColwiseParallel(input_layouts=Shard(1))` on the fast
path bit for bit. Tensor-wise FP8 (`fp8_tensorwise`) only; other formats and other
styles gather in high precision.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from lowprec.numerics.formats import QuantSpec, Scaling
from lowprec.numerics.fp8_ops import ELEMENTS
from lowprec.numerics.quant_stats import QuantStats
from lowprec.numerics.quantize import quantize
from lowprec.sites.fp8_linear import _mm, _output_dtype

__all__ = ["SequenceGatherFP8Fn", "FP8SequenceColwiseParallel", "sequence_fp8_linear"]


def _amax(t: Tensor, groups) -> Tensor:
    a = torch.where(torch.isfinite(t), t.abs(), 0.0).amax().float()
    for g in groups:
        dist.all_reduce(a, op=dist.ReduceOp.MAX, group=g)
    return a


def _cast(t2: Tensor, elem: int, groups, stats: bool, shared=None):
    """shared: the model's `SharedAmax` (the input's amax, reduced once for the sites reading it)."""
    amax = _amax(t2, groups) if shared is None else shared.amax(t2, tuple(groups), _amax)
    q = quantize(t2, QuantSpec(ELEMENTS[elem], Scaling.TENSOR), amax=amax, stats=stats, validate=False)
    return q.to_storage().contiguous(), q.scale_inv.reshape(()).clone(), (q.stats.packed if stats else None)


class SequenceGatherFP8Fn(torch.autograd.Function):
    """y = all_gather_seq(x) @ w^T + b with the gather in FP8 (see the module docstring).
    x: this rank's (B, T/tp, K) part; w: the local (N/tp, K) rows; returns (B, T, N/tp)."""

    @staticmethod
    def forward(ctx, x, w, bias, qw, siw, qwt, siwt, grad_stats, meta):
        tp_group, dp_groups, _, recipe, shared = meta
        world = dist.get_world_size(tp_group)
        b, t, k = x.shape
        qx, six, stats_x = _cast(x.reshape(-1, k), recipe.fwd, (tp_group, *dp_groups), recipe.stats, shared)
        buf = torch.empty((world * qx.shape[0], k), dtype=torch.uint8, device=x.device)
        dist.all_gather_into_tensor(buf, qx.view(torch.uint8), group=tp_group)
        full = buf.view(qx.dtype).view(world, b, t, k).transpose(0, 1).reshape(b * world * t, k)
        y = _mm(full, six, qw, siw, _output_dtype(x), "fprop", recipe.gemm, bias)
        ctx.save_for_backward(full, six, qwt, siwt, grad_stats)
        ctx.meta, ctx.shape, ctx.x_dtype, ctx.w_dtype = meta, (b, t, k, world), x.dtype, w.dtype
        ctx.has_bias = bias is not None
        return y.reshape(b, world * t, -1), (stats_x if stats_x is not None else x.new_empty(0, dtype=torch.float64))

    @staticmethod
    def backward(ctx, gy, _gstats):
        full, six, qwt, siwt, grad_stats = ctx.saved_tensors
        tp_group, _, grad_groups, recipe, _ = ctx.meta
        b, t, k, world = ctx.shape
        g2 = gy.reshape(-1, gy.shape[-1])
        # each rank's dgrad is its own GEMM (a partial sum): one scale per rank suffices
        qg, sig, st = _cast(g2, recipe.bwd, grad_groups, recipe.stats and grad_stats is not None)
        if st is not None:
            grad_stats.copy_(st)
        dx_full = _mm(qg, sig, qwt, siwt, ctx.x_dtype, "dgrad", recipe.gemm)
        dx_full = dx_full.reshape(b, world, t, k).transpose(0, 1).reshape(-1, k)
        dx = torch.empty((b * t, k), dtype=ctx.x_dtype, device=gy.device)
        dist.reduce_scatter_tensor(dx, dx_full.contiguous(), group=tp_group)   # SUM of the partial input gradients
        dx = dx.reshape(b, t, k)
        dw = _mm(qg.t().contiguous(), sig, full.t().contiguous(), six, ctx.w_dtype, "wgrad", recipe.gemm)
        db = g2.sum(0, dtype=torch.float32) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None, None, None, None


def _gathers_fp8(module) -> bool:
    fast = getattr(module, "_fast", None)
    return fast is not None and fast[0].scaling is Scaling.TENSOR


def _style():
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel

    class FP8SequenceColwiseParallel(ColwiseParallel):
        """`ColwiseParallel` for a sequence-sharded input (`Shard(1)`): a PrecisionLinear in
        tensor-wise FP8 on the fast path gets the input still sharded and gathers it in FP8
        (`SequenceGatherFP8Fn`); any other format gets it gathered (high precision) first."""

        def __init__(self, *, use_local_output: bool = True):
            super().__init__(input_layouts=Shard(1), use_local_output=use_local_output)

        @staticmethod
        def _prepare_input_fn(input_layouts, desired_input_layouts, mod, inputs, device_mesh):
            desired = (Shard(1),) if _gathers_fp8(mod) else (Replicate(),)
            return ColwiseParallel._prepare_input_fn(input_layouts, desired, mod, inputs, device_mesh)

    return FP8SequenceColwiseParallel


def __getattr__(name: str):
    if name == "FP8SequenceColwiseParallel":   # built on first use: torch.distributed's TP imports are heavy
        return _style()
    raise AttributeError(name)


def sequence_fp8_linear(layer, x, w, recipe, forms, tp_dim: int, dp_groups: tuple, grad_groups: tuple) -> Tensor:
    """The layer's forward for a sequence-sharded DTensor input and column-sharded weight on
    mesh dimension `tp_dim` (a 1-D tensor-parallel mesh); forms: the local weight's casts;
    dp_groups: more groups the input's amax is reduced over; grad_groups: the output
    gradient's (empty: each rank's own)."""
    from torch.distributed.tensor import DTensor, Shard
    mesh = x.device_mesh
    group = mesh.get_group(tp_dim)
    x_l = x.to_local(grad_placements=x.placements)
    w_l = w.to_local(grad_placements=w.placements)
    bias = layer.bias.to_local() if hasattr(layer.bias, "to_local") else layer.bias
    grad_stats = (torch.zeros(len(QuantStats.FIELDS), dtype=torch.float64, device=x_l.device)
                  if recipe.stats and torch.is_grad_enabled() else None)
    y, stats_x = SequenceGatherFP8Fn.apply(x_l, w_l, bias, forms.q, forms.scale_inv, forms.q_t, forms.scale_inv,
                                           grad_stats, (group, dp_groups, grad_groups, recipe, layer.shared_amax))
    if recipe.stats:
        layer.stats["input"] = QuantStats(stats_x)
        layer.stats["weight"] = forms.stats
        if grad_stats is not None:
            layer.stats["grad_output"] = QuantStats(grad_stats)
    shape = (*x.shape[:-1], w.shape[0])
    stride = tuple(int(torch.Size(shape)[i + 1:].numel()) for i in range(len(shape)))
    return DTensor.from_local(y, mesh, (Shard(len(shape) - 1),), run_check=False, shape=torch.Size(shape),
                              stride=stride)
