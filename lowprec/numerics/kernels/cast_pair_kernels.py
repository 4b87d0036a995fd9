"""The device code of `lowprec.numerics.kernels.cast_pair`: two operands' casts in one launch.

Each kernel here launches a 1-D grid of operand A's programs then operand B's (a layer's
input and its weight: the same element format, the same inner dimension K), and each program
runs the tile function of the separate cast (`cast_transpose_kernels`: `_amax_part`,
`_ct_tile`, `_rows_cols_tile`, `_ct_row_tile`) on its own operand's tile with its own
operand's buffers, so each operand's bytes, scales and delayed history are what its separate
cast writes. With STATS each operand has its own statistics: every tile writes its row of one
(tiles A + tiles B, 8) partials buffer (row = program id: A's rows first), each operand has
its own ticket, and the last of an operand's tiles sums that operand's rows alone
(`_finish_stats` from row `row0` over its own tile count), in the order its separate cast
sums them: the same figures, bit for bit.
"""

from __future__ import annotations

import triton
import triton.language as tl

from lowprec.numerics.kernels.cast_transpose_kernels import _ct_row_tile, _ct_tile, _rows_cols_tile
from lowprec.numerics.kernels.fp8_cast import _amax_part


@triton.jit
def _amax_pair_kernel(xa_ptr, xb_ptr, partial_ptr, NA, NB, PA, BLOCK: tl.constexpr, BF16_A: tl.constexpr,
                      BF16_B: tl.constexpr, TICKET: tl.constexpr):
    """`fp8_cast._amax_partial_kernel` of two operands in one launch: programs [0, PA) write
    A's partial maxima to partial[:PA], the rest B's to partial[PA:] (one maximum each). With
    TICKET, program 0 also zeroes the two float tickets after them (A's, then B's) that the
    cast with statistics launched next counts its tiles on."""
    pid = tl.program_id(0)
    if TICKET:
        if pid == 0:
            tl.store(partial_ptr + tl.num_programs(0), 0.0)
            tl.store(partial_ptr + tl.num_programs(0) + 1, 0.0)
    if pid < PA:
        amax = _amax_part(xa_ptr, NA, pid, PA, BLOCK, BF16_A)
    else:
        amax = _amax_part(xb_ptr, NB, pid - PA, tl.num_programs(0) - PA, BLOCK, BF16_B)
    tl.store(partial_ptr + pid, amax)


@triton.jit
def _ct_pair_kernel(xa_ptr, qa_ptr, qta_ptr, sia_ptr, xb_ptr, qb_ptr, qtb_ptr, sib_ptr, partial_ptr, PA, PB,
                    hista_ptr, counta_ptr, scratcha_ptr, ticketa_ptr, histb_ptr, countb_ptr, scratchb_ptr,
                    ticketb_ptr, L, overflow_ptr, part_ptr, sta_ptr, stb_ptr, MA, NA, MB_ROWS, NB,
                    BM: tl.constexpr, BN: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_L: tl.constexpr,
                    MAX: tl.constexpr, MB: tl.constexpr, BIAS: tl.constexpr, HAS_INF: tl.constexpr,
                    THR: tl.constexpr, ODD: tl.constexpr, EPS: tl.constexpr, DELAYED: tl.constexpr,
                    MOST_RECENT: tl.constexpr, MARGIN_DIV: tl.constexpr, OVERFLOW: tl.constexpr,
                    TRANSPOSE_A: tl.constexpr, STATS: tl.constexpr, BF16_A: tl.constexpr, BF16_B: tl.constexpr,
                    BLOCK_T: tl.constexpr):
    """`_ct_kernel` of two operands of one element format in one launch (a layer's input, A,
    and its weight, B, both transposed for the backward unless TRANSPOSE_A is off): a 1-D grid
    of A's tiles then B's, each program casting its operand's tile as `_ct_kernel` would.
    Tensor-wise: A's partial maxima are partial[:PA], B's partial[PA:PA + PB] (the amax pair
    pass's), the statistics' tickets partial[PA + PB] (A) and partial[PA + PB + 1] (B).
    Delayed: each operand its own history, count, scratch and ticket (overflow counted at
    index 0 for A, 1 for B, as the layer's separate casts do). STATS: the module docstring."""
    pid = tl.program_id(0)
    gna = tl.cdiv(NA, BN)
    tiles_a = tl.cdiv(MA, BM) * gna
    if pid < tiles_a:
        if DELAYED:
            ticket = ticketa_ptr
        else:
            ticket = partial_ptr + PA + PB
        _ct_tile(pid // gna, pid % gna, tiles_a, 0, xa_ptr, qa_ptr, qta_ptr, partial_ptr, PA, hista_ptr,
                 counta_ptr, L, scratcha_ptr, ticket, overflow_ptr, 0, sia_ptr, part_ptr, sta_ptr, MA * NA, MA, NA,
                 NA, BM, BN, BLOCK_P, BLOCK_L, MAX, MB, BIAS, HAS_INF, THR, ODD, EPS, DELAYED, MOST_RECENT,
                 MARGIN_DIV, OVERFLOW, TRANSPOSE_A, STATS, BF16_A, BLOCK_T)
    else:
        if DELAYED:
            ticket = ticketb_ptr
        else:
            ticket = partial_ptr + PA + PB + 1
        gnb = tl.cdiv(NB, BN)
        t = pid - tiles_a
        _ct_tile(t // gnb, t % gnb, tl.cdiv(MB_ROWS, BM) * gnb, tiles_a, xb_ptr, qb_ptr, qtb_ptr, partial_ptr + PA,
                 PB, histb_ptr, countb_ptr, L, scratchb_ptr, ticket, overflow_ptr, 1, sib_ptr, part_ptr, stb_ptr,
                 MB_ROWS * NB, MB_ROWS, NB, NB, BM, BN, BLOCK_P, BLOCK_L, MAX, MB, BIAS, HAS_INF, THR, ODD, EPS,
                 DELAYED, MOST_RECENT, MARGIN_DIV, OVERFLOW, True, STATS, BF16_B, BLOCK_T)


@triton.jit
def _amax_rows_cols_pair_kernel(xa_ptr, xb_ptr, maxima_ptr, MA, MB_ROWS, N, BM: tl.constexpr, BN: tl.constexpr,
                           BF16_A: tl.constexpr, BF16_B: tl.constexpr):
    """`_amax_rows_cols_kernel` of A (MA, N) and B (MB_ROWS, N) in one launch: A's row maxima,
    column maxima and ticket slot in maxima[:MA + N + 1], B's in the MB_ROWS + N + 1 after."""
    pid = tl.program_id(0)
    gn = tl.cdiv(N, BN)
    tiles_a = tl.cdiv(MA, BM) * gn
    if pid < tiles_a:
        _rows_cols_tile(pid // gn, pid % gn, xa_ptr, maxima_ptr, MA, N, N, BM, BN, BF16_A)
    else:
        t = pid - tiles_a
        _rows_cols_tile(t // gn, t % gn, xb_ptr, maxima_ptr + MA + N + 1, MB_ROWS, N, N, BM, BN, BF16_B)


@triton.jit
def _ct_row_pair_kernel(xa_ptr, qa_ptr, qta_ptr, sia_ptr, sita_ptr, xb_ptr, qb_ptr, qtb_ptr, sib_ptr, sitb_ptr,
                        maxima_ptr, part_ptr, sta_ptr, stb_ptr, MA, MB_ROWS, N, BM: tl.constexpr,
                        BN: tl.constexpr, MAX: tl.constexpr, MB: tl.constexpr, BIAS: tl.constexpr,
                        HAS_INF: tl.constexpr, THR: tl.constexpr, ODD: tl.constexpr, EPS: tl.constexpr,
                        TRANSPOSE_A: tl.constexpr, STATS: tl.constexpr, BF16_A: tl.constexpr,
                        BF16_B: tl.constexpr, BLOCK_T: tl.constexpr):
    """`_ct_row_kernel` of A and B in one launch, on `_amax_rows_cols_pair_kernel`'s maxima (each
    operand's ticket the slot after its column maxima); B is always transposed, A unless
    TRANSPOSE_A is off. STATS: the module docstring."""
    pid = tl.program_id(0)
    gn = tl.cdiv(N, BN)
    tiles_a = tl.cdiv(MA, BM) * gn
    if pid < tiles_a:
        _ct_row_tile(pid // gn, pid % gn, tiles_a, 0, xa_ptr, qa_ptr, qta_ptr, maxima_ptr, sia_ptr, sita_ptr,
                     part_ptr, sta_ptr, MA * N, MA, N, N, BM, BN, MAX, MB, BIAS, HAS_INF, THR, ODD, EPS,
                     TRANSPOSE_A, STATS, BF16_A, BLOCK_T)
    else:
        t = pid - tiles_a
        _ct_row_tile(t // gn, t % gn, tl.cdiv(MB_ROWS, BM) * gn, tiles_a, xb_ptr, qb_ptr, qtb_ptr,
                     maxima_ptr + MA + N + 1, sib_ptr, sitb_ptr, part_ptr, stb_ptr, MB_ROWS * N, MB_ROWS, N, N, BM,
                     BN, MAX, MB, BIAS, HAS_INF, THR, ODD, EPS, True, STATS, BF16_B, BLOCK_T)
