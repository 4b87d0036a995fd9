"""A layer's input and weight cast together: one launch where two are.

The forward of an FP8 linear layer casts its input x (M, K) and, on the first micro-batch
after an optimizer step (every step under delayed scaling), its weight w (N, K), each in
both layouts, with the same element format. `pair` launches each of the kernels those two
casts need once for both operands (`cast_pair_kernels`), over the two operands' programs side
by side: tensor-wise the amax pass and the cast+transpose, delayed the one delayed kernel,
row-wise the row/column maxima pass and the row-wise cast (and one zeroed maxima buffer for
both). A layer's fwd+bwd launches go from 9 to 7 tensor-wise, 6 to 5 delayed, 12 to 9
row-wise, and on check steps 10 to 8 tensor-wise, 13 to 10 row-wise. Each program does what
the separate cast's program would (`cast_transpose.tensorwise` / `delayed` / `rowwise`), so
the bytes, the scales and the delayed histories are the separate casts'
(tests/lowprec/sites/fast_path/test_fp8_ops.py).

On a check step (`stats`) each operand's statistics are its own, from its own partials rows,
ticket and finishing tile, summed in its separate cast's order: the same packed vector, bit
for bit.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from lowprec.numerics.kernels.cast_pair_kernels import (
    _amax_pair_kernel, _ct_pair_kernel, _ct_row_pair_kernel, _amax_rows_cols_pair_kernel,
)
from lowprec.numerics.kernels.cast_transpose import _BLOCK_T, _N_STATS, _TILE, eager_launch
from lowprec.numerics.kernels.fp8_cast import _consts, _flat_grid, cdiv, next_power_of_2
from lowprec.numerics.fp8_ops import _plain   # fp8_ops imports the kernels lazily: no cycle at load

__all__ = ["pair", "pairable", "Cast"]

_BLOCK = 2048   # elements per amax-pass block, as the separate cast's


class Cast(NamedTuple):
    """One operand's casts: q (M, K), its scale_inv, q^T (K, M) or an empty tensor, q^T's
    scale_inv, the packed statistics ((8,) FP64) or None. Tensor-wise and delayed, both scales
    are one scalar. Row-wise, each is one value per row of its layout, in the shape the layer's
    GEMM takes it (`_pair_rowwise`): a's scale_inv (M, 1), a^T's (1, K) (or empty), b's (1, N)
    and b^T's (1, K); the values are a separate cast's (M, 1) / (K, 1) ones."""
    q: torch.Tensor
    scale_inv: torch.Tensor
    q_t: torch.Tensor
    scale_inv_t: torch.Tensor
    stats: torch.Tensor | None


class _PairPlan(NamedTuple):
    """Launch plan of a pair: both launches' grids and keyword arguments, each operand's
    amax-pass programs (tensor-wise) and tiles, the FP8 dtype, the compiled kernels of warm
    launches."""
    amax_grid: tuple[int]
    grid: tuple[int]
    pa: int
    pb: int
    tiles: int
    amax_kw: dict
    kw: dict
    fp8: torch.dtype
    warm: dict


def pairable(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `pair` takes a and b: each what the kernels' unchecked entry points take
    (`fp8_ops._plain`: 2-D, contiguous, of a dtype they read), non-empty, with the same inner
    dimension, on one device."""
    return (_plain(a) and _plain(b) and a.shape[1] == b.shape[1] and a.numel() > 0 and b.numel() > 0
            and a.device == b.device)


def _element_kw(elem) -> dict:
    """The element format's constexprs as the paired kernels take them: no BF16 (each operand
    has its own, BF16_A / BF16_B), the mantissa bits M as MB."""
    c = dict(_consts(elem, False))   # a copy: the format's dict is cached
    del c["BF16"]
    c["MB"] = c.pop("M")
    return c


def _tiles(ma: int, mb: int, k: int) -> int:
    return cdiv(ma, _TILE[0]) * cdiv(k, _TILE[1]) + cdiv(mb, _TILE[0]) * cdiv(k, _TILE[1])


@functools.lru_cache(maxsize=512)
def _pair_plan(ma: int, mb: int, k: int, elem, dtype_a: torch.dtype, dtype_b: torch.dtype, transpose_a: bool,
               stats: bool, delayed: bool, hist_len: int, most_recent: bool, margin: int,
               overflow: bool) -> _PairPlan:
    tiles = _tiles(ma, mb, k)
    pa, pb = _flat_grid(ma * k, _BLOCK), _flat_grid(mb * k, _BLOCK)
    kw = dict(BM=_TILE[0], BN=_TILE[1], BLOCK_P=1 if delayed else next_power_of_2(max(pa, pb)),
              BLOCK_L=next_power_of_2(hist_len) if delayed else 1, DELAYED=delayed,
              MOST_RECENT=most_recent, MARGIN_DIV=float(2.0 ** margin), OVERFLOW=overflow, TRANSPOSE_A=transpose_a,
              STATS=stats, BF16_A=dtype_a == torch.bfloat16, BF16_B=dtype_b == torch.bfloat16, BLOCK_T=_BLOCK_T,
              num_warps=4, **_element_kw(elem))
    amax_kw = dict(BLOCK=_BLOCK, BF16_A=kw["BF16_A"], BF16_B=kw["BF16_B"], TICKET=stats, num_warps=8)
    return _PairPlan((pa + pb,), (tiles,), pa, pb, tiles, amax_kw, kw, elem.torch_dtype, {})


@functools.lru_cache(maxsize=512)
def _row_pair_plan(ma: int, mb: int, k: int, elem, dtype_a: torch.dtype, dtype_b: torch.dtype, transpose_a: bool,
                   stats: bool) -> _PairPlan:
    tiles = _tiles(ma, mb, k)
    bf16 = dict(BF16_A=dtype_a == torch.bfloat16, BF16_B=dtype_b == torch.bfloat16)
    kw = dict(BM=_TILE[0], BN=_TILE[1], TRANSPOSE_A=transpose_a, STATS=stats, BLOCK_T=_BLOCK_T, num_warps=4,
              **bf16, **_element_kw(elem))
    amax_kw = dict(BM=_TILE[0], BN=_TILE[1], num_warps=4, **bf16)
    return _PairPlan((tiles,), (tiles,), 0, 0, tiles, amax_kw, kw, elem.torch_dtype, {})


def _outputs(ma: int, mb: int, k: int, dev, plan: _PairPlan, transpose_a: bool, stats: bool):
    """Both operands' FP8 outputs (q_a, q_a^T or empty, q_b, q_b^T), and with `stats` the
    launch's (tiles, 8) statistics partials and each operand's packed statistics (the rows of
    one (2, 8) tensor: a layer keeps them, not the partials), else three None."""
    qa = torch.empty(size=(ma, k), dtype=plan.fp8, device=dev)
    qta = torch.empty(size=(k, ma) if transpose_a else (0, 0), dtype=plan.fp8, device=dev)
    qb = torch.empty(size=(mb, k), dtype=plan.fp8, device=dev)
    qtb = torch.empty(size=(k, mb), dtype=plan.fp8, device=dev)
    if not stats:
        return qa, qta, qb, qtb, None, None, None
    part = torch.empty(size=(plan.tiles, _N_STATS), dtype=torch.float64, device=dev)
    st = torch.empty(size=(2, _N_STATS), dtype=torch.float64, device=dev)
    return qa, qta, qb, qtb, part, st[0], st[1]


def pair(a: torch.Tensor, b: torch.Tensor, elem, transpose_a: bool, launch=eager_launch, delayed=None,
         stats: bool = False, rowwise: bool = False) -> tuple[Cast, Cast]:
    """The casts of a (M, K) and b (N, K) in one launch per kernel (module docstring), checked
    by `pairable`: `(Cast of a, Cast of b)`, a's transpose empty unless `transpose_a`.
    Tensor-wise current scaling; `rowwise`: row-wise scaling; with `delayed` = (state_a,
    state_b, margin, most_recent, overflow) delayed scaling: each state (history, count,
    scratch, ticket) as `cast_transpose.delayed` takes it; `overflow` (or None) counts overflow
    steps at index 0 for a, 1 for b. `stats`: each operand's packed statistics too."""
    if rowwise:
        return _pair_rowwise(a, b, elem, transpose_a, launch, stats)
    (ma, k), mb = a.shape, b.shape[0]
    dev = a.device
    sa, sb, margin, most_recent, overflow = delayed if delayed is not None else (None, None, 0, False, None)
    plan = _pair_plan(ma, mb, k, elem, a.dtype, b.dtype, transpose_a, stats, delayed is not None,
                      sa[0].numel() if sa else 1, most_recent, margin, overflow is not None)
    qa, qta, qb, qtb, part, sta, stb = _outputs(ma, mb, k, dev, plan, transpose_a, stats)
    sia = torch.empty(size=(), dtype=torch.float32, device=dev)
    sib = torch.empty(size=(), dtype=torch.float32, device=dev)
    if delayed is None:   # the partial maxima, then (statistics) a's and b's tickets
        partial = torch.empty(plan.pa + plan.pb + (2 if stats else 0), dtype=torch.float32, device=dev)
        launch(_amax_pair_kernel, plan.amax_grid, plan.warm, (a, b), plan.amax_kw)(a, b, partial, ma * k, mb * k,
                                                                                  plan.pa)
        state = (partial,) * 8
        vary = (a, b)
    else:
        partial = sa[0]
        state = (*sa, *sb)
        vary = (a, b, *state, overflow)
    launch(_ct_pair_kernel, plan.grid, plan.warm, vary, plan.kw)(
        a, qa, qta if transpose_a else qa, sia, b, qb, qtb, sib, partial, plan.pa, plan.pb, *state,
        sa[0].numel() if sa else 1, partial if overflow is None else overflow, partial if part is None else part,
        partial if sta is None else sta, partial if stb is None else stb, ma, k, mb, k)
    return Cast(qa, sia, qta, sia, sta), Cast(qb, sib, qtb, sib, stb)


def _pair_rowwise(a: torch.Tensor, b: torch.Tensor, elem, transpose_a: bool, launch, stats: bool) -> tuple[Cast, Cast]:
    """`pair` under row-wise scaling: each operand's row maxima, column maxima and statistics
    ticket in one zeroed buffer (a's, then b's), then the row-wise casts of both layouts."""
    (ma, k), mb = a.shape, b.shape[0]
    dev = a.device
    plan = _row_pair_plan(ma, mb, k, elem, a.dtype, b.dtype, transpose_a, stats)
    qa, qta, qb, qtb, part, sta, stb = _outputs(ma, mb, k, dev, plan, transpose_a, stats)
    maxima = torch.zeros(ma + mb + 2 * k + 2, dtype=torch.float32, device=dev)
    # the scales in the layouts the layer's GEMMs take them (no reshape per GEMM): a's as fprop's
    # A (M, 1); a^T's as wgrad's B, b's as fprop's B and b^T's as dgrad's B, each (1, rows)
    sia = torch.empty(size=(ma, 1), dtype=torch.float32, device=dev)
    sita = torch.empty(size=(1, k) if transpose_a else (0, 1), dtype=torch.float32, device=dev)
    sib = torch.empty(size=(1, mb), dtype=torch.float32, device=dev)
    sitb = torch.empty(size=(1, k), dtype=torch.float32, device=dev)
    launch(_amax_rows_cols_pair_kernel, plan.amax_grid, plan.warm, (a, b), plan.amax_kw)(a, b, maxima, ma, mb, k)
    launch(_ct_row_pair_kernel, plan.grid, plan.warm, (a, b), plan.kw)(
        a, qa, qta if transpose_a else qa, sia, sita if transpose_a else sia, b, qb, qtb, sib, sitb, maxima,
        maxima if part is None else part, maxima if sta is None else sta, maxima if stb is None else stb, ma, mb, k)
    return Cast(qa, sia, qta, sita, sta), Cast(qb, sib, qtb, sitb, stb)
