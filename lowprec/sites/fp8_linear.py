"""The `torch` backend's FP8 fast path: a linear layer's three GEMMs on fused FP8 casts.

`QuantizedLinearFn` (lowprec.sites.quantized_gemms) serves every format on every backend: it
quantizes through `lowprec.numerics.quantize` (FP32 grid values, then a cast to FP8 storage, the
statistics as extra passes). For the formats whose five operands are tensor-wise, delayed
or row-wise FP8 this module does the same arithmetic in as few passes as the hardware
allows:

    fprop  y  = x  @ w^T      _scaled_mm(q_x,  q_w^T)      A row-major, B column-major
    dgrad  dx = dy @ w        _scaled_mm(q_dy, q_wt^T)
    wgrad  dw = dy^T @ x      _scaled_mm(q_dyt, q_xt^T)

Each operand is cast once, by one custom op (`lowprec.numerics.fp8_ops`; called directly in
eager code, its Triton kernels inlined into a compiled graph), into both layouts it is
needed in (cast+transpose); in eager code the input and a weight that must be cast are cast
together, one launch per kernel (`cast_input_and_weight`), each with its own statistics on a
check step; the
forward saves only the FP8 transposed input and the weight's FP8 transpose for the backward
(no BF16 or FP32 copy); `_scaled_mm` writes BF16 directly (and adds a BF16 bias in its
epilogue). The weight's FP8 forms are cached across gradient-accumulation micro-batches
(`lowprec.sites.weight_cache`; delayed scaling excepted: its scale moves between uses).
Statistics are computed only when the layer's `collect_stats` is on (check steps), by the
same kernels.
Nothing here reads a device value on the host.

On CPU the same ops run the reference quantizer and `_scaled_mm` accumulates in FP32, so
the fast path's casts, scales and statistics equal the `emulated` backend's bit for bit there
and its GEMMs are within an FP32 re-association of them (tests/lowprec/sites/fast_path).

DTensor operands and amax reductions over a group run the same GEMMs through
`lowprec.sites.fp8_parallel`; every other format uses `QuantizedLinearFn`.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field, replace
from typing import NamedTuple

import torch
from torch import Tensor

from lowprec.numerics import fp8_ops
from lowprec.numerics.formats import Format, Rounding, ScaleEncoding, Scaling
from lowprec.numerics.quant_stats import QuantStats
from lowprec.sites.gemm_config import LinearGemmConfig, misaligned

__all__ = ["FastRecipe", "fast_recipe", "step_recipes", "cast_weight", "cast_input_and_weight", "FP8LinearFn",
           "grad_gemms", "GemmMeta", "WeightForms", "InputForms", "DelayedTensors", "delayed_state"]

_FAST_SCALINGS = (Scaling.TENSOR, Scaling.DELAYED, Scaling.ROW)


@dataclass(frozen=True)
class FastRecipe:
    """What the fast path needs of a format, as plain constants (a compile-time key)."""

    scaling: Scaling
    fwd: int                  # element code (fp8_ops.ELEMENTS) of input and weight
    bwd: int                  # element code of the output gradient
    stats: bool = False       # check step: write the statistics
    margin: int = 0           # delayed scaling
    most_recent: bool = False
    count_overflow: bool = False   # delayed, statistics off: count overflow steps
    gemm: LinearGemmConfig = LinearGemmConfig()   # the three GEMMs' settings (lowprec.sites.gemm_config)
    # from `scaling`, kept as plain attributes (read several times per call)
    rowwise: bool = field(init=False, repr=False, compare=False)
    delayed: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "rowwise", self.scaling is Scaling.ROW)
        object.__setattr__(self, "delayed", self.scaling is Scaling.DELAYED)


def fast_recipe(fmt: Format, gemm: LinearGemmConfig | None = None) -> FastRecipe | None:
    """The fast-path recipe of `fmt` with the GEMMs run as `gemm` says (torchao's defaults
    without one), or None when the fast path cannot run `fmt` exactly."""
    specs = fmt.specs()
    if len(specs) != 5:
        return None
    for spec in specs.values():
        if (spec.scaling not in _FAST_SCALINGS or spec.scaling is not fmt.input.scaling
                or spec.rounding is not Rounding.NEAREST_EVEN or spec.hadamard
                or spec.scale_encoding is not ScaleEncoding.FP32 or spec.element not in fp8_ops.ELEMENTS):
            return None
    fwd, bwd = fmt.input.element, fmt.grad_output.element
    if fmt.weight.element is not fwd or fmt.input_wgrad.element is not fwd or fmt.grad_output_wgrad.element is not bwd:
        return None
    d = fmt.delayed
    return FastRecipe(fmt.input.scaling, fp8_ops.element_code(fwd), fp8_ops.element_code(bwd),
                      margin=d.margin if d else 0, most_recent=bool(d and d.algo == "most_recent"),
                      gemm=gemm or LinearGemmConfig())


def step_recipes(recipe: FastRecipe) -> tuple[FastRecipe, FastRecipe]:
    """(a step without statistics, a check step): the two recipes a layer runs `recipe` with,
    made once per format (a switch) rather than once per call."""
    return (replace(recipe, stats=False, count_overflow=recipe.delayed),
            replace(recipe, stats=True, count_overflow=False))


class WeightForms(NamedTuple):
    """The weight's FP8 casts, both layouts (cached between optimizer steps)."""

    q: Tensor
    scale_inv: Tensor
    q_t: Tensor
    scale_inv_t: Tensor
    stats: QuantStats | None


def _cast(t: Tensor, elem: int, recipe: FastRecipe, hist, overflow: Tensor | None, index: int,
          transpose: bool, stats_out: Tensor | None = None):
    """(q, scale_inv, q_t, scale_inv_t, packed stats) of one operand by one custom op; the
    statistics written into `stats_out` when given."""
    if recipe.delayed:
        q, si, qt, st = fp8_ops.cast_delayed(
            t, elem, hist.history, hist.count, hist.scratch, hist.ticket, overflow, index,
            recipe.margin, recipe.most_recent, transpose, recipe.stats, recipe.count_overflow, stats_out)
        return q, si, qt, si, st
    q, si, qt, sit, st = fp8_ops.cast(t, elem, recipe.rowwise, transpose, recipe.stats, stats_out)
    return q, si, qt, (sit if recipe.rowwise else si), st


def _mm(a: Tensor, sa: Tensor, b: Tensor, sb: Tensor, out_dtype: torch.dtype, gemm: str, gemms: LinearGemmConfig,
        bias: Tensor | None = None) -> Tensor:
    """a @ b^T (+ bias) for FP8 a (M, K) and b (N, K), both row-major, with their scale_inv (a
    scalar, or row-wise (M, 1) and (N, 1) or (1, N)), in `out_dtype` straight from `_scaled_mm` (on CPU,
    too: it accumulates in FP32, adds the bias and rounds once, as the emulated backend).
    `gemm` (fprop, dgrad or wgrad) picks its `use_fast_accum` from `gemms`; on CUDA, a K or N
    that is not a multiple of 16 is zero-padded when `gemms.pad_inner_dim`, refused otherwise.
    A bias of the output's dtype (BF16) goes into the GEMM's epilogue (on CUDA an FP32 bias is
    cast to it first, as autocast does); on CPU another (an FP32 bias under a BF16 output) is
    added to the FP32 result before the one rounding, as the emulated backend does. Row-wise
    GEMMs on CUDA return BF16 (what cuBLAS supports there)."""
    if sb.dim() == 2 and sb.shape[0] != 1:   # a row-wise (N, 1) scale as B's (1, N); the pair's come so
        sb = sb.reshape(1, -1)
    m, n = a.shape[0], b.shape[0]
    cuda = a.is_cuda
    padded = cuda and misaligned(gemm, m, n, a.shape[1], rowwise=sa.dim() == 2)
    if padded and not gemms.pad_inner_dim:
        raise ValueError(padded)
    if padded:   # zeros change no product (sliced off below)
        from lowprec.numerics.padding import pad16
        a, b, sa, sb = pad16(a, b, sa, sb)
    dt = torch.bfloat16 if cuda and sa.dim() == 2 else out_dtype
    if cuda and bias is not None and dt != torch.float32 and not padded:
        bias = bias.to(dt)   # as F.linear under autocast: the bias in the output's dtype, fused
    fused = bias is not None and not padded and dt != torch.float32 and bias.dtype == dt
    if bias is not None and not fused:
        dt = torch.float32
    out = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=sb, bias=bias if fused else None, out_dtype=dt,
                           use_fast_accum=getattr(gemms, gemm).use_fast_accum)
    out = out[:m, :n] if padded else out
    if bias is not None and not fused:
        out = out + bias.float()
    return out if out.dtype == out_dtype else out.to(out_dtype)


class InputForms(NamedTuple):
    """The input's FP8 casts when the layer made them before `FP8LinearFn` (with the weight's,
    in one launch: `cast_input_and_weight`); q_t is empty where no weight gradient is asked for;
    scale_inv_t is q_t's (scale_inv itself unless row-wise); stats: the packed statistics on a
    check step, else None."""

    q: Tensor
    scale_inv: Tensor
    q_t: Tensor
    scale_inv_t: Tensor
    stats: Tensor | None


class FP8LinearFn(torch.autograd.Function):
    """y = x @ w^T + b with the weight's FP8 forms given (see the module docstring).

    Inputs besides x, w and bias are device tensors the layer owns: the weight's casts, the
    buffer the output gradient's statistics go to (or None), the recipe, the input's casts
    when the layer made them (`InputForms`, else None: the function casts x; its statistics
    are then the layer's to read, and the function returns None for them), then, for
    delayed scaling only, `state`: the overflow counters and the delayed histories of x and
    of the output gradient (history, count, scratch, ticket each; `delayed_state`). Without
    delayed scaling the function takes ten inputs, not nineteen: autograd's host time grows
    with each one. Returns (y, the input's packed statistics: a tensor on a check step, else
    None or an empty tensor)."""

    @staticmethod
    def forward(ctx, x, w, bias, qw, siw, qwt, siwt, grad_stats, recipe: FastRecipe, x_forms: InputForms | None,
                *state):
        siwt = siw if siwt is None else siwt   # one scale for both layouts unless row-wise
        need_dw = ctx.needs_input_grad[1]
        overflow, hist_x, hist_g = ((state[0], DelayedTensors(*state[1:5]), state[5:]) if state
                                    else (None, NO_HISTORY, ()))
        if x_forms is None:
            qx, six, qxt, sixt, stats_x = _cast(_rows(x), recipe.fwd, recipe, hist_x, overflow, 0, need_dw)
        else:
            qx, six, qxt, sixt, _ = x_forms
            stats_x = None
            if need_dw and qxt.numel() != x.numel():
                raise ValueError("FP8LinearFn: the weight needs a gradient but the input's casts have no "
                                 "transposed form; cast x with its transpose (cast_input_and_weight(need_xt=True))")
        y = _mm(qx, six, qw, siw, _output_dtype(x), "fprop", recipe.gemm, bias)
        ctx.save_for_backward(qxt, sixt, qwt, siwt, grad_stats, *hist_g, *state[:1])
        ctx.meta = GemmMeta(recipe, x.shape, x.dtype, w.dtype, bias is not None, 10 + len(state))
        if stats_x is not None:
            ctx.mark_non_differentiable(stats_x)
        ctx.set_materialize_grads(False)   # no zeros for the statistics' (absent) gradient
        return (y if x.dim() == 2 else y.reshape(*x.shape[:-1], y.shape[-1])), stats_x

    @staticmethod
    def backward(ctx, gy, _gstats):
        qxt, sixt, qwt, siwt, grad_stats, *state = ctx.saved_tensors
        meta = ctx.meta
        recipe = meta.recipe
        g2 = _rows(gy)
        hist_g, overflow = (DelayedTensors(*state[:4]), state[4]) if state else (NO_HISTORY, None)
        qg, sig, qgt, sigt, _ = _cast(g2, recipe.bwd, recipe, hist_g, overflow, 2, ctx.needs_input_grad[1],
                                      grad_stats if recipe.stats else None)
        return grad_gemms(ctx.needs_input_grad, meta, g2, (qg, sig, qgt, sigt), (qwt, siwt),
                          (qxt, sixt)) + (None,) * (meta.n_inputs - 3)


class GemmMeta(NamedTuple):
    """What an FP8 linear function's backward needs besides its saved tensors: the recipe, the
    input's shape and dtype, the weight's dtype, whether there is a bias, and how many inputs
    the function took (its backward returns one gradient or None per input). One attribute of
    the autograd context: each attribute set on it costs host time."""
    recipe: FastRecipe
    x_shape: torch.Size
    x_dtype: torch.dtype
    w_dtype: torch.dtype
    has_bias: bool
    n_inputs: int


def grad_gemms(needs_input_grad: tuple, meta: GemmMeta, g2: Tensor, grad, w_t, x_t) -> tuple:
    """(dx, dw, db) of an FP8 linear layer's backward, each only where autograd asks for it
    (`needs_input_grad`, the context's): dgrad and wgrad from the cast output gradient `grad` =
    (q, scale_inv, q_t, scale_inv_t) and the forward's saved casts `w_t` = (qwt, siwt), `x_t` =
    (qxt, sixt); the bias gradient from the high-precision gradient `g2`."""
    qg, sig, qgt, sigt = grad
    need_dx, need_dw, need_db = needs_input_grad[:3]
    gemms = meta.recipe.gemm
    dx = dw = db = None
    if need_dx:
        dx = _mm(qg, sig, *w_t, meta.x_dtype, "dgrad", gemms)
        dx = dx if len(meta.x_shape) == 2 else dx.reshape(meta.x_shape)
    if need_dw:
        dw = _mm(qgt, sigt, *x_t, meta.w_dtype, "wgrad", gemms)
    if meta.has_bias and need_db:
        db = g2.sum(0, dtype=torch.float32)   # one read of the BF16 gradient, FP32 sums
    return dx, dw, db


def delayed_state(overflow: Tensor, x: "DelayedTensors", g: "DelayedTensors") -> tuple[Tensor, ...]:
    """`FP8LinearFn`'s trailing inputs under delayed scaling: the overflow counters, then the
    input's and the output gradient's (history, count, scratch, ticket)."""
    return (overflow, *x, *g)


class DelayedTensors(NamedTuple):
    """One operand's delayed-scaling state as the custom op mutates it (all None otherwise)."""
    history: Tensor | None
    count: Tensor | None
    scratch: Tensor | None
    ticket: Tensor | None


def _rows(t: Tensor) -> Tensor:
    """`t` as (rows, last dimension): itself when 2-D (a reshape is a view's host time)."""
    return t if t.dim() == 2 else t.reshape(-1, t.shape[-1])


def _output_dtype(x: Tensor) -> torch.dtype:
    if x.is_cuda and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return x.dtype


NO_HISTORY = DelayedTensors(None, None, None, None)


def cast_input_and_weight(x: Tensor, w: Tensor, recipe: FastRecipe, hist_x: DelayedTensors, hist_w: DelayedTensors,
                          overflow: Tensor | None, need_xt: bool) -> tuple[InputForms, WeightForms] | None:
    """The input's (x as (M, K), transposed too when `need_xt`) and the weight's FP8 casts in one
    launch per kernel (`lowprec.numerics.kernels.cast_pair`: a fwd+bwd's launches 7 instead of
    9 tensor-wise, 5 instead of 6 delayed, 9 instead of 12 row-wise), each operand's statistics
    its own on a check step, or None where the pair does not run and each operand is cast on
    its own: a traced or dispatch-mode call, the reference quantizer (no kernels), operands
    the paired kernels do not take."""
    if not (fp8_ops._direct(x) and fp8_ops.uses_kernels(x)):
        return None
    x2 = _rows(x)   # w as it is: the kernels read its memory, no autograd sees the launch (no detach)
    pairs = _cast_pair()
    if not pairs.pairable(x2, w):
        return None
    ct = fp8_ops._cast_transpose()
    delayed = ((tuple(hist_x), tuple(hist_w), recipe.margin, recipe.most_recent,
                overflow if recipe.count_overflow else None) if recipe.delayed else None)
    cx, cw = pairs.pair(x2, w, fp8_ops.ELEMENTS[recipe.fwd], need_xt, ct.eager_launch, delayed, recipe.stats,
                        recipe.rowwise)
    return InputForms(*cx), WeightForms(cw.q, cw.scale_inv, cw.q_t, cw.scale_inv_t,
                                        None if cw.stats is None else QuantStats(cw.stats))


@functools.lru_cache(maxsize=None)
def _cast_pair():
    """The paired kernels' module, imported at the first pair (it needs Triton; an import
    statement per call costs host time)."""
    from lowprec.numerics.kernels import cast_pair
    return cast_pair


def cast_weight(w: Tensor, recipe: FastRecipe, hist: DelayedTensors, overflow: Tensor | None) -> WeightForms:
    """The weight's FP8 casts in both layouts (what the forward and the dgrad GEMM read)."""
    q, si, qt, sit, st = _cast(w.detach(), recipe.fwd, recipe, hist, overflow, 1, True)
    return WeightForms(q, si, qt, sit, QuantStats(st) if recipe.stats else None)
