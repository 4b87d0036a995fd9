"""The autograd function behind grouped experts: one projection of every expert, each expert in
its own format, with one grouped GEMM per format group (not a Python loop of GEMMs).

    fprop  y_e  = x_e  @ w_e^T     operands (input, weight)           rows of expert e only
    dgrad  dx_e = dy_e @ w_e       operands (grad_output, weight^T)
    wgrad  dw_e = dy_e^T @ x_e     operands (grad_output_wgrad, input_wgrad), K = the expert's tokens

`x` holds the routed tokens grouped by expert (`counts[e]` rows for expert e, in expert order,
as torchtitan's `GroupedExperts` receives them); `w` is the 3-D weight (E, N, K) of one
projection (`gate_up_proj`, `down_proj`, `w1`...). Each expert's operands are quantized exactly as
`QuantizedLinearFn` (lowprec.sites.quantized_gemms) quantizes a linear site's: the expert's own
`OperandQuantizer`, every operand along its GEMM's reduction dimension, the same reuse of
transposable quantizations, the same zero padding of the wgrad token dimension. Then the
dequantized operands of the experts that share a format go through one `torch._grouped_mm`
(offsets over the rows; for wgrad over the tokens), which on the emulated backend is the FP32
GEMM of `backends/emulated.py`: so the grouped path equals a loop of lowprec's linear sites over
the experts bit for bit (tests/lowprec/sites/test_grouped_gemms.py holds this for every kind of
format, forward and all gradients, uneven token counts and experts without tokens). Experts
without tokens are skipped: their weight gradient is zero and they record no statistics.

A format group quantizes each operand of each GEMM in one call for all its experts, whatever
the format (lowprec.sites.grouped_operands: each expert a segment of rows with its own amax,
scale, noise, history and statistics; the weights from the experts' caches when none has
changed; the wgrad operands side by side along the tokens, `_wgrad_group`). A high-precision group runs as a linear site
in high precision does (`F.linear` of BF16-rounded operands, whose gradients autograd rounds).
"""

from __future__ import annotations

import torch

from lowprec.numerics.formats import Format
from lowprec.sites.backends.emulated import dequantize_for_gemm
from lowprec.sites.grouped_operands import quantize_group, quantize_group_tokens, quantize_group_weights
from lowprec.sites.grouped_scaled_mm import group_ends, on_kernel, scaled_grouped_rows, scaled_grouped_tokens
from lowprec.sites.operand_quantizer import OperandQuantizer, bf16_round
from lowprec.sites.quantized_gemms import (_delayed_scale, _pad_tokens, _token_multiple, _transposable,
                                           _transpose)

__all__ = ["GroupedQuantizedFn", "grouped_mm", "format_groups"]


def format_groups(formats: tuple[Format, ...], counts: tuple[int, ...]) -> dict[Format, list[int]]:
    """Format -> the experts (with tokens) that run in it, in expert order: one GEMM call each."""
    groups: dict[Format, list[int]] = {}
    for e, (f, c) in enumerate(zip(formats, counts)):
        if c > 0:
            groups.setdefault(f, []).append(e)
    return groups


def _rows(parts: list[torch.Tensor]) -> torch.Tensor:
    """The 2-D operands of a group stacked along the rows, in the memory layout of each part (row
    or column major): the CPU GEMM picks its kernel by layout, and the per-expert GEMM's layout is
    what the grouped one must equal."""
    if parts[0].is_contiguous() or parts[0].shape[1] == 1:
        return torch.cat(parts)
    return torch.cat([p.t() for p in parts], dim=1).t()


def _cols(parts: list[torch.Tensor]) -> torch.Tensor:
    """As `_rows`, stacked along the columns (the wgrad's token dimension)."""
    return _rows([p.t() for p in parts]).t()


def _stack(parts: list[torch.Tensor]) -> torch.Tensor:
    """The (G, K, N) right operands `b` of `a @ b` per group, each in its own memory layout."""
    if parts[0].is_contiguous():
        return torch.stack(parts)
    return torch.stack([p.t() for p in parts]).transpose(-2, -1)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, offs: list[int]) -> torch.Tensor:
    """Grouped FP32 GEMM. a (R, K) with b (G, K, N): rows a[offs[g-1]:offs[g]] @ b[g], (R, N).
    a (M, T) with b (T, N): a[:, span g] @ b[span g] per group along T, (G, M, N).
    One `torch._grouped_mm` call (on CPU it equals `torch.mm` of the same layouts per group bit
    for bit); where an operand breaks its rule of 16-byte strides (a dimension that is no
    multiple of 4), one `torch.mm` per group, the same numbers."""
    off = torch.tensor(offs, dtype=torch.int32, device=a.device)
    starts = [0, *offs[:-1]]
    try:
        return torch._grouped_mm(a, b, offs=off)
    except RuntimeError:
        if b.dim() == 3:
            return torch.cat([a[s:o] @ b[g] for g, (s, o) in enumerate(zip(starts, offs))])
        return torch.stack([a[:, s:o] @ b[s:o] for s, o in zip(starts, offs)])


def _group_rows(t: torch.Tensor, experts: list[int], starts: list[int], counts: tuple[int, ...]) -> torch.Tensor:
    """The rows of `experts` (in order) of a tensor grouped by expert; `t` itself when they are all of it."""
    if sum(counts[e] for e in experts) == t.shape[0]:
        return t
    return torch.cat([t[starts[e]:starts[e] + counts[e]] for e in experts])


def _starts(counts: tuple[int, ...]) -> list[int]:
    out, s = [], 0
    for c in counts:
        out.append(s)
        s += c
    return out


class GroupedQuantizedFn(torch.autograd.Function):
    """fprop / dgrad / wgrad of one projection of every expert (see the module docstring).

    Inputs: x (R, K) grouped by expert, w (E, N, K), `counts` (tokens per expert, host ints),
    `formats` (one `Format` per expert), `quants` (one `OperandQuantizer` per expert: its
    holders receive the expert's statistics and delayed-scaling amaxes); `one_call` (default
    True): each format group's operands are quantized in one call (False: expert by expert, the same
    numbers; experiments/bench_moe.py times both); `kernel`: `torch._scaled_grouped_mm` (or an
    operator with its contract) for the GEMMs `on_kernel` admits, None for the FP32
    grouped GEMM of the dequantized operands (lowprec.sites.grouped_scaled_mm); `fast_accum`: its
    (fprop, dgrad, wgrad) `use_fast_accum`. Returns y (R, N)."""

    @staticmethod
    def forward(ctx, x, w, counts: tuple[int, ...], formats: tuple[Format, ...],
                quants: tuple[OperandQuantizer, ...], one_call: bool = True, kernel=None,
                fast_accum: tuple[bool, bool, bool] = (True, False, False)):
        starts = _starts(counts)
        keep_x, keep_w, scales = {}, {}, {}
        groups = format_groups(formats, counts)
        y = torch.empty(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
        for fmt, experts in groups.items():
            lengths, qs = [counts[e] for e in experts], [quants[e] for e in experts]
            fast = on_kernel(kernel, fmt, "fprop", w.shape)
            if fast:   # the FP8 bytes to the grouped kernel
                _, qxs = quantize_group(_group_rows(x, experts, starts, counts), lengths, fmt, "input", qs,
                                        dequantized=False)
                qws, _ = quantize_group_weights(w, experts, fmt, qs, dequantized=False)
            elif one_call:   # each operand of the whole group in one quantization
                a, qxs = quantize_group(_group_rows(x, experts, starts, counts), lengths, fmt, "input", qs)
                qws, b = quantize_group_weights(w, experts, fmt, qs)
            else:
                qxs = [quants[e].quantize(x[starts[e]:starts[e] + counts[e]], fmt, "input") for e in experts]
                qws, b = [quants[e].quantize(w[e], fmt, "weight") for e in experts], None
                a = _rows([dequantize_for_gemm(q).float() for q in qxs])
            for e, qx, qw in zip(experts, qxs, qws):
                keep_x[e] = (qx if _transposable(fmt.input, fmt.input_wgrad, qx)
                             and counts[e] % _token_multiple(fmt) == 0 else None)
                keep_w[e] = qw if _transposable(fmt.weight, fmt.weight, qw) else None
                scales[e] = (_delayed_scale(qx), _delayed_scale(qw))
            if fast:
                out = scaled_grouped_rows(kernel, qxs, qws, lengths, fast_accum[0]).float()
                _scatter_rows(y, out, experts, starts, counts)
                continue
            if b is None:   # from the caches, or expert by expert
                b = _stack([dequantize_for_gemm(q).float().t() for q in qws])
            _scatter_rows(y, grouped_mm(a, b, group_ends(lengths)), experts, starts, counts)
        ctx.save_for_backward(x, w)
        ctx.keep = (keep_x, keep_w, scales, groups, starts)
        ctx.counts, ctx.formats, ctx.quants, ctx.one_call = counts, formats, quants, one_call
        ctx.kernel, ctx.fast_accum = kernel, fast_accum
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, gy):
        x, w = ctx.saved_tensors
        keep_x, keep_w, scales, groups, starts = ctx.keep
        counts, quants = ctx.counts, ctx.quants
        gy = gy.contiguous()
        dx = dw = None
        qg = {}
        if ctx.needs_input_grad[0]:
            dx = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
            for fmt, experts in groups.items():
                if fmt.is_high_precision:
                    hp = _hp_rounding(quants[experts[0]], x)
                    b = hp(w if len(experts) == w.shape[0] else w[experts]).float()
                    out = grouped_mm(_group_rows(gy, experts, starts, counts).float(), b,
                                     group_ends([counts[e] for e in experts]))
                    _scatter_rows(dx, hp(out), experts, starts, counts)
                    continue
                lengths = [counts[e] for e in experts]
                fast = on_kernel(ctx.kernel, fmt, "dgrad", w.shape)
                if ctx.one_call or fast:   # the output gradient of the whole group in one quantization
                    a, qgs = quantize_group(_group_rows(gy, experts, starts, counts), lengths, fmt, "grad_output",
                                            [quants[e] for e in experts], dequantized=not fast)
                    qg.update(zip(experts, qgs))
                else:
                    for e in experts:
                        qg[e] = quants[e].quantize(gy[starts[e]:starts[e] + counts[e]], fmt, "grad_output")
                    a = _rows([dequantize_for_gemm(qg[e]).float() for e in experts])
                b = None
                if all(keep_w[e] is not None for e in experts):   # the forward's, transposed
                    qwts = [_transpose(keep_w[e]) for e in experts]
                elif ctx.one_call or fast:
                    qwts, b = quantize_group_weights(w, experts, fmt, [quants[e] for e in experts], transposed=True,
                                                     scales=[scales[e][1] for e in experts], dequantized=not fast)
                else:
                    qwts = [quants[e].quantize(w[e].t(), fmt, "weight", record=False, scale=scales[e][1])
                            for e in experts]
                if fast:
                    out = scaled_grouped_rows(ctx.kernel, [qg[e] for e in experts], qwts, lengths, ctx.fast_accum[1])
                    _scatter_rows(dx, out.float(), experts, starts, counts)
                    continue
                if b is None:   # (G, N, K) row major, as a loop's transposed weights are (and one call's)
                    b = _stack([dequantize_for_gemm(q).float().t() for q in qwts]).contiguous()
                _scatter_rows(dx, grouped_mm(a, b, group_ends([counts[e] for e in experts])), experts, starts, counts)
            dx = dx.to(x.dtype)
        if ctx.needs_input_grad[1]:
            dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
            for fmt, experts in groups.items():
                if fmt.is_high_precision:
                    hp = _hp_rounding(quants[experts[0]], x)
                    gts = [gy[starts[e]:starts[e] + counts[e]].float().t() for e in experts]
                    xts = [hp(x[starts[e]:starts[e] + counts[e]]).float() for e in experts]
                    dw[experts] = hp(grouped_mm(_cols(gts), _rows(xts), group_ends([counts[e] for e in experts])))
                    continue
                if on_kernel(ctx.kernel, fmt, "wgrad", w.shape):
                    pairs = [_wgrad_operands(e, fmt, quants[e], gy, x, qg.get(e), keep_x[e], scales[e][0], starts[e],
                                             counts[e]) for e in experts]
                    dw[experts] = scaled_grouped_tokens(ctx.kernel, [p[0] for p in pairs], [p[1] for p in pairs],
                                                        ctx.fast_accum[2]).float()
                    continue
                if ctx.one_call and (ops := _wgrad_group(fmt, experts, quants, gy, x, qg, keep_x, scales, starts,
                                                         counts)) is not None:
                    dw[experts] = grouped_mm(*ops)
                    continue
                gts, xts = [], []
                for e in experts:
                    gts_e, xts_e = _wgrad_operands(e, fmt, quants[e], gy, x, qg.get(e), keep_x[e], scales[e][0],
                                                   starts[e], counts[e])
                    gts.append(dequantize_for_gemm(gts_e).float())
                    xts.append(dequantize_for_gemm(xts_e).float().t())
                out = grouped_mm(_cols(gts), _rows(xts), group_ends([t.shape[1] for t in gts]))
                dw[experts] = out
            dw = dw.to(w.dtype)
        return dx, dw, None, None, None, None, None, None


def _hp_rounding(quant: OperandQuantizer, x: torch.Tensor):
    """What a linear site in high precision rounds, BF16 emulated in FP32: it runs
    `F.linear(bf16_round(x), bf16_round(w))`, whose autograd rounds the input and weight
    gradients (the backward of the casts) and not the output gradient that enters them."""
    return bf16_round if quant.emulate_bf16 and x.dtype == torch.float32 else (lambda t: t)


def _wgrad_operands(e, fmt, quant, gy, x, qg, keep_x, scale_x, start, count):
    """(grad_output^T, input^T) of expert e's wgrad, quantized as `QuantizedLinearFn` does."""
    g2 = gy[start:start + count]
    reuse_g = count % _token_multiple(fmt) == 0 and _transposable(fmt.grad_output, fmt.grad_output_wgrad, qg)
    again = dict(record=qg is None, scale=_delayed_scale(qg))
    if keep_x is not None:
        qgt = _transpose(qg) if reuse_g else quant.quantize(g2.t(), fmt, "grad_output_wgrad", **again)
        return qgt, _transpose(keep_x)
    gt, xt = _pad_tokens(g2.t(), x[start:start + count].t(), fmt)
    qgt = _transpose(qg) if reuse_g else quant.quantize(gt, fmt, "grad_output_wgrad", **again)
    return qgt, quant.quantize(xt, fmt, "input_wgrad", record=False, scale=scale_x)


def _wgrad_group(fmt, experts, quants, gy, x, qg, keep_x, scales, starts, counts):
    """A format group's wgrad operands (grad_output^T, input^T, offsets) with each quantized in one
    call for all its experts (`quantize_group_tokens`), where none of them reuses a transposed
    quantization of the forward or dgrad; None otherwise (the loop of `_wgrad_operands`). The
    same numbers and, for the GEMM, the same memory layout as the loop's (which follows its
    first expert's: row major where its tokens were padded)."""
    mult = _token_multiple(fmt)
    if any(keep_x[e] is not None or qg.get(e) is None or (counts[e] % mult == 0 and _transposable(
            fmt.grad_output, fmt.grad_output_wgrad, qg[e])) for e in experts):
        return None
    qs = [quants[e] for e in experts]
    padded = [counts[e] + (-counts[e]) % mult for e in experts]
    gts = quantize_group_tokens([gy[starts[e]:starts[e] + counts[e]] for e in experts], padded, fmt,
                                "grad_output_wgrad", qs, [_delayed_scale(qg[e]) for e in experts])
    xts = [t.t() for t in quantize_group_tokens([x[starts[e]:starts[e] + counts[e]] for e in experts], padded, fmt,
                                                "input_wgrad", qs, [scales[e][0] for e in experts])]
    padded = counts[experts[0]] % mult != 0
    gts[0] = gts[0].contiguous() if padded else gts[0].t().contiguous().t()
    xts[0] = xts[0].t().contiguous().t() if padded else xts[0].contiguous()
    return _cols(gts), _rows(xts), group_ends([t.shape[1] for t in gts])


def _scatter_rows(dst: torch.Tensor, src: torch.Tensor, experts: list[int], starts: list[int],
                  counts: tuple[int, ...]) -> None:
    """Rows of a format group's GEMM back to their experts' places in the grouped layout."""
    if len(experts) == len([c for c in counts if c > 0]):   # one group: the rows are already in place
        dst.copy_(src)
        return
    idx = torch.cat([torch.arange(starts[e], starts[e] + counts[e], device=dst.device) for e in experts])
    dst.index_copy_(0, idx, src)
