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
so a check step launches no more kernels than a plain one. Counts are exact; the dequantized magnitude is
`quantize`'s (|q| / scale, one FP32 rounding), the error, the squares and the three sums
are FP64 (their order differs from `quantize`'s, so they agree to rounding, not bit for bit).
Element and scale numerics are `lowprec.numerics.quantize.quantize`'s, bit for bit (`fp8_cast._encode`, `_scale_of`).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from lowprec.numerics.kernels.fp8_cast import (
    _amax_partial_kernel, _bits, _checked, _consts, _encode, _finite_abs, _flat_grid, _load_f32, _prepare, _scale_of,
    cdiv, next_power_of_2,
)
from lowprec.numerics.quant_stats import QuantStats

__all__ = ["cast_transpose", "cast_transpose_delayed", "cast_transpose_rowwise", "DelayedState"]

_FP32_MAX = tl.constexpr(3.4028234663852886e38)
_TILE = (64, 64)
_N_STATS = len(QuantStats.FIELDS)
_BLOCK_T = 64      # rows of the statistics partials the last tile reads at a time


# ----------------------------------------------------------------------------- device code


@triton.jit
def _stats_row(part_ptr):
    """This tile's row of the (tiles, 8) statistics partials."""
    return part_ptr + (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)).to(tl.int64) * 8


@triton.jit
def _tile_stats(part_ptr, first, numel, ax, qa, sat, under, nonfin, scale):
    """Write this tile's amax, counts and FP64 sums to its own row of the (tiles, 8) partials
    (slots as QuantStats). No atomics: one address per tile and slot, so the check step costs
    what the sums cost, and the result does not depend on the tiles' order. Slot 6 (numel) is
    written by the first tile only (`first`), 0 by the others, so that the column sums are
    the operand's values; slot 0 is the tile's amax (`_finish_stats` takes their maximum)."""
    a64 = ax.to(tl.float64)
    # dq = |q| / scale in FP32, rounded once as `quantize` dequantizes; then the error, its
    # square and the sums in FP64 (exact differences and squares of FP32 values). No FP64
    # division per element: on a GPU that is many times the cost of the cast itself.
    err = tl.math.div_rn(qa, scale).to(tl.float64) - a64
    sq = a64 * a64
    row = _stats_row(part_ptr)
    tl.store(row + 0, tl.max(tl.max(a64, axis=1), axis=0))
    tl.store(row + 1, tl.sum(tl.sum(sat.to(tl.float64), axis=1), axis=0))
    tl.store(row + 2, tl.sum(tl.sum(under.to(tl.float64), axis=1), axis=0))
    tl.store(row + 3, tl.sum(tl.sum(err * err, axis=1), axis=0))
    tl.store(row + 4, tl.sum(tl.sum(sq, axis=1), axis=0))
    tl.store(row + 5, tl.sum(tl.sum(nonfin.to(tl.float64), axis=1), axis=0))
    tl.store(row + 6, tl.where(first, tl.cast(numel, tl.float64), 0.0))
    tl.store(row + 7, tl.sum(tl.sum(tl.where(under, sq, 0.0), axis=1), axis=0))


@triton.jit
def _finish_stats(part_ptr, out_ptr, BLOCK_T: tl.constexpr):
    """The packed statistics from the (tiles, 8) partials, by the last tile to finish (its
    caller holds the ticket that says so): the column sums, the maximum for slot 0 (the
    amax), rows read in their fixed order (the same figures whatever order the tiles ran in).
    No separate launch sums them."""
    n = tl.num_programs(0) * tl.num_programs(1)
    cols = tl.arange(0, 8)
    acc = tl.zeros((8,), tl.float64)
    top = tl.zeros((8,), tl.float64)
    for start in range(0, n, BLOCK_T):
        rows = start + tl.arange(0, BLOCK_T)
        blk = tl.load(part_ptr + rows[:, None].to(tl.int64) * 8 + cols[None, :], mask=rows[:, None] < n,
                      other=0.0)
        acc += tl.sum(blk, axis=0)
        top = tl.maximum(top, tl.max(blk, axis=0))
    tl.store(out_ptr + cols, tl.where(cols == 0, top, acc))


@triton.jit
def _last_tile(ticket_ptr):
    """Whether this tile is the last of the launch to get here (a float ticket counter that
    starts at 0; atomics are acquire-release, so the last one sees every other tile's stores)."""
    t = tl.atomic_add(ticket_ptr, 1.0)
    return t == (tl.num_programs(0) * tl.num_programs(1) - 1).to(tl.float32)


@triton.jit
def _history_scale(hist_ptr, count_ptr, L, BLOCK_L: tl.constexpr, MAX: tl.constexpr,
                   MARGIN_DIV: tl.constexpr, MOST_RECENT: tl.constexpr):
    """`AmaxHistory.scale()`: (MAX / amax) / 2**margin, 1 where the history is empty or the
    scale not finite. PyTorch's `float / tensor` is reciprocal(t) * float: done alike."""
    if MOST_RECENT:
        cnt = tl.load(count_ptr)
        amax = tl.load(hist_ptr + (tl.maximum(cnt - 1, 0) % L))
    else:
        lo = tl.arange(0, BLOCK_L)
        amax = tl.max(tl.load(hist_ptr + lo, mask=lo < L, other=0.0), axis=0)
    rec = (1.0 / amax.to(tl.float64)).to(tl.float32)
    s = (rec * MAX) / MARGIN_DIV
    ok = (amax > 0) & (s <= _FP32_MAX)
    return tl.where(ok, s, 1.0)


@triton.jit
def _ct_kernel(x_ptr, q_ptr, qt_ptr, partial_ptr, P, hist_ptr, count_ptr, L, scratch_ptr, ticket_ptr,
               overflow_ptr, overflow_index, scale_inv_ptr, stats_ptr, stats_out_ptr, numel, M, N,
               stride_x, BM: tl.constexpr, BN: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr,
               MAX: tl.constexpr, MB: tl.constexpr, BIAS: tl.constexpr, HAS_INF: tl.constexpr,
               THR: tl.constexpr, ODD: tl.constexpr, EPS: tl.constexpr, DELAYED: tl.constexpr,
               MOST_RECENT: tl.constexpr, MARGIN_DIV: tl.constexpr, OVERFLOW: tl.constexpr,
               TRANSPOSE: tl.constexpr, STATS: tl.constexpr, BF16: tl.constexpr, BLOCK_T: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    if DELAYED:
        scale = _history_scale(hist_ptr, count_ptr, L, BLOCK_L, MAX, MARGIN_DIV, MOST_RECENT)
        scale_inv = (1.0 / scale.to(tl.float64)).to(tl.float32)
    else:
        po = tl.arange(0, BLOCK_P)
        amax = tl.max(tl.load(partial_ptr + po, mask=po < P, other=0.0), axis=0)
        scale, scale_inv = _scale_of(amax, MAX, EPS)
    first = (pid_m == 0) & (pid_n == 0)
    if first:
        tl.store(scale_inv_ptr, scale_inv)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    m = (rows[:, None] < M) & (cols[None, :] < N)
    x = _load_f32(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], m, BF16)
    code, ax, sat, under, nonfin, qa = _encode(x, scale, MAX, MB, BIAS, HAS_INF, THR, ODD)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], code, mask=m)
    if TRANSPOSE:
        mt = (cols[:, None] < N) & (rows[None, :] < M)
        tl.store(qt_ptr + cols[:, None].to(tl.int64) * M + rows[None, :], tl.trans(code), mask=mt)
    if STATS:
        _tile_stats(stats_ptr, first, numel, ax, qa, sat & m, under & m, nonfin & m, scale)
        if not DELAYED:   # the ticket: after the partial maxima (delayed: the history's, below)
            if _last_tile(partial_ptr + P):
                _finish_stats(stats_ptr, stats_out_ptr, BLOCK_T)
    if DELAYED:
        tl.atomic_max(scratch_ptr, tl.max(tl.max(ax, axis=1), axis=0))
        ticket = tl.atomic_add(ticket_ptr, 1)
        if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:   # every other tile is done
            amax = tl.atomic_max(scratch_ptr, 0.0)                   # read after all of theirs
            cnt = tl.load(count_ptr)
            tl.store(hist_ptr + cnt % L, amax)
            tl.store(count_ptr, cnt + 1)
            if OVERFLOW:   # past twice the max: as lowprec.numerics.grid.saturates(amax * scale * 0.5)
                half = amax * scale * 0.5
                if ODD:
                    over = half >= THR
                else:
                    over = half > THR
                ov = overflow_ptr + overflow_index
                tl.store(ov, tl.load(ov) + over.to(tl.float64))
            if STATS:
                _finish_stats(stats_ptr, stats_out_ptr, BLOCK_T)
            tl.store(scratch_ptr, 0.0)
            tl.store(ticket_ptr, 0)


@triton.jit
def _amax_rows_cols_kernel(x_ptr, maxima_ptr, M, N, stride_x, BM: tl.constexpr,
                           BN: tl.constexpr, BF16: tl.constexpr):
    """Row maxima into maxima[:M], column maxima into maxima[M:] (one base pointer and an
    offset, not two views: a graph then sees one buffer written)."""
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    cols = tl.program_id(1) * BN + tl.arange(0, BN)
    m = (rows[:, None] < M) & (cols[None, :] < N)
    ax, _ = _finite_abs(_load_f32(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], m, BF16))
    tl.atomic_max(maxima_ptr + rows, tl.max(ax, axis=1), mask=rows < M)
    tl.atomic_max(maxima_ptr + M + cols, tl.max(ax, axis=0), mask=cols < N)


@triton.jit
def _ct_row_kernel(x_ptr, q_ptr, qt_ptr, maxima_ptr, si_ptr, sit_ptr, stats_ptr, stats_out_ptr, numel, M, N,
                   stride_x, BM: tl.constexpr, BN: tl.constexpr, MAX: tl.constexpr, MB: tl.constexpr,
                   BIAS: tl.constexpr, HAS_INF: tl.constexpr, THR: tl.constexpr, ODD: tl.constexpr,
                   EPS: tl.constexpr, TRANSPOSE: tl.constexpr, STATS: tl.constexpr, BF16: tl.constexpr,
                   BLOCK_T: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rm = rows < M
    cm = cols < N
    m = rm[:, None] & cm[None, :]
    x = _load_f32(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], m, BF16)
    ramax = tl.load(maxima_ptr + rows, mask=rm, other=0.0)
    rs, rsi = _scale_of(ramax, MAX, EPS)
    code, ax, sat, under, nonfin, qa = _encode(x, rs[:, None], MAX, MB, BIAS, HAS_INF, THR, ODD)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], code, mask=m)
    if pid_n == 0:
        tl.store(si_ptr + rows, rsi, mask=rm)
    if TRANSPOSE:
        camax = tl.load(maxima_ptr + M + cols, mask=cm, other=0.0)
        cs, csi = _scale_of(camax, MAX, EPS)
        code_t, _, _, _, _, _ = _encode(x, cs[None, :], MAX, MB, BIAS, HAS_INF, THR, ODD)
        mt = cm[:, None] & rm[None, :]
        tl.store(qt_ptr + cols[:, None].to(tl.int64) * M + rows[None, :], tl.trans(code_t), mask=mt)
        if pid_m == 0:
            tl.store(sit_ptr + cols, csi, mask=cm)
    if STATS:   # the ticket: the slot after the maxima, zeroed with them
        _tile_stats(stats_ptr, (pid_m == 0) & (pid_n == 0), numel, ax, qa, sat & m, under & m,
                    nonfin & m, rs[:, None])
        if _last_tile(maxima_ptr + M + N):
            _finish_stats(stats_ptr, stats_out_ptr, BLOCK_T)


# ----------------------------------------------------------------------------- host code


def _fill_zero_amax_scale_inv(elem, *scale_invs: torch.Tensor) -> None:
    """Fill `scale_invs` with the scale_inv of an all-zero tensor (amax 0, as quantize's)."""
    from lowprec.numerics.quantize import _div, _EPS
    scale = _div(elem.max, torch.full((), _EPS, device=scale_invs[0].device))
    for t in scale_invs:
        t.copy_(_div(1.0, scale).expand_as(t))


def _empty_result(x2, elem, q, qt, st, scale_inv):
    """An operand with no elements: the scale of an all-zero tensor."""
    _fill_zero_amax_scale_inv(elem, scale_inv)
    return q.view(elem.torch_dtype), scale_inv, qt.view(elem.torch_dtype), st


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
        self.scratch = torch.zeros((), dtype=torch.float32, device=dev) if scratch is None else scratch
        self.ticket = torch.zeros((), dtype=torch.int32, device=dev) if ticket is None else ticket


def eager_launch(kernel, grid):
    """`kernel[grid]`: a plain Triton launch (eager calls, the custom ops' implementations)."""
    return kernel[grid]


def traced_launch(kernel, grid):
    """The launch as `torch.library.wrap_triton` gives it: under make_fx / AOTAutograd (the
    decomposition of lowprec's cast ops in `lowprec.numerics.fp8_ops`) the kernel becomes a
    node of the graph, so Inductor launches it itself (and CUDA graphs can capture it)."""
    return torch.library.wrap_triton(kernel)[grid]


def _grid(m: int, n: int, tile) -> tuple[int, int]:
    return (max(1, cdiv(m, tile[0])), max(1, cdiv(n, tile[1])))


def _buffers(x2: torch.Tensor, transpose: bool, stats: bool, grid: tuple[int, int], stats_out):
    """q, q_t (empty without transpose), the per-tile statistics partials ((tiles, 8) FP64,
    every row written by its tile) and the packed statistics (8,) FP64 that the last tile
    writes (`stats_out` when given, else a new tensor; zeros for an operand without
    elements, where no kernel runs); both None without stats."""
    m, n = x2.shape
    dev = x2.device
    q = torch.empty((m, n), dtype=torch.uint8, device=dev)
    qt = torch.empty((n, m) if transpose else (0, 0), dtype=torch.uint8, device=dev)
    if not stats:
        return q, qt, None, None
    part = torch.empty((grid[0] * grid[1], _N_STATS), dtype=torch.float64, device=dev)
    st = torch.empty(_N_STATS, dtype=torch.float64, device=dev) if stats_out is None else stats_out
    if not (m and n):
        st.zero_()
    return q, qt, part, st


def _ptr(t: torch.Tensor | None, fallback: torch.Tensor) -> torch.Tensor:
    """An argument for a pointer the kernel does not use (an empty output): any real buffer."""
    return t if t is not None and t.numel() else fallback


@functools.lru_cache(maxsize=1024)
def _ct_plan(m: int, n: int, elem, bf16: bool, transpose: bool, stats: bool, tile, delayed: bool, hist_len: int):
    """What `_ct_kernel`'s launch needs besides its tensors, for one shape and recipe: (grid,
    programs of the amax pass, the constexpr keyword arguments). Computed once per shape (a
    pure function of its arguments), so that a cast's host time is its allocations and its
    launches."""
    grid = _grid(m, n, tile)
    p = _flat_grid(m * n, 2048)
    c = _consts(elem, bf16)
    kw = dict(BM=tile[0], BN=tile[1], BLOCK_P=1 if delayed else next_power_of_2(p),
              BLOCK_L=next_power_of_2(hist_len) if delayed else 1, MB=c["M"], DELAYED=delayed,
              TRANSPOSE=transpose, STATS=stats, BLOCK_T=_BLOCK_T, num_warps=4,
              **{k: v for k, v in c.items() if k != "M"})
    return grid, p, kw


def cast_transpose(x: torch.Tensor, elem, *, transpose: bool = True, stats: bool = False, tile=_TILE,
                   launch=eager_launch, stats_out: torch.Tensor | None = None):
    """Tensor-wise FP8 cast of `x` viewed as (M, N): `(q (M, N), scale_inv (), q_t (N, M) or
    an empty tensor, packed stats (8,) FP64 or None)`; q_t is q transposed. With `stats`,
    `stats_out` (an (8,) FP64 tensor) may be given for the statistics to be written to."""
    elem, x2 = _checked(x, elem, "cast_transpose")
    m, n = x2.shape
    bf16 = x2.dtype == torch.bfloat16
    grid, p, kw = _ct_plan(m, n, elem, bf16, transpose, stats, tuple(tile), False, 1)
    q, qt, part, st = _buffers(x2, transpose, stats, grid, stats_out)
    scale_inv = torch.empty((), dtype=torch.float32, device=x2.device)
    partial = torch.empty(p + 1, dtype=torch.float32, device=x2.device)   # the maxima, then the ticket
    bits = _bits(x2)
    launch(_amax_partial_kernel, (p,))(bits, partial, m * n, BLOCK=2048, BF16=bf16, TICKET=stats, num_warps=8)
    if not m * n:
        return _empty_result(x2, elem, q, qt, st, scale_inv)
    launch(_ct_kernel, grid)(
        bits, q, _ptr(qt, q), partial, p, partial, partial, 1, partial, partial, partial, 0, scale_inv,
        _ptr(part, partial), _ptr(st, partial), m * n, m, n, n,
        MOST_RECENT=False, MARGIN_DIV=1.0, OVERFLOW=False, **kw)
    return q.view(elem.torch_dtype), scale_inv, qt.view(elem.torch_dtype), st


def cast_transpose_delayed(x: torch.Tensor, elem, state: DelayedState, *, margin: int = 0,
                           most_recent: bool = False, overflow: torch.Tensor | None = None,
                           overflow_index: int = 0, transpose: bool = True, stats: bool = False,
                           tile=_TILE, launch=eager_launch, stats_out: torch.Tensor | None = None):
    """Delayed-scaling FP8 cast in one kernel: the scale from `state`'s history, this
    operand's amax appended to it. Returns `(q, scale_inv (), q_t or empty, stats or None)`.
    With `overflow`, `overflow[overflow_index]` is incremented when amax * scale / 2 saturates."""
    elem, x2 = _checked(x, elem, "cast_transpose_delayed")
    m, n = x2.shape
    hist = state.history
    grid, _, kw = _ct_plan(m, n, elem, x2.dtype == torch.bfloat16, transpose, stats, tuple(tile), True,
                           hist.numel())
    q, qt, part, st = _buffers(x2, transpose, stats, grid, stats_out)
    scale_inv = torch.empty((), dtype=torch.float32, device=x2.device)
    ov = overflow if overflow is not None else hist
    if not m * n:
        return _empty_result(x2, elem, q, qt, st, scale_inv)
    launch(_ct_kernel, grid)(
        _bits(x2), q, _ptr(qt, q), hist, 1, hist, state.count, hist.numel(), state.scratch, state.ticket, ov,
        overflow_index if overflow is not None else 0, scale_inv, _ptr(part, hist), _ptr(st, hist),
        m * n, m, n, n, MOST_RECENT=most_recent, MARGIN_DIV=float(2.0 ** margin), OVERFLOW=overflow is not None,
        **kw)
    return q.view(elem.torch_dtype), scale_inv, qt.view(elem.torch_dtype), st


def cast_transpose_rowwise(x: torch.Tensor, elem, *, transpose: bool = True, stats: bool = False,
                           tile=_TILE, launch=eager_launch, stats_out: torch.Tensor | None = None):
    """Row-wise FP8 casts of `x` viewed as (M, N): `q` with one scale per row (over N) and
    `q_t` = the row-wise cast of x^T (one scale per column of x, over M). Returns
    `(q, scale_inv (M, 1), q_t (N, M) or empty, scale_inv_t (N, 1) or empty, stats or None)`."""
    elem, x2, c = _prepare(x, elem, "cast_transpose_rowwise")
    m, n = x2.shape
    grid = _grid(m, n, tile)
    q, qt, part, st = _buffers(x2, transpose, stats, grid, stats_out)
    # row maxima, column maxima, then the statistics' ticket: one zeroed buffer
    maxima = torch.zeros(m + n + 1, dtype=torch.float32, device=x2.device)
    si = torch.empty((m, 1), dtype=torch.float32, device=x2.device)
    sit = torch.empty((n, 1) if transpose else (0, 1), dtype=torch.float32, device=x2.device)
    if m and n:
        launch(_amax_rows_cols_kernel, grid)(_bits(x2), maxima, m, n, n, BM=tile[0], BN=tile[1],
                                             BF16=c["BF16"], num_warps=4)
        launch(_ct_row_kernel, grid)(_bits(x2), q, _ptr(qt, q), maxima, si, _ptr(sit, si), _ptr(part, maxima),
                                     _ptr(st, maxima), m * n, m, n, n, BM=tile[0], BN=tile[1], MB=c.pop("M"),
                                     TRANSPOSE=transpose, STATS=stats, BLOCK_T=_BLOCK_T, num_warps=4, **c)
    else:   # no elements in a row or a column: the scales of an amax of 0, as quantize's
        _fill_zero_amax_scale_inv(elem, si, sit)
    return q.view(elem.torch_dtype), si, qt.view(elem.torch_dtype), sit, st
