"""Quantize the operands of several GEMMs in one call: segments of rows, each an operand of its own.

A grouped GEMM (the experts of a mixture of experts, lowprec.sites.grouped_gemms) multiplies
many operands that lie one after the other along the rows of one tensor (expert e's routed
tokens, or its weight's rows). `quantize_segments` quantizes all of them in one pass, each
segment exactly as `quantize(segment, spec, ...)` quantizes it on its own:

* a scale that depends on the whole operand becomes one per segment: tensor-wise scaling's
  amax and NVFP4's per-tensor amax are per-segment maxima of the row maxima (a maximum is
  exact in any order), delayed scaling takes one given scale per segment; each is broadcast
  over its segment's rows, where `block_scales` computes the same FP32 scale from it. Row and
  1 x k / square block scales are local to their rows already (blocks never straddle two
  segments: every segment is a whole number of block rows);
* stochastic rounding takes the caller's noise (each segment drawn from its own generator, as
  its own quantization draws it), and the Hadamard transform is the caller's to apply per
  segment (each operand has its own signs);
* statistics are per segment: every count and sum of `quantize`'s statistics reduced over the
  segment's own rows, which are the segment's own contiguous memory, so each FP32 sum adds the
  same elements in the same order as the segment's own quantization does.

The result is the whole (the values of every row and a scale per block row, which
`dequantize_for_gemm` reads as they are) and one `Quantized` per segment, a view of its rows
with its own scale, amax and statistics, for what a caller keeps per operand (a weight cache, a
transposed reuse).
"""

from __future__ import annotations

import torch

from lowprec.numerics.formats import QuantSpec, ScaleEncoding, Scaling
from lowprec.numerics.quant_stats import QuantStats
from lowprec.numerics.quantize import (Quantized, _as_blocks, _block_of, _finite_amax, _scale_round, _stats,
                                       check_fits)

__all__ = ["quantize_segments"]


def _segment_block(spec: QuantSpec, k: int, n: int, transposed: bool) -> tuple[int, int]:
    """The block the segmented pass works in: a row of K for scales of a whole operand; with
    `transposed`, the block of a segment's transpose (K, n) turned round."""
    if spec.scaling in (Scaling.TENSOR, Scaling.DELAYED):
        return (1, k)
    if transposed:
        r, c = _block_of(spec, (k, n))
        return (c, r)
    return _block_of(spec, (1, k))


def quantize_segments(x2: torch.Tensor, spec: QuantSpec, lengths: list[int], *, amax: torch.Tensor | None = None,
                      scale: torch.Tensor | None = None, noise: torch.Tensor | None = None,
                      stats: bool = False, transposed: bool = False) -> tuple[Quantized, list[Quantized]]:
    """Quantize the 2-D `x2`, segments of `lengths` rows (each > 0), each as its own operand.

    amax: one per segment, used instead of its own (reduced over a group), as `quantize`'s amax.
    scale: one per segment, delayed scaling's (required there). noise: stochastic rounding's
    uniform draws, x2's shape. stats: attach each segment's QuantStats.
    transposed: each segment's transpose is the operand (`quantize(segment.t())`), quantized
    where it lies, by strides (its blocks turned round: a row scale is one per column of the
    segment, segments of equal length then): every value and scale is the transpose's own, the
    whole stays in x2's layout (for `dequantize_for_gemm`) and each view is the transpose's
    (a view, no copy). No statistics (their sums would add in another order).
    Returns (the whole, one view per segment); see the module docstring."""
    if transposed and (stats or (spec.scaling is Scaling.ROW and len(set(lengths)) > 1)):
        raise ValueError(f"quantize_segments(transposed=True) keeps no statistics and, row-wise, takes segments of "
                         f"one length (got stats={stats}, lengths {lengths})")
    rows, k = x2.shape
    block = _segment_block(spec, k, lengths[0] if lengths else 0, transposed)
    r = block[0]
    for n in lengths:
        check_fits(spec, (k, n) if transposed else (n, k))
        if n <= 0 or n % r:
            raise ValueError(f"segments of {lengths} rows: each must be a positive multiple of {r} rows")
    if sum(lengths) != rows:
        raise ValueError(f"segments of {lengths} rows do not cover the {rows} rows of the operand")
    if spec.scaling is Scaling.DELAYED and scale is None:
        raise ValueError("Scaling.DELAYED needs one scale per segment")
    x2 = x2.float()
    xb = _as_blocks(x2, block)
    fin, ax, bamax = _finite_amax(xb)
    brows = torch.tensor([n // r for n in lengths], device=x2.device)
    seg_amax = torch.segment_reduce(bamax.amax(dim=(1, 2, 3)), "max", lengths=brows)
    amax_t = scale_t = None
    if spec.scaling is Scaling.DELAYED:
        scale_t = scale.float().repeat_interleave(brows)
    elif spec.scaling is Scaling.TENSOR or spec.scale_encoding is ScaleEncoding.E4M3_FP32:
        amax_t = (seg_amax if amax is None else amax.float()).repeat_interleave(brows).reshape(-1, 1, 1, 1)
    values, sc, sc_inv, av, qa = _scale_round(xb, fin, ax, bamax, spec, amax_t, scale_t, noise, block)
    spans, s = [], 0
    for n in lengths:
        spans.append((s // r, (s + n) // r))
        s += n
    packed = _stats(xb, fin, ax, av, qa, sc, sc_inv, seg_amax, spec, spans) if stats else None
    whole = Quantized(values, sc, sc_inv, spec, x2.shape, seg_amax)
    per_operand = spec.scaling in (Scaling.TENSOR, Scaling.DELAYED)
    views = []
    for g, (a, b) in enumerate(spans):
        sa, sb = (a, a + 1) if per_operand else (a, b)    # one scale, or the segment's block rows
        view = Quantized(values[a * r:b * r], sc[sa:sb], sc_inv[sa:sb], spec, torch.Size((b * r - a * r, k)),
                         seg_amax[g], QuantStats(packed[g]) if stats else None)
        views.append(view.transposed() if transposed else view)
    return whole, views
