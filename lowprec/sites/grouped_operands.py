"""One quantization call per format group: the operands of all the experts that share a format.

`GroupedQuantizedFn` (lowprec.sites.grouped_gemms) multiplies the operands of a format group's
experts in one grouped GEMM; this module quantizes each of those operands in one call too
(`lowprec.numerics.segments.quantize_segments`: each expert a segment of rows, quantized as its
own `OperandQuantizer.quantize` would). What stays each expert's own: its delayed-scaling
history and scale (one per segment), its stochastic-rounding generator (each segment's noise
drawn from it), its Hadamard signs (applied per segment), its statistics (reduced per segment)
and its weight cache (a group whose experts' weights all hit their caches takes them; one miss
quantizes the group's weights in one call and refills every cache).

Expert by expert still, the same numbers: a fused (torch.compile) quantizer, and an operand whose
amax is all-reduced over a process group (each expert's collective is its own call).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from lowprec.numerics.formats import Format, QuantSpec, Rounding, ScaleEncoding, Scaling
from lowprec.numerics.quantize import Quantized
from lowprec.numerics.segments import quantize_segments
from lowprec.sites.backends.emulated import dequantize_for_gemm
from lowprec.sites.operand_quantizer import OperandQuantizer, bf16_round

__all__ = ["quantize_group", "quantize_group_weights", "quantize_group_columns", "quantize_group_tokens"]


def _per_expert(spec: QuantSpec, quants: list[OperandQuantizer], role: str) -> bool:
    """Whether the group must be quantized expert by expert (see the module docstring)."""
    if any(q.fused for q in quants):
        return True
    collective = (spec.scaling in (Scaling.TENSOR, Scaling.DELAYED)
                  or spec.scale_encoding is ScaleEncoding.E4M3_FP32)
    return collective and any(q.amax_groups(role) for q in quants)


def _segments(parts: list[torch.Tensor], spec: QuantSpec, quants: list[OperandQuantizer], role: str, scales,
              record: bool, whole: torch.Tensor | None = None, width: int | None = None,
              transposed: bool = False) -> tuple[Quantized, list[Quantized]]:
    """quantize_segments over the experts' operands `parts` (`whole`: them stacked along the rows
    already; `width`: each zero-padded to that many columns, a segment of its rows; `transposed`:
    each part's transpose the operand, `_by_strides`): each expert's Hadamard signs, noise,
    delayed scale, history and statistics its own."""
    if spec.hadamard:   # each expert's own signs
        parts, whole = [q.hadamard.apply(p.float()) for q, p in zip(quants, parts)], None
    noise = None
    if spec.rounding is Rounding.STOCHASTIC:   # each expert's draws from its own generator, as its quantize draws
        noise = _stacked([torch.rand(p.shape, generator=q.generator, device=p.device, dtype=torch.float32)
                          for q, p in zip(quants, parts)], width)
    scale = None
    if spec.scaling is Scaling.DELAYED:
        scales = scales or [None] * len(quants)
        scales = [q.delayed_scale(spec, role) if s is None else s for q, s in zip(quants, scales)]
        scale = torch.stack([torch.as_tensor(s, dtype=torch.float32, device=parts[0].device).reshape(())
                             for s in scales])
    stats = record and any(q.collect_stats for q in quants)
    t = whole if whole is not None and width is None else _stacked(parts, width)
    whole, views = quantize_segments(t, spec, [p.shape[0] for p in parts], scale=scale, noise=noise, stats=stats,
                                     transposed=transposed)
    for g, (q, v) in enumerate(zip(quants, views)):
        q.keep(v, role, None if scale is None else scale[g], [], record)
    return whole, views


def _stacked(parts: list[torch.Tensor], width: int | None, height: int | None = None) -> torch.Tensor:
    """The parts one under the other (each zero-padded to `width` columns, or `height` rows, where
    given), FP32."""
    if width is None and height is None:
        return torch.cat([p.float() for p in parts])
    if height is not None:
        out = parts[0].new_zeros((len(parts), height, parts[0].shape[1]), dtype=torch.float32)
        for g, p in enumerate(parts):
            out[g, :p.shape[0]] = p
        return out.reshape(-1, parts[0].shape[1])
    out = parts[0].new_zeros((len(parts), parts[0].shape[0], width), dtype=torch.float32)
    for g, p in enumerate(parts):
        out[g, :, :p.shape[1]] = p
    return out.reshape(-1, width)


def _by_strides(spec: QuantSpec) -> bool:
    """Whether an operand's transpose is quantized where it lies (`quantize_segments(transposed=True)`):
    not with a Hadamard transform or stochastic rounding (their matrix products and draws follow the
    transpose's own layout)."""
    return not spec.hadamard and spec.rounding is Rounding.NEAREST_EVEN


def quantize_group_columns(parts: list[torch.Tensor], fmt: Format, role: str, quants: list[OperandQuantizer],
                           scales=None) -> list[torch.Tensor]:
    """The FP32 dequantized wgrad operands of a format group: `parts[g]`, expert g's (M, tokens)
    operand (its tokens already padded to the format's multiple), quantized along its own tokens
    for `role` as `quants[g].quantize(parts[g], fmt, role, record=False, scale=scales[g])` does,
    all in one call: zero-padded side by side to the longest (zeros change no amax, and no block
    of a part's own: every part is a whole number of blocks), each a segment of M rows."""
    spec: QuantSpec | None = getattr(fmt, role)
    if spec is None or _per_expert(spec, quants, role):
        return [dequantize_for_gemm(q.quantize(p, fmt, role, record=False, scale=None if scales is None else s)).float()
                for q, p, s in zip(quants, parts, scales or [None] * len(parts))]
    width = max(p.shape[1] for p in parts)
    whole, _ = _segments(parts, spec, quants, role, scales, False, width=width)
    deq = dequantize_for_gemm(whole).float().reshape(len(parts), -1, width)
    return [deq[g, :, :p.shape[1]] for g, p in enumerate(parts)]


def quantize_group_tokens(rows: list[torch.Tensor], padded: list[int], fmt: Format, role: str,
                          quants: list[OperandQuantizer], scales=None) -> list[torch.Tensor]:
    """`quantize_group_columns` of the transposes of `rows` (expert g's (tokens, M) rows, its
    tokens zero-padded to `padded[g]`), without transposing them where the format allows
    (`_by_strides`): the rows one under the other, each zero-padded to the longest (a copy of
    whole rows), each a segment quantized along its tokens by strides; the results are (M,
    padded[g]) views of one dequantized tensor, the same numbers."""
    spec: QuantSpec | None = getattr(fmt, role)
    if spec is None or not _by_strides(spec) or _per_expert(spec, quants, role):
        parts = [F.pad(r.t(), (0, n - r.shape[0])) if n > r.shape[0] else r.t() for r, n in zip(rows, padded)]
        return quantize_group_columns(parts, fmt, role, quants, scales)
    height = max(padded)
    t = _stacked(rows, None, height)
    whole, _ = _segments(list(torch.split(t, height)), spec, quants, role, scales, False, whole=t, transposed=True)
    deq = dequantize_for_gemm(whole).float().reshape(len(rows), height, -1)
    return [deq[g, :n].t() for g, n in enumerate(padded)]


def quantize_group(t: torch.Tensor, lengths: list[int], fmt: Format, role: str, quants: list[OperandQuantizer],
                   *, record: bool = True, scales=None, dequantized: bool = True) -> tuple[torch.Tensor | None, list]:
    """The FP32 GEMM operand of a format group's rows `t` (expert g: `lengths[g]` rows, quantized
    for `role` by `quants[g]`) and each expert's quantization (a `Quantized` view, or its rows
    in high precision). scales: the delayed scales of a first quantization (None: the histories').
    dequantized=False: no FP32 operand (the grouped FP8 kernel takes the quantizations), None
    in its place."""
    spec: QuantSpec | None = getattr(fmt, role)
    if spec is None:
        a = bf16_round(t).float() if quants[0].emulate_bf16 and t.dtype == torch.float32 else t.float()
        return a, list(torch.split(a, lengths))
    if _per_expert(spec, quants, role):
        starts = [sum(lengths[:i]) for i in range(len(lengths))]
        qs = [q.quantize(t[s:s + n], fmt, role, record=record, scale=None if scales is None else scales[g])
              for g, (q, s, n) in enumerate(zip(quants, starts, lengths))]
        return (torch.cat([dequantize_for_gemm(q).float() for q in qs]) if dequantized else None), qs
    whole, views = _segments(list(torch.split(t, lengths)), spec, quants, role, scales, record, whole=t)
    return (dequantize_for_gemm(whole).float() if dequantized else None), views


def quantize_group_weights(w: torch.Tensor, experts: list[int], fmt: Format, quants: list[OperandQuantizer], *,
                           transposed: bool = False, scales=None, dequantized: bool = True) -> tuple[list, torch.Tensor | None]:
    """Each expert's quantized weight `w[e]` (fprop; `transposed`: `w[e].t()` quantized again for
    dgrad, not recorded, with the forward's delayed `scales`) for a format group: from the
    experts' weight caches when every one of them holds that layout of its weight as it is, else
    all in one call (and into the caches); with them, the group's dequantized weights as its GEMM
    takes them when they were quantized in one call (fprop: (G, K, N), the transposes of (G, N,
    K) rows; dgrad: (G, N, K) row major), else None (always None with dequantized=False). The
    transposes are quantized where the
    weights lie, by strides (`_by_strides`: no copy of the transposed weights). Delayed scaling,
    stochastic rounding and Hadamard weights are never cached."""
    spec: QuantSpec | None = fmt.weight
    parts = [w[e].t() if transposed else w[e] for e in experts]
    scales = scales or [None] * len(experts)
    if spec is None or _per_expert(spec, quants, "weight"):
        return [q.quantize(p, fmt, "weight", record=not transposed, scale=s)
                for q, p, s in zip(quants, parts, scales)], None
    looked = [q.cached(p, spec, "weight", [], not transposed) for q, p in zip(quants, parts)]
    if all(hit is not None for _, _, hit in looked):
        return [hit for _, _, hit in looked], None
    rows = w if len(experts) == w.shape[0] else w[experts]   # (G, N, K)
    strides = not transposed or _by_strides(spec)
    if not strides:
        rows = rows.transpose(1, 2)
    flat = rows.reshape(-1, rows.shape[-1])
    whole, views = _segments(list(torch.split(flat, rows.shape[1])), spec, quants, "weight",
                             scales if transposed else None, not transposed, whole=flat, transposed=transposed and strides)
    for q, (slot, key, _), v in zip(quants, looked, views):
        if key is not None:
            q.weight_cache.put(slot, key, v, storage=getattr(q.backend, "fp8_storage", False))
    if not strides:
        return views, None
    if not dequantized:
        return views, None
    deq = dequantize_for_gemm(whole).float().reshape(rows.shape)
    return views, deq if transposed else deq.transpose(-2, -1)
