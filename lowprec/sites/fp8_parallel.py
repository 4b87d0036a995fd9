"""The FP8 fast path where training is distributed: FSDP2, DTensor TP/SP, and DP x TP.

`PrecisionLinear` sends a call here when its format has a fast recipe
(`lowprec.sites.fp8_linear`) and an operand is a DTensor shard, or its activations'
amaxes are reduced over a data-parallel group. The GEMMs run on the local shards:

* column-parallel (weight Shard(0), input replicated): local GEMM, output Shard(-1);
* row-parallel (weight Shard(1), input Shard(-1)): the local GEMM's output is dequantized
  (`_scaled_mm` writes BF16/FP32) and returned as a Partial DTensor: the tensor-parallel
  style all-reduces the dequantized partial sums; the bias is added once (tp rank 0);
* a sequence-sharded input (Shard(1)) of a column-parallel tensor-wise site is gathered
  here as FP8 bytes (`lowprec.sites.fp8_sequence`, with its style
  `FP8SequenceColwiseParallel`); rows sharded over a mesh dimension that does not split
  the weight (data parallel inside the mesh) stay local.

DTensors are unwrapped with `to_local(grad_placements=...)` and the output wrapped with
`DTensor.from_local`, both differentiable, so the backward of the local GEMMs runs on
plain tensors too.

Amaxes (`lowprec.sites.amax_scope`): with `local` the casts are the fast path's own
(`FP8LinearFn`: each rank's shard scaled by its own amax). With `group`, `GroupFP8LinearFn`
reduces, before each cast, the amax over the groups the operand is split on: a
tensor-wise amax over every group, a row-wise one (one scale per row, along the GEMM's
reduction dimension) over the groups that split that dimension; a delayed-scaling
history records the reduced amax. Each cast then equals one process's cast of the whole
tensor, value for value, on this rank's part. Those casts use the reference quantizer
(`lowprec.numerics.quantize` with the reduced amax; on CUDA PyTorch ops, not the fused
Triton kernels, which compute their own amax).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor

from lowprec.numerics.delayed import history_record, history_scale
from lowprec.numerics.formats import QuantSpec, Scaling
from lowprec.numerics.fp8_ops import ELEMENTS
from lowprec.numerics.grid import saturates
from lowprec.numerics.quant_stats import QuantStats
from lowprec.numerics.quantize import quantize
from lowprec.sites.amax_scope import AmaxScope
from lowprec.sites.fp8_allgather import FP8GatheredWeight, unwrap
from lowprec.sites.fp8_linear import (FastRecipe, FP8LinearFn, GemmMeta, WeightForms, _mm, _output_dtype, grad_gemms,
                                      delayed_state)

__all__ = ["parallel_fast_linear", "OperandGroups", "GroupFP8LinearFn"]


class OperandGroups(NamedTuple):
    """The process groups a 2-D operand (M, K) is split on: rows (M), columns (K)."""

    rows: tuple
    cols: tuple

    @property
    def all(self) -> tuple:
        return self.rows + self.cols

    def t(self) -> "OperandGroups":
        return OperandGroups(self.cols, self.rows)


NONE = OperandGroups((), ())


def _unwrap(t: Tensor, grad_placements=None):
    """(local tensor, mesh, 2-D placements) of a tensor or DTensor (autograd flows through)."""
    from lowprec.sites.quantized_gemms import _to_local_2d
    if not hasattr(t, "to_local"):
        return t, None, None
    _, mesh, pl2 = _to_local_2d(t.detach())
    return t.to_local(grad_placements=grad_placements), mesh, pl2


def _groups(mesh, pl2, extra_rows=()) -> OperandGroups:
    rows = tuple(extra_rows)
    cols = ()
    if mesh is not None:
        for i, p in enumerate(pl2):
            if p.is_shard():
                if p.dim == 0:
                    rows += (mesh.get_group(i),)
                else:
                    cols += (mesh.get_group(i),)
    return OperandGroups(rows, cols)


# ----------------------------------------------------------------------------- casts with reduced amaxes

def _all_max(t: Tensor, groups: tuple) -> Tensor:
    for g in groups:
        t = t.clone()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=g)
    return t


def _finite_abs(t: Tensor) -> Tensor:
    t = t.float()
    return torch.where(torch.isfinite(t), t.abs(), 0.0)


def _empty(t: Tensor, *shape, dtype=torch.float32) -> Tensor:
    return torch.empty(shape, dtype=dtype, device=t.device)


def cast_group(t: Tensor, elem: int, recipe: FastRecipe, groups: OperandGroups, hist, overflow: Tensor | None,
               index: int, transpose: bool):
    """(q, scale_inv, q_t, scale_inv_t, packed stats) of one local operand, its amaxes
    reduced over `groups` first (the whole tensor's amaxes: one process's cast)."""
    element = ELEMENTS[elem]
    none_stats = _empty(t, 0, dtype=torch.float64)
    if recipe.delayed:
        scale = history_scale(hist.history, hist.count, element, recipe.margin, recipe.most_recent)
        ref = quantize(t, QuantSpec(element, Scaling.DELAYED), scale=scale, stats=recipe.stats, validate=False)
        amax = _all_max(ref.amax, groups.all)
        if recipe.count_overflow:
            overflow[index] += saturates(amax * scale * 0.5, element).to(overflow.dtype)
        history_record(hist.history, hist.count, amax)
        q = ref.to_storage().contiguous()
        si = ref.scale_inv.reshape(()).clone()
        qt = q.t().contiguous() if transpose else _empty(t, 0, 0, dtype=q.dtype)
        return q, si, qt, si, ref.stats.packed if recipe.stats else none_stats
    if not recipe.rowwise:
        amax = _all_max(_finite_abs(t).amax(), groups.all)
        ref = quantize(t, QuantSpec(element, Scaling.TENSOR), amax=amax, stats=recipe.stats, validate=False)
        q = ref.to_storage().contiguous()
        si = ref.scale_inv.reshape(()).clone()
        qt = q.t().contiguous() if transpose else _empty(t, 0, 0, dtype=q.dtype)
        return q, si, qt, si, ref.stats.packed if recipe.stats else none_stats
    spec = QuantSpec(element, Scaling.ROW)
    a = _finite_abs(t)
    ref = quantize(t, spec, amax=_all_max(a.amax(dim=1), groups.cols), stats=recipe.stats, validate=False)
    q, si = ref.to_storage().contiguous(), ref.scale_inv.reshape(-1, 1).clone()
    qt, sit = _empty(t, 0, 0, dtype=q.dtype), _empty(t, 0, 1)
    if transpose:
        ref_t = quantize(t.t(), spec, amax=_all_max(a.amax(dim=0), groups.rows), validate=False)
        qt, sit = ref_t.to_storage().contiguous(), ref_t.scale_inv.reshape(-1, 1).clone()
    return q, si, qt, sit, ref.stats.packed if recipe.stats else none_stats


class GroupFP8LinearFn(torch.autograd.Function):
    """`FP8LinearFn` with the input's and the output gradient's amaxes reduced over their
    groups (`amax_scope: group`); the weight's forms are given, cast the same way."""

    @staticmethod
    def forward(ctx, x, w, bias, qw, siw, qwt, siwt, hist_x, hist_g, overflow, grad_stats,
                recipe: FastRecipe, gx: OperandGroups, gg: OperandGroups):
        x2 = x.reshape(-1, x.shape[-1])
        need_dw = ctx.needs_input_grad[1]
        qx, six, qxt, sixt, stats_x = cast_group(x2, recipe.fwd, recipe, gx, hist_x, overflow, 0, need_dw)
        y = _mm(qx, six, qw, siw, _output_dtype(x), "fprop", recipe.gemm, bias)
        ctx.save_for_backward(qxt, sixt, qwt, siwt, overflow, grad_stats)
        ctx.hist_g, ctx.gg = hist_g, gg
        ctx.meta = GemmMeta(recipe, x.shape, x.dtype, w.dtype, bias is not None, 14)
        ctx.mark_non_differentiable(stats_x)
        ctx.set_materialize_grads(False)
        return y.reshape(*x.shape[:-1], y.shape[-1]), stats_x

    @staticmethod
    def backward(ctx, gy, _gstats):
        qxt, sixt, qwt, siwt, overflow, grad_stats = ctx.saved_tensors
        meta = ctx.meta
        recipe = meta.recipe
        g2 = gy.reshape(-1, gy.shape[-1])
        qg, sig, qgt, sigt, st = cast_group(g2, recipe.bwd, recipe, ctx.gg, ctx.hist_g, overflow, 2,
                                            ctx.needs_input_grad[1])
        if recipe.stats and grad_stats is not None:
            grad_stats.copy_(st)
        return grad_gemms(ctx.needs_input_grad, meta, g2, (qg, sig, qgt, sigt), (qwt, siwt),
                          (qxt, sixt)) + (None,) * (meta.n_inputs - 3)


class _BiasOnce(torch.autograd.Function):
    """The bias on one rank of a partial-sum output (zeros elsewhere); every rank's bias
    gradient is the whole one (the output gradient is replicated there)."""

    @staticmethod
    def forward(ctx, b, keep: bool):
        return b if keep else torch.zeros_like(b)

    @staticmethod
    def backward(ctx, g):
        return g, None


# ----------------------------------------------------------------------------- the layer's call

def _sequence(layer, x, w, recipe: FastRecipe, weight_forms, delayed, tp_dim: int, dp: tuple) -> Tensor:
    """A sequence-sharded input of a column-parallel site: gathered in FP8 (lowprec.sites.fp8_sequence).
    The gathered input needs one scale (its amax over the tp group) in either scope; with
    `group` the weight's and the output gradient's amaxes are the whole tensors' too."""
    from lowprec.sites.fp8_sequence import sequence_fp8_linear
    tp = x.device_mesh.get_group(tp_dim)
    w_l = unwrap(w.to_local().detach())
    if layer.amax_scope is AmaxScope.GROUP and not isinstance(w_l, FP8GatheredWeight):   # gathered: scaled already
        forms = _weight_forms_group(w_l, recipe, OperandGroups((tp,), ()), delayed(layer, "weight", recipe),
                                    layer.overflow_steps)
    else:
        forms = weight_forms(layer, w_l, recipe)
    grad_groups = (tp, *dp) if layer.amax_scope is AmaxScope.GROUP else ()
    return sequence_fp8_linear(layer, x, w, recipe, forms, tp_dim, dp, grad_groups)


def _nd(pl2, ndim: int, lead):
    """2-D placements (rows, columns) in the terms of an N-D tensor whose leading dims are
    the rows: Shard(1) is the last dim, Shard(0) the leading dim `lead` is sharded on."""
    from torch.distributed.tensor import Shard
    out = []
    for i, p in enumerate(pl2):
        if p.is_shard() and p.dim == 1:
            p = Shard(ndim - 1)
        elif p.is_shard():
            p = Shard(lead[i].dim % ndim if lead is not None and lead[i].is_shard() else 0)
        out.append(p)
    return tuple(out)


def _weight_forms_group(w: Tensor, recipe: FastRecipe, gw: OperandGroups, hist, overflow: Tensor) -> WeightForms:
    q, si, qt, sit, st = cast_group(w.detach(), recipe.fwd, recipe, gw, hist, overflow, 1, True)
    return WeightForms(q, si, qt, sit, QuantStats(st) if recipe.stats else None)


def parallel_fast_linear(layer, x: Tensor, w: Tensor, recipe: FastRecipe, weight_forms, delayed) -> Tensor:
    """The layer's forward on the fast path for DTensor shards and data-parallel amaxes
    (see the module docstring); statistics into `layer.stats` on check steps.

    recipe: the step's recipe (one of `fp8_linear.step_recipes`: statistics on or off), whose
    `gemm` every GEMM here runs with.
    weight_forms(layer, w, recipe) -> WeightForms (the layer's cached weight casts) and
    delayed(layer, operand, recipe) -> DelayedTensors: the layer's own helpers."""
    from torch.distributed.tensor import Replicate
    from lowprec.sites.quantized_gemms import _gemm_placements, _t_placements, _to_local_2d, _wrap

    mesh_x = getattr(x, "device_mesh", None) if hasattr(x, "to_local") else None
    mesh_w = getattr(w, "device_mesh", None) if hasattr(w, "to_local") else None
    if (mesh_x is None) != (mesh_w is None):
        kinds = ["DTensor" if m is not None else "plain" for m in (mesh_x, mesh_w)]
        raise TypeError(f"PrecisionLinear {layer.fqn!r} got a {kinds[0]} input and a {kinds[1]} weight; convert "
                        f"both to DTensors on one mesh (a tensor-parallel style does this for the input) or neither")
    mesh = mesh_x or mesh_w
    group_scope = layer.amax_scope is AmaxScope.GROUP
    dp = (layer.amax_group,) if group_scope and layer.amax_group is not None else ()
    bias, partial = layer.bias, False
    if mesh is None:
        x_l, w_l, gx, gw, gg = x, w, OperandGroups(dp, ()), NONE, OperandGroups(dp, ())
    else:
        px, pw = _to_local_2d(x.detach())[2], _to_local_2d(w.detach())[2]
        seq = [i for i, (a, b) in enumerate(zip(px, pw)) if a.is_shard(0) and b.is_shard(0)]
        if seq and mesh.ndim == 1 and x.ndim == 3 and recipe.scaling is Scaling.TENSOR:
            return _sequence(layer, x, w, recipe, weight_forms, delayed, seq[0], dp)
        out_pl = _gemm_placements(px, pw, mesh)
        pg = tuple(Replicate() if p.is_partial() else p for p in out_pl)   # the output gradient's
        dx_pl = _nd(_gemm_placements(pg, _t_placements(pw), mesh), x.ndim, x.placements)
        dw_pl = _gemm_placements(_t_placements(pg), _t_placements(px), mesh)
        x_l, w_l = x.to_local(grad_placements=dx_pl), w.to_local(grad_placements=dw_pl)
        gx, gw, gg = _groups(mesh, px, dp), _groups(mesh, pw), _groups(mesh, pg, dp)
        if not group_scope:
            gx = gw = gg = NONE
        if bias is not None:
            bias = bias.to_local() if hasattr(bias, "to_local") else bias
            partial = any(p.is_partial() for p in out_pl)
    stats = recipe.stats
    # a tp shard that FSDP2 gathered as FP8 bytes (lowprec.sites.fp8_allgather) is already
    # scaled by the whole weight's amax: the bytes `_weight_forms_group` would cast
    w_l = unwrap(w_l)   # gathered in high precision: the plain tensor it holds
    gathered = isinstance(w_l, FP8GatheredWeight)
    forms = (_weight_forms_group(w_l, recipe, gw, delayed(layer, "weight", recipe), layer.overflow_steps)
             if gw.all and not gathered else weight_forms(layer, w_l, recipe))
    grad_stats = (torch.zeros(len(QuantStats.FIELDS), dtype=torch.float64, device=x_l.device)
                  if stats and torch.is_grad_enabled() and not torch.compiler.is_compiling() else None)
    fused_bias = None if partial else bias
    hx, hg = delayed(layer, "input", recipe), delayed(layer, "grad_output", recipe)
    if group_scope and (gx.all or gg.all or gw.all):
        y, stats_x = GroupFP8LinearFn.apply(x_l, w_l, fused_bias, forms.q, forms.scale_inv, forms.q_t,
                                            forms.scale_inv_t, hx, hg, layer.overflow_steps, grad_stats,
                                            recipe, gx, gg)
    else:
        state = delayed_state(layer.overflow_steps, hx, hg) if recipe.delayed else ()
        y, stats_x = FP8LinearFn.apply(x_l, w_l, fused_bias, forms.q, forms.scale_inv, forms.q_t,
                                       forms.scale_inv_t if recipe.rowwise else None, grad_stats, recipe, None,
                                       *state)
    if partial:
        keep = all(mesh.get_local_rank(i) == 0 for i, p in enumerate(out_pl) if p.is_partial())
        b = _BiasOnce.apply(bias, keep)
        y = y + (b if b.dtype == y.dtype else b.float()).to(y.dtype)
    if stats:
        layer.stats["input"] = QuantStats(stats_x)
        layer.stats["weight"] = forms.stats
        if grad_stats is not None:
            layer.stats["grad_output"] = QuantStats(grad_stats)
    if mesh is None:
        return y
    return _wrap(y, mesh, out_pl, x_l.shape, (*x.shape[:-1], w.shape[0]), x.placements)
