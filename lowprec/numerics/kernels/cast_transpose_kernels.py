"""The device code of `lowprec.numerics.kernels.cast_transpose`: its Triton kernels.

`_ct_kernel` casts one (BM, BN) tile of a tensor-wise or delayed-scaling operand into both
layouts; `_amax_rows_cols_kernel` and `_ct_row_kernel` are the row-wise pair (row and column
maxima, then the cast of both layouts). With STATS each tile writes its row of the
statistics partials and the last tile to finish sums them (`_finish_stats`). Each kernel's body
is a tile function of the tile's indices (`_ct_tile`, `_rows_cols_tile`, `_ct_row_tile`), which
`cast_pair_kernels` calls for two operands in one launch. The host code, the numerics and the
statistics are described in `cast_transpose`.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowprec.numerics.kernels.fp8_cast import _encode, _finite_abs, _load_f32, _scale_of

_FP32_MAX = tl.constexpr(3.4028234663852886e38)


@triton.jit
def _as(code, ptr):
    """FP8 codes (uint8) as the element type of `ptr` (FP8 or uint8: the same bits), so that
    the host allocates the FP8 tensors it returns (no dtype view per output)."""
    return code.to(ptr.dtype.element_ty, bitcast=True)


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
    # The amax and the counts are exact in FP32 / int32 (a tile has 4,096 elements): reduced
    # there and widened once, so that no FP64 copy of them is live per element. dq = |q| /
    # scale in FP32, rounded once as `quantize` dequantizes; then the error, its square and
    # the sums in FP64 (exact differences and squares of FP32 values), each product formed at
    # its reduction. No FP64 division per element: on a GPU that is many times the cost of
    # the cast itself.
    row = _stats_row(part_ptr)
    tl.store(row + 0, tl.max(tl.max(ax, axis=1), axis=0).to(tl.float64))
    tl.store(row + 1, tl.sum(tl.sum(sat.to(tl.int32), axis=1), axis=0).to(tl.float64))
    tl.store(row + 2, tl.sum(tl.sum(under.to(tl.int32), axis=1), axis=0).to(tl.float64))
    tl.store(row + 5, tl.sum(tl.sum(nonfin.to(tl.int32), axis=1), axis=0).to(tl.float64))
    tl.store(row + 6, tl.where(first, tl.cast(numel, tl.float64), 0.0))
    a64 = ax.to(tl.float64)
    err = tl.math.div_rn(qa, scale).to(tl.float64) - a64
    tl.store(row + 3, tl.sum(tl.sum(err * err, axis=1), axis=0))
    sq = a64 * a64
    tl.store(row + 4, tl.sum(tl.sum(sq, axis=1), axis=0))
    tl.store(row + 7, tl.sum(tl.sum(tl.where(under, sq, 0.0), axis=1), axis=0))


@triton.jit
def _finish_stats(part_ptr, out_ptr, n, BLOCK_T: tl.constexpr):
    """The packed statistics from the operand's n rows of (tiles, 8) partials, by its last tile
    to finish (its caller holds the ticket that says so): the column sums, the maximum for
    slot 0 (the amax), rows read in their fixed order (the same figures whatever order the
    tiles ran in). No separate launch sums them. `n` is the operand's tile count (a launch
    that casts two operands, `cast_pair_kernels`, has more programs than that)."""
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
def _last_tile(ticket_ptr, tiles):
    """Whether this tile is the last of its operand's `tiles` to get here (a float ticket counter
    that starts at 0; atomics are acquire-release, so the last one sees every other tile's stores)."""
    t = tl.atomic_add(ticket_ptr, 1.0)
    return t == (tiles - 1).to(tl.float32)


@triton.jit
def _history_scale(hist_ptr, count_ptr, L, BLOCK_L: tl.constexpr, MAX: tl.constexpr,
                   MARGIN_DIV: tl.constexpr, MOST_RECENT: tl.constexpr):
    """`AmaxHistory.scale()`: (MAX / amax) / 2**margin, 1 where the history is empty or the
    scale not finite. MAX / amax divided in FP64 and rounded once to FP32 (correctly rounded,
    as `lowprec.numerics.delayed.history_scale`; Triton's FP32 division is approximate)."""
    if MOST_RECENT:
        cnt = tl.load(count_ptr)
        amax = tl.load(hist_ptr + (tl.maximum(cnt - 1, 0) % L))
    else:
        lo = tl.arange(0, BLOCK_L)
        amax = tl.max(tl.load(hist_ptr + lo, mask=lo < L, other=0.0), axis=0)
    s = (MAX / amax.to(tl.float64)).to(tl.float32) / MARGIN_DIV
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
    if DELAYED:
        ticket = ticket_ptr
    else:   # the statistics' ticket: the slot after the partial maxima
        ticket = partial_ptr + P
    _ct_tile(tl.program_id(0), tl.program_id(1), tl.num_programs(0) * tl.num_programs(1), 0, x_ptr, q_ptr, qt_ptr,
             partial_ptr, P, hist_ptr, count_ptr, L, scratch_ptr, ticket, overflow_ptr, overflow_index,
             scale_inv_ptr, stats_ptr, stats_out_ptr, numel, M, N, stride_x, BM, BN, BLOCK_P, BLOCK_L, MAX, MB,
             BIAS, HAS_INF, THR, ODD, EPS, DELAYED, MOST_RECENT, MARGIN_DIV, OVERFLOW, TRANSPOSE, STATS, BF16,
             BLOCK_T)


@triton.jit
def _ct_tile(pid_m, pid_n, tiles, row0, x_ptr, q_ptr, qt_ptr, partial_ptr, P, hist_ptr, count_ptr, L, scratch_ptr,
             ticket_ptr, overflow_ptr, overflow_index, scale_inv_ptr, stats_ptr, stats_out_ptr, numel, M, N,
             stride_x, BM: tl.constexpr, BN: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr,
             MAX: tl.constexpr, MB: tl.constexpr, BIAS: tl.constexpr, HAS_INF: tl.constexpr,
             THR: tl.constexpr, ODD: tl.constexpr, EPS: tl.constexpr, DELAYED: tl.constexpr,
             MOST_RECENT: tl.constexpr, MARGIN_DIV: tl.constexpr, OVERFLOW: tl.constexpr,
             TRANSPOSE: tl.constexpr, STATS: tl.constexpr, BF16: tl.constexpr, BLOCK_T: tl.constexpr):
    """Tile (pid_m, pid_n) of an operand cast in `tiles` tiles (`_ct_kernel`'s body). With STATS
    the tile writes row `program_id` of the launch's partials at `stats_ptr` (`_tile_stats`) and
    the operand's rows start at row `row0` (0 unless the launch casts another operand first);
    `ticket_ptr`: the operand's ticket, a float counter (tensor-wise, zeroed by the amax pass)
    or, delayed, the int32 one the history's update takes."""
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
    tl.store(q_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], _as(code, q_ptr), mask=m)
    if TRANSPOSE:
        mt = (cols[:, None] < N) & (rows[None, :] < M)
        tl.store(qt_ptr + cols[:, None].to(tl.int64) * M + rows[None, :], _as(tl.trans(code), qt_ptr), mask=mt)
    if STATS:
        _tile_stats(stats_ptr, first, numel, ax, qa, sat & m, under & m, nonfin & m, scale)
        if not DELAYED:   # tensor-wise: the float ticket (delayed: the history's, below)
            if _last_tile(ticket_ptr, tiles):
                _finish_stats(stats_ptr + row0 * 8, stats_out_ptr, tiles, BLOCK_T)
    if DELAYED:
        tl.atomic_max(scratch_ptr, tl.max(tl.max(ax, axis=1), axis=0))
        ticket = tl.atomic_add(ticket_ptr, 1)
        if ticket == tiles - 1:   # every other tile of this operand is done
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
                _finish_stats(stats_ptr + row0 * 8, stats_out_ptr, tiles, BLOCK_T)
            tl.store(scratch_ptr, 0.0)
            tl.store(ticket_ptr, 0)


@triton.jit
def _amax_rows_cols_kernel(x_ptr, maxima_ptr, M, N, stride_x, BM: tl.constexpr,
                           BN: tl.constexpr, BF16: tl.constexpr):
    """Row maxima into maxima[:M], column maxima into maxima[M:] (one base pointer and an
    offset, not two views: a graph then sees one buffer written)."""
    _rows_cols_tile(tl.program_id(0), tl.program_id(1), x_ptr, maxima_ptr, M, N, stride_x, BM, BN, BF16)


@triton.jit
def _rows_cols_tile(pid_m, pid_n, x_ptr, maxima_ptr, M, N, stride_x, BM: tl.constexpr, BN: tl.constexpr,
                    BF16: tl.constexpr):
    """Tile (pid_m, pid_n)'s row and column maxima (`_amax_rows_cols_kernel`'s body)."""
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
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
    _ct_row_tile(tl.program_id(0), tl.program_id(1), tl.num_programs(0) * tl.num_programs(1), 0, x_ptr, q_ptr,
                 qt_ptr, maxima_ptr, si_ptr, sit_ptr, stats_ptr, stats_out_ptr, numel, M, N, stride_x, BM, BN, MAX,
                 MB, BIAS, HAS_INF, THR, ODD, EPS, TRANSPOSE, STATS, BF16, BLOCK_T)


@triton.jit
def _ct_row_tile(pid_m, pid_n, tiles, row0, x_ptr, q_ptr, qt_ptr, maxima_ptr, si_ptr, sit_ptr, stats_ptr,
                 stats_out_ptr, numel, M, N, stride_x, BM: tl.constexpr, BN: tl.constexpr, MAX: tl.constexpr,
                 MB: tl.constexpr, BIAS: tl.constexpr, HAS_INF: tl.constexpr, THR: tl.constexpr,
                 ODD: tl.constexpr, EPS: tl.constexpr, TRANSPOSE: tl.constexpr, STATS: tl.constexpr,
                 BF16: tl.constexpr, BLOCK_T: tl.constexpr):
    """Tile (pid_m, pid_n) of a row-wise operand cast in `tiles` tiles (`_ct_row_kernel`'s body;
    `row0` and the statistics' partials as `_ct_tile`'s; the ticket: maxima[M + N])."""
    rows = pid_m * BM + tl.arange(0, BM)
    cols = pid_n * BN + tl.arange(0, BN)
    rm = rows < M
    cm = cols < N
    m = rm[:, None] & cm[None, :]
    x = _load_f32(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], m, BF16)
    ramax = tl.load(maxima_ptr + rows, mask=rm, other=0.0)
    rs, rsi = _scale_of(ramax, MAX, EPS)
    code, ax, sat, under, nonfin, qa = _encode(x, rs[:, None], MAX, MB, BIAS, HAS_INF, THR, ODD)
    tl.store(q_ptr + rows[:, None].to(tl.int64) * N + cols[None, :], _as(code, q_ptr), mask=m)
    if pid_n == 0:
        tl.store(si_ptr + rows, rsi, mask=rm)
    if TRANSPOSE:
        camax = tl.load(maxima_ptr + M + cols, mask=cm, other=0.0)
        cs, csi = _scale_of(camax, MAX, EPS)
        code_t, _, _, _, _, _ = _encode(x, cs[None, :], MAX, MB, BIAS, HAS_INF, THR, ODD)
        mt = cm[:, None] & rm[None, :]
        tl.store(qt_ptr + cols[:, None].to(tl.int64) * M + rows[None, :], _as(tl.trans(code_t), qt_ptr), mask=mt)
        if pid_m == 0:
            tl.store(sit_ptr + cols, csi, mask=cm)
    if STATS:   # the ticket: the slot after the maxima, zeroed with them
        _tile_stats(stats_ptr, (pid_m == 0) & (pid_n == 0), numel, ax, qa, sat & m, under & m,
                    nonfin & m, rs[:, None])
        if _last_tile(maxima_ptr + M + N, tiles):
            _finish_stats(stats_ptr + row0 * 8, stats_out_ptr, tiles, BLOCK_T)
