"""The autograd function behind `PrecisionLinear`: three GEMMs with quantized operands.

    fprop  y  = x  @ w^T      operands (input, weight)
    dgrad  dx = dy @ w        operands (grad_output, weight^T)
    wgrad  dw = dy^T @ x      operands (grad_output_wgrad, input_wgrad), K = tokens

`QuantizedLinearFn` takes tensors, the format (the recipe) and an `OperandQuantizer`
(lowprec.sites.operand_quantizer: scaling, delayed histories, statistics, the weight cache,
the backend), never the layer. This module decides which quantizations the backward can
reuse transposed, pads the wgrad token dimension to whole blocks, runs the GEMMs, and
carries DTensor operands through: local shards in, results wrapped back with the
placements a GEMM of those shards has; the groups an operand is sharded over go to each
quantization as an argument.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from lowprec.numerics.formats import Format, QuantSpec, Rounding, Scaling
from lowprec.numerics.quantize import Quantized
from lowprec.sites.operand_quantizer import OperandQuantizer

__all__ = ["QuantizedLinearFn"]


# ---------------------------------------------------------------------- DTensor plumbing

def _dtensor_type():
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch < 2.4
        return None
    return DTensor


def _to_local_2d(t: torch.Tensor):
    """(local 2-D tensor, mesh, placements in 2-D terms) for a tensor or DTensor."""
    DTensor = _dtensor_type()
    if DTensor is None or not isinstance(t, DTensor):
        return t.reshape(-1, t.shape[-1]), None, None
    from torch.distributed.tensor import Partial, Replicate, Shard
    placements = []
    for p in t.placements:
        if isinstance(p, Shard):
            dim = p.dim % t.ndim
            placements.append(Shard(1 if dim == t.ndim - 1 else 0))
        elif isinstance(p, (Replicate, Partial)):
            if isinstance(p, Partial):
                raise ValueError("PrecisionLinear got a Partial DTensor operand; redistribute it "
                                 "to Replicate or Shard first")
            placements.append(Replicate())
    local = t.to_local()
    return local.reshape(-1, local.shape[-1]), t.device_mesh, tuple(placements)


def _t_placements(pl):
    from torch.distributed.tensor import Shard
    return None if pl is None else tuple(Shard(1 - p.dim) if p.is_shard() else p for p in pl)


def _gemm_placements(pa, pb, mesh):
    """Placements of a @ b^T from the operands' placements, per mesh dimension."""
    from torch.distributed.tensor import Partial, Replicate, Shard
    if pa is None and pb is None:
        return None
    n = mesh.ndim
    pa = pa or (Replicate(),) * n
    pb = pb or (Replicate(),) * n
    out = []
    for a, b in zip(pa, pb):
        sa = a.dim if a.is_shard() else None
        sb = b.dim if b.is_shard() else None
        if sa is None and sb is None:
            out.append(Replicate())
        elif sa == 1 and sb == 1:
            out.append(Partial())
        elif sa is None and sb == 0:
            out.append(Shard(1))
        elif sa == 0 and sb is None:
            out.append(Shard(0))
        else:
            raise ValueError(f"unsupported sharding for a quantized GEMM: {a} x {b}^T")
    return tuple(out)


def _shard_groups(mesh, placements) -> list:
    """The process groups of the mesh dimensions an operand with `placements` is sharded on."""
    if mesh is None or placements is None:
        return []
    return [mesh.get_group(i) for i, p in enumerate(placements) if p.is_shard()]


class QuantizedLinearFn(torch.autograd.Function):
    """fprop / dgrad / wgrad with quantized operands (see the module docstring).

    Inputs: x, w, bias (tensors or DTensors), `fmt` (the format: which spec each GEMM role
    quantizes with) and `quant` (the site's `OperandQuantizer`). Returns y. The statistics
    and delayed-scaling amaxes of the operands go into `quant`'s holders."""

    @staticmethod
    def forward(ctx, x, w, bias, fmt: Format, quant: OperandQuantizer):
        x2, mesh_x, px = _to_local_2d(x)
        w2, mesh_w, pw = _to_local_2d(w)
        if (mesh_x is None) != (mesh_w is None):
            kinds = ["DTensor" if m is not None else "plain" for m in (mesh_x, mesh_w)]
            raise TypeError(
                f"PrecisionLinear {quant.fqn!r} got a {kinds[0]} input and a {kinds[1]} weight; "
                f"as in DTensor's own operators, convert both to DTensors on one mesh (a "
                f"tensor-parallel style does this for the input) or neither")
        mesh = mesh_x or mesh_w
        qx = quant.quantize(x2, fmt, "input", shard_groups=_shard_groups(mesh, px))
        qw = quant.quantize(w2, fmt, "weight", shard_groups=_shard_groups(mesh, pw))
        y_dtype = _output_dtype(x)
        y = quant.gemm(qx, qw, y_dtype)
        out_pl = _gemm_placements(px, pw, mesh) if mesh is not None else None
        if bias is not None:
            b = bias.to_local() if hasattr(bias, "to_local") else bias
            if out_pl is not None:  # a Partial output: only one rank of that group adds it
                for i, p in enumerate(out_pl):
                    if p.is_partial() and mesh.get_local_rank(i) != 0:
                        b = torch.zeros_like(b)
            y = y + (b if b.dtype == y.dtype else b.float())   # BF16 + BF16: one rounding
        x_local_shape = x.to_local().shape if mesh_x is not None else x.shape
        # Layout-invariant quantizations are reused, transposed, by the backward GEMMs
        # (see _transposable); the input itself is then not needed there.
        ctx.qx = (qx if _transposable(fmt.input, fmt.input_wgrad, qx)
                  and x2.shape[0] % _token_multiple(fmt) == 0 else None)
        ctx.qw = qw if _transposable(fmt.weight, fmt.weight, qw) else None
        # where the backward must quantize them again, it does so with the forward's scales
        ctx.scales = (_delayed_scale(qx), _delayed_scale(qw))
        ctx.save_for_backward(None if ctx.qx is not None else x2, w2)
        ctx.quant, ctx.fmt, ctx.has_bias = quant, fmt, bias is not None
        ctx.meta = (x_local_shape, x.dtype, mesh, px, pw)
        y = y.to(y_dtype)
        if mesh is None:
            return y.reshape(*x.shape[:-1], y.shape[-1])
        # global shapes: from_local would assume even shards; x's leading placements
        # tell which dim a row shard is (a sequence-sharded input is Shard(1), not Shard(0))
        ctx.global_shapes = (x.shape, w.shape, None if bias is None else bias.shape, x.placements)
        return _wrap(y, mesh, out_pl, x_local_shape, (*x.shape[:-1], w.shape[0]), x.placements)

    @staticmethod
    def backward(ctx, gy):
        x2, w2 = ctx.saved_tensors
        quant, fmt = ctx.quant, ctx.fmt
        x_shape, x_dtype, mesh, px, pw = ctx.meta
        g2, _, pg = _to_local_2d(gy)
        groups_g, groups_w, groups_x = _shard_groups(mesh, pg), _shard_groups(mesh, pw), _shard_groups(mesh, px)
        dx = dw = db = qg = None
        scale_x, scale_w = ctx.scales
        if ctx.needs_input_grad[0]:
            qg = quant.quantize(g2, fmt, "grad_output", shard_groups=groups_g)
            qwt = (_transpose(ctx.qw) if ctx.qw is not None
                   else quant.quantize(w2.t(), fmt, "weight", shard_groups=groups_w, record=False, scale=scale_w))
            dx = quant.gemm(qg, qwt, x_dtype).to(x_dtype)
            if mesh is None:
                dx = dx.reshape(x_shape)
            else:
                gx, _, _, x_pl = ctx.global_shapes
                dx = _wrap(dx, mesh, _gemm_placements(pg, _t_placements(pw), mesh), x_shape,
                           gx, x_pl)
        if ctx.needs_input_grad[1]:
            # the forward's / dgrad's quantizations, transposed, where that is exact
            # and the token dimension needs no padding (checked in forward for qx)
            reuse_g = (g2.shape[0] % _token_multiple(fmt) == 0
                       and _transposable(fmt.grad_output, fmt.grad_output_wgrad, qg))
            # without dgrad (an input that needs no gradient) this is grad_output's only
            # quantization in the step: it records the amax and keeps the statistics
            again = dict(shard_groups=groups_g, record=qg is None, scale=_delayed_scale(qg))
            if ctx.qx is not None:
                qgt = (_transpose(qg) if reuse_g
                       else quant.quantize(g2.t(), fmt, "grad_output_wgrad", **again))
                qxt = _transpose(ctx.qx)
            else:
                gt, xt = _pad_tokens(g2.t(), x2.t(), fmt)
                qgt = (_transpose(qg) if reuse_g
                       else quant.quantize(gt, fmt, "grad_output_wgrad", **again))
                qxt = quant.quantize(xt, fmt, "input_wgrad", shard_groups=groups_x, record=False, scale=scale_x)
            dw = quant.gemm(qgt, qxt, w2.dtype).to(w2.dtype)
            if mesh is not None:
                dw = _wrap(dw, mesh, _gemm_placements(_t_placements(pg), _t_placements(px), mesh),
                           None, ctx.global_shapes[1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            db = g2.float().sum(0)
            if mesh is not None:
                from torch.distributed.tensor import Partial, Replicate, Shard
                # columns sharded: a shard of the bias; rows (tokens) sharded: a partial sum
                pl = tuple(Replicate() if not p.is_shard() else Shard(0) if p.dim == 1
                           else Partial() for p in pg)
                db = _wrap(db, mesh, pl, None, ctx.global_shapes[2])
        return dx, dw, db, None, None


def _pad_tokens(gt: torch.Tensor, xt: torch.Tensor, fmt: Format):
    """Zero-pad the token dimension of the wgrad operands to a whole number of blocks.

    The token count is a property of the batch, not of the layer, so it cannot be
    checked when the plan is made; zeros change neither an amax nor the GEMM result.
    """
    pad = (-gt.shape[1]) % _token_multiple(fmt)
    if pad:
        gt, xt = F.pad(gt, (0, pad)), F.pad(xt, (0, pad))
    return gt, xt


def _token_multiple(fmt: Format) -> int:
    """The multiple of which the wgrad operands' token dimension must be."""
    multiple = 1
    for spec in (fmt.grad_output_wgrad, fmt.input_wgrad):
        if spec is not None and spec.scaling is Scaling.BLOCK:
            multiple = math.lcm(multiple, spec.block[1])
        if spec is not None and spec.hadamard:
            multiple = math.lcm(multiple, 16)
    return multiple


def _transposable(spec: QuantSpec | None, spec_t: QuantSpec | None, q) -> bool:
    """Whether quantizing the transpose with `spec_t` gives exactly the transpose of `q`
    (`spec`'s quantization of the operand), so the backward can reuse `q`.

    True when both specs are the same and layout-invariant: one scale per tensor (from its
    current amax, Scaling.TENSOR, or from its history, Scaling.DELAYED: the step's one
    scale, as Transformer Engine's backward uses the forward's FP8 tensor and its
    transpose), or square 2-D blocks (128x128, NVFP4's 16x16 weights), rounded to nearest
    (stochastic rounding would draw other noise) without a Hadamard transform. Amaxes
    are maxima, so every scale and every element comes out bit for bit the same.
    """
    if spec is None or spec != spec_t or not isinstance(q, Quantized):
        return False
    if spec.rounding is not Rounding.NEAREST_EVEN or spec.hadamard:
        return False
    return spec.scaling in (Scaling.TENSOR, Scaling.DELAYED) or (
        spec.scaling is Scaling.BLOCK and spec.block[0] == spec.block[1])


def _delayed_scale(q) -> torch.Tensor | None:
    """The one scale of a delayed-scaling quantization (None for any other)."""
    if not isinstance(q, Quantized) or q.spec.scaling is not Scaling.DELAYED:
        return None
    return q.scale.reshape(())


def _transpose(q: Quantized) -> Quantized:
    """The transpose of a 2-D `Quantized` (blocks are square or the whole tensor). A cached
    weight's FP8 storage is transposed once and kept with it (`storage_t`)."""
    if q.storage is not None and q.storage_t is None:
        q.storage_t = q.storage.t().contiguous()
    out = q.transposed()
    out.storage = q.storage_t
    return out


def _output_dtype(x: torch.Tensor) -> torch.dtype:
    """The forward output's dtype: the input's, or on CUDA under autocast the autocast dtype
    (what F.linear returns there). CPU autocast is left alone: CPU numerics do not change."""
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return x.dtype


def _wrap(t, mesh, placements, lead_shape, global_shape, lead_placements=None):
    """Wrap a local result as a DTensor of `global_shape` (uneven shards included).

    With `lead_shape` (x's local shape), a 2-D result is reshaped to x's local leading
    dims plus its columns, and its 2-D placements are put back in x's terms: Shard(1)
    (columns) is the last dim, Shard(0) (rows) the leading dim that x is sharded on
    along that mesh dim (`lead_placements`, x's own placements).
    """
    from torch.distributed.tensor import DTensor, Shard
    if lead_shape is not None:
        t = t.reshape(*lead_shape[:-1], t.shape[-1])
        out = []
        for i, p in enumerate(placements):
            if p.is_shard() and p.dim == 1:
                p = Shard(t.ndim - 1)
            elif p.is_shard() and lead_placements is not None and lead_placements[i].is_shard():
                p = Shard(lead_placements[i].dim % t.ndim)
            out.append(p)
        placements = tuple(out)
    shape = torch.Size(global_shape)
    stride = tuple(math.prod(shape[i + 1:]) for i in range(len(shape)))
    return DTensor.from_local(t, mesh, placements, run_check=False, shape=shape, stride=stride)
