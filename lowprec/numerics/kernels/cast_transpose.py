"""Triton kernels of the FP8 fast path: one read of an operand writes both GEMM layouts.

A linear layer's backward needs every operand in the other layout too (`torch._scaled_mm`
takes A row-major and B column-major: the weight transposed for dgrad, the input and the
output gradient transposed for wgrad). Casting and then transposing the FP8 tensor costs
one more read and write; these kernels, as Transformer Engine's cast_transpose, write
both from the tile they hold in registers:

* `cast_transpose(x, elem)`: tensor-wise current scaling, two kernels (the partial maxima
  of `fp8_cast._amax_partial_kernel`, then the 2-D tiled cast that derives the scale on
  the device and writes `q` (M, N) and `q_t` (N, M)).
* `cast_transpose_delayed(x, elem, state)`: delayed scaling, ONE kernel: every program
  computes the scale from the on-device amax history (as `AmaxHistory.scale`), casts its
  tile, and maxes its amax into a scratch scalar; the last program to finish (a ticket
  counter) appends the operand's amax to the history, bumps its count, counts an
  overflow step if asked, and resets the scratch and the ticket for the next call.
* `cast_transpose_rowwise(x, elem)`: row-wise scaling along K for `q` and along M for
  `q_t` (the wgrad operand reduces over tokens), two kernels (row and column maxima in
  one read, then the cast of both layouts).

`stats=True` (a constexpr: free when off) also gives the packed `QuantStats` vector of
the row-major quantization (amax, saturated, underflow, squared error, signal power,
non-finite, numel, underflow energy) from the same pass: each tile writes its amax, counts
and FP64 sums to its own row of a (tiles, 8) buffer (no atomics on the sums: on an H100
six FP64 atomic adds per tile into one vector made a check step's cast 5.4x slower), and
the last tile to finish (a ticket counter: the slot after the partial maxima, after the
row/column maxima, or the delayed state's) reads the rows in order and writes the vector,
so a check step launches no more kernels than a plain one. Counts are exact; the
dequantized magnitude is `quantize`'s (|q| / scale, one FP32 rounding), the error, the
squares and the three sums are FP64 (their order differs from `quantize`'s, so they agree
to rounding, not bit for bit).
Element and scale numerics are `lowprec.numerics.quantize.quantize`'s, bit for bit
(`fp8_cast._encode`, `_scale_of`). The kernels themselves are in `cast_transpose_kernels`;
this module allocates their buffers and launches them (eager launches warm:
`lowprec.numerics.kernels.warm_launch`); `cast_pair` casts a layer's input and weight together.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from lowprec.numerics.kernels.cast_transpose_kernels import _amax_rows_cols_kernel, _ct_kernel, _ct_row_kernel
from lowprec.numerics.kernels.fp8_cast import (
    _amax_partial_kernel, _checked, _consts, _flat_grid, cdiv, next_power_of_2,
)
from lowprec.numerics.kernels.warm_launch import warm_launch
from lowprec.numerics.quant_stats import QuantStats

__all__ = ["cast_transpose", "cast_transpose_delayed", "cast_transpose_rowwise", "DelayedState"]

_TILE = (64, 64)
_N_STATS = len(QuantStats.FIELDS)
_BLOCK_T = 256     # rows of the statistics partials the last tile reads at a time


# ----------------------------------------------------------------------------- host code


def _fill_zero_amax_scale_inv(elem, *scale_invs: torch.Tensor) -> None:
    """Fill `scale_invs` with the scale_inv of an all-zero tensor (amax 0, as quantize's)."""
    from lowprec.numerics.quantize import _div, _EPS
    scale = _div(elem.max, torch.full((), _EPS, device=scale_invs[0].device))
    for t in scale_invs:
        t.copy_(_div(1.0, scale).expand_as(t))


def _empty_result(elem, q, qt, st, scale_inv):
    """An operand with no elements: the scale of an all-zero tensor."""
    _fill_zero_amax_scale_inv(elem, scale_inv)
    return q, scale_inv, qt, st


class DelayedState:
    """The device tensors a delayed cast reads and updates: the amax history (FP32, its
    length L), how many amaxes it holds (int64), and two scratch scalars of the kernel
    (the running amax, FP32, and the finishing ticket, int32), both zero between calls.
    `overflow` (FP64) and `overflow_index`: where an overflow step is counted."""

    __slots__ = ("history", "count", "scratch", "ticket")

    def __init__(self, history: torch.Tensor, count: torch.Tensor, scratch: torch.Tensor | None = None,
                 ticket: torch.Tensor | None = None):
        self.history, self.count = history, count
        dev = history.device
        self.scratch = torch.zeros(size=(), dtype=torch.float32, device=dev) if scratch is None else scratch
        self.ticket = torch.zeros(size=(), dtype=torch.int32, device=dev) if ticket is None else ticket


def eager_launch(kernel, grid, warm: dict | None = None, vary: tuple = (), kw: dict | None = None):
    """A callable of the kernel's positional arguments that launches `kernel[grid](*args, **kw)`
    (eager calls, the custom ops' implementations); with `warm`, the launch plan's dict of
    compiled kernels, Triton binds and specialises the arguments once per specialisation, not
    per launch; `vary`: the arguments the plan does not fix; `kw`: the plan's keyword
    arguments (`lowprec.numerics.kernels.warm_launch`)."""
    return warm_launch(kernel, grid, warm, vary, kw)


def traced_launch(kernel, grid, warm: dict | None = None, vary: tuple = (), kw: dict | None = None):
    """The launch as `torch.library.wrap_triton` gives it: under make_fx / AOTAutograd (the
    decomposition of lowprec's cast ops in `lowprec.numerics.fp8_ops`) the kernel becomes a
    node of the graph, so Inductor launches it itself (and CUDA graphs can capture it);
    `warm` and `vary` are not used (Inductor's wrapper launches the compiled kernel)."""
    return functools.partial(torch.library.wrap_triton(kernel)[grid], **(kw or {}))


def _grid(m: int, n: int, tile) -> tuple[int, int]:
    return (max(1, cdiv(m, tile[0])), max(1, cdiv(n, tile[1])))


def _buffers(m: int, n: int, dev, fp8: torch.dtype, transpose: bool, stats: bool, tiles: int, stats_out):
    """q, q_t (FP8 `fp8`; q_t empty without transpose), the per-tile statistics partials ((tiles, 8) FP64,
    every row written by its tile) and the packed statistics (8,) FP64 that the last tile
    writes (`stats_out` when given, else a new tensor; zeros for an operand without
    elements, where no kernel runs); both None without stats."""
    q = torch.empty(size=(m, n), dtype=fp8, device=dev)
    qt = torch.empty(size=(n, m) if transpose else (0, 0), dtype=fp8, device=dev)
    if not stats:
        return q, qt, None, None
    part = torch.empty(size=(tiles, _N_STATS), dtype=torch.float64, device=dev)
    st = torch.empty(_N_STATS, dtype=torch.float64, device=dev) if stats_out is None else stats_out
    if not (m and n):
        st.zero_()
    return q, qt, part, st


class _Plan(NamedTuple):
    """A launch plan: the grid, the amax pass's programs and keyword arguments, the cast's
    keyword arguments (constexprs), the FP8 dtype of the result, and the compiled kernels its
    eager launches call directly (`eager_launch`'s `warm`; filled at the first launches)."""
    grid: tuple[int, int]
    p: int
    amax_kw: dict
    kw: dict
    fp8: torch.dtype
    warm: dict


@functools.lru_cache(maxsize=1024)
def _plan(m: int, n: int, elem, dtype: torch.dtype, transpose: bool, stats: bool, tile, delayed: bool = False,
          hist_len: int = 1, most_recent: bool = False, margin: int = 0, overflow: bool = False) -> _Plan:
    """What `_ct_kernel`'s launches need besides their tensors, for one shape and recipe.
    Computed once (a pure function of its arguments), so that a cast's host time is its
    allocations and its launches."""
    bf16 = dtype == torch.bfloat16
    grid = _grid(m, n, tile)
    p = _flat_grid(m * n, 2048)
    c = _consts(elem, bf16)
    kw = dict(BM=tile[0], BN=tile[1], BLOCK_P=1 if delayed else next_power_of_2(p),
              BLOCK_L=next_power_of_2(hist_len) if delayed else 1, MB=c["M"], DELAYED=delayed,
              TRANSPOSE=transpose, STATS=stats, BLOCK_T=_BLOCK_T, MOST_RECENT=most_recent,
              MARGIN_DIV=float(2.0 ** margin), OVERFLOW=overflow, num_warps=4,
              **{k: v for k, v in c.items() if k != "M"})
    return _Plan(grid, p, dict(BLOCK=2048, BF16=bf16, TICKET=stats, num_warps=8), kw, elem.torch_dtype, {})


@functools.lru_cache(maxsize=1024)
def _row_plan(m: int, n: int, elem, dtype: torch.dtype, transpose: bool, stats: bool, tile) -> _Plan:
    """`_plan` of the row-wise pair (`_amax_rows_cols_kernel`, `_ct_row_kernel`)."""
    c = dict(_consts(elem, dtype == torch.bfloat16))
    kw = dict(BM=tile[0], BN=tile[1], MB=c.pop("M"), TRANSPOSE=transpose, STATS=stats, BLOCK_T=_BLOCK_T,
              num_warps=4, **c)
    return _Plan(_grid(m, n, tile), 0, dict(BM=tile[0], BN=tile[1], BF16=c["BF16"], num_warps=4), kw,
                 elem.torch_dtype, {})


def cast_transpose(x: torch.Tensor, elem, *, transpose: bool = True, stats: bool = False, tile=_TILE,
                   launch=eager_launch, stats_out: torch.Tensor | None = None):
    """Tensor-wise FP8 cast of `x` viewed as (M, N): `(q (M, N), scale_inv (), q_t (N, M) or
    an empty tensor, packed stats (8,) FP64 or None)`; q_t is q transposed. With `stats`,
    `stats_out` (an (8,) FP64 tensor) may be given for the statistics to be written to."""
    elem, x2 = _checked(x, elem, "cast_transpose")
    return tensorwise(x2, elem, transpose, stats, launch, stats_out, tuple(tile))


def tensorwise(x2: torch.Tensor, elem, transpose: bool, stats: bool, launch=eager_launch, stats_out=None,
               tile=_TILE):
    """`cast_transpose` of a contiguous 2-D BF16/FP16/FP32 operand its caller has checked
    (`lowprec.numerics.fp8_ops`' eager calls: no argument checks per call)."""
    m, n = x2.shape
    dev = x2.device
    plan = _plan(m, n, elem, x2.dtype, transpose, stats, tile)
    p = plan.p
    q, qt, part, st = _buffers(m, n, dev, plan.fp8, transpose, stats, plan.grid[0] * plan.grid[1], stats_out)
    scale_inv = torch.empty(size=(), dtype=torch.float32, device=dev)
    partial = torch.empty(p + 1, dtype=torch.float32, device=dev)   # the maxima, then the ticket
    launch(_amax_partial_kernel, (p,), plan.warm, (x2,), plan.amax_kw)(x2, partial, m * n)
    if not m * n:
        return _empty_result(elem, q, qt, st, scale_inv)
    launch(_ct_kernel, plan.grid, plan.warm, (x2, st), plan.kw)(
        x2, q, qt if transpose else q, partial, p, partial, partial, 1, partial, partial, partial, 0, scale_inv,
        part if stats else partial, st if stats else partial, m * n, m, n, n)
    return q, scale_inv, qt, st


def cast_transpose_delayed(x: torch.Tensor, elem, state: DelayedState, *, margin: int = 0,
                           most_recent: bool = False, overflow: torch.Tensor | None = None,
                           overflow_index: int = 0, transpose: bool = True, stats: bool = False,
                           tile=_TILE, launch=eager_launch, stats_out: torch.Tensor | None = None):
    """Delayed-scaling FP8 cast in one kernel: the scale from `state`'s history, this
    operand's amax appended to it. Returns `(q, scale_inv (), q_t or empty, stats or None)`.
    With `overflow`, `overflow[overflow_index]` is incremented when amax * scale / 2 saturates."""
    elem, x2 = _checked(x, elem, "cast_transpose_delayed")
    return delayed(x2, elem, (state.history, state.count, state.scratch, state.ticket), margin, most_recent,
                   overflow, overflow_index, transpose, stats, launch, stats_out, tuple(tile))


def delayed(x2: torch.Tensor, elem, state: tuple, margin: int, most_recent: bool, overflow, overflow_index: int,
            transpose: bool, stats: bool, launch=eager_launch, stats_out=None, tile=_TILE):
    """`cast_transpose_delayed` of a checked contiguous 2-D operand (as `tensorwise`); `state`
    is (history, count, scratch, ticket) as `DelayedState` holds them."""
    m, n = x2.shape
    dev = x2.device
    hist, count, scratch, ticket = state
    plan = _plan(m, n, elem, x2.dtype, transpose, stats, tile, True, hist.numel(), most_recent, margin,
                 overflow is not None)
    q, qt, part, st = _buffers(m, n, dev, plan.fp8, transpose, stats, plan.grid[0] * plan.grid[1], stats_out)
    scale_inv = torch.empty(size=(), dtype=torch.float32, device=dev)
    if not m * n:
        return _empty_result(elem, q, qt, st, scale_inv)
    launch(_ct_kernel, plan.grid, plan.warm, (x2, st, *state, overflow, overflow_index), plan.kw)(
        x2, q, qt if transpose else q, hist, 1, hist, count, hist.numel(), scratch,
        ticket, hist if overflow is None else overflow, 0 if overflow is None else overflow_index,
        scale_inv, part if stats else hist, st if stats else hist, m * n, m, n, n)
    return q, scale_inv, qt, st


def cast_transpose_rowwise(x: torch.Tensor, elem, *, transpose: bool = True, stats: bool = False,
                           tile=_TILE, launch=eager_launch, stats_out: torch.Tensor | None = None):
    """Row-wise FP8 casts of `x` viewed as (M, N): `q` with one scale per row (over N) and
    `q_t` = the row-wise cast of x^T (one scale per column of x, over M). Returns
    `(q, scale_inv (M, 1), q_t (N, M) or empty, scale_inv_t (N, 1) or empty, stats or None)`."""
    elem, x2 = _checked(x, elem, "cast_transpose_rowwise")
    return rowwise(x2, elem, transpose, stats, launch, stats_out, tuple(tile))


def rowwise(x2: torch.Tensor, elem, transpose: bool, stats: bool, launch=eager_launch, stats_out=None,
            tile=_TILE):
    """`cast_transpose_rowwise` of a checked contiguous 2-D operand (as `tensorwise`)."""
    m, n = x2.shape
    dev = x2.device
    plan = _row_plan(m, n, elem, x2.dtype, transpose, stats, tile)
    q, qt, part, st = _buffers(m, n, dev, plan.fp8, transpose, stats, plan.grid[0] * plan.grid[1], stats_out)
    # row maxima, column maxima, then the statistics' ticket: one zeroed buffer
    maxima = torch.zeros(m + n + 1, dtype=torch.float32, device=dev)
    si = torch.empty(size=(m, 1), dtype=torch.float32, device=dev)
    sit = torch.empty(size=(n, 1) if transpose else (0, 1), dtype=torch.float32, device=dev)
    if m and n:
        launch(_amax_rows_cols_kernel, plan.grid, plan.warm, (x2,), plan.amax_kw)(x2, maxima, m, n, n)
        launch(_ct_row_kernel, plan.grid, plan.warm, (x2, st), plan.kw)(
            x2, q, qt if transpose else q, maxima, si, sit if transpose else si, part if stats else maxima,
            st if stats else maxima, m * n, m, n, n)
    else:   # no elements in a row or a column: the scales of an amax of 0, as quantize's
        _fill_zero_amax_scale_inv(elem, si, sit)
    return q, si, qt, sit, st
