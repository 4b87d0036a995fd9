"""A layer's input and weight cast together: one launch where two are.

The forward of an FP8 linear layer casts its input x (M, K) and, on the first micro-batch
after an optimizer step (every step under delayed scaling), its weight w (N, K), each in
both layouts, with the same element format. `pair` launches each of the kernels those two
casts need once for both operands -- the amax pass (`_amax_pair_kernel`) and the
cast+transpose (`_ct_pair_kernel`) tensor-wise, the one delayed kernel under delayed
scaling -- over the two operands' programs side by side: a plain tensor-wise step's
launches go from 9 to 7, a delayed one's from 6 to 5. Each program does what the separate
cast's program would (`cast_transpose.tensorwise` / `delayed`), so the bytes, the scales
and the delayed histories are the separate casts' (tests/lowprec/numerics/kernels).

Steps without statistics only: a check step's casts each sum their statistics in their own
launch (`cast_transpose`), and keep doing so separately.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

from lowprec.numerics.kernels.cast_transpose import _TILE, eager_launch
from lowprec.numerics.kernels.cast_transpose_kernels import _amax_pair_kernel, _ct_pair_kernel
from lowprec.numerics.kernels.fp8_cast import _consts, _flat_grid, cdiv, next_power_of_2

__all__ = ["pair", "pairable"]

_BLOCK = 2048   # elements per amax-pass block, as the separate cast's


class _PairPlan(NamedTuple):
    """Launch plan of a pair: both launches' grids and keyword arguments, each operand's
    amax-pass programs, the FP8 dtype, the compiled kernels of warm launches."""
    amax_grid: tuple[int]
    grid: tuple[int]
    pa: int
    pb: int
    amax_kw: dict
    kw: dict
    fp8: torch.dtype
    warm: dict


def pairable(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether `pair` takes a and b: each what the kernels' unchecked entry points take
    (`fp8_ops._plain`: 2-D, contiguous, of a dtype they read), non-empty, with the same inner
    dimension, on one device."""
    from lowprec.numerics.fp8_ops import _plain   # fp8_ops imports the kernels lazily: no cycle at load
    return (_plain(a) and _plain(b) and a.shape[1] == b.shape[1] and a.numel() > 0 and b.numel() > 0
            and a.device == b.device)


@functools.lru_cache(maxsize=512)
def _pair_plan(ma: int, mb: int, k: int, elem, dtype_a: torch.dtype, dtype_b: torch.dtype, transpose_a: bool,
               delayed: bool, hist_len: int, most_recent: bool, margin: int, overflow: bool) -> _PairPlan:
    tiles = cdiv(ma, _TILE[0]) * cdiv(k, _TILE[1]) + cdiv(mb, _TILE[0]) * cdiv(k, _TILE[1])
    pa, pb = _flat_grid(ma * k, _BLOCK), _flat_grid(mb * k, _BLOCK)
    c = dict(_consts(elem, False))
    c.pop("BF16")
    kw = dict(BM=_TILE[0], BN=_TILE[1], BLOCK_P=1 if delayed else next_power_of_2(max(pa, pb)),
              BLOCK_L=next_power_of_2(hist_len) if delayed else 1, MB=c.pop("M"), DELAYED=delayed,
              MOST_RECENT=most_recent, MARGIN_DIV=float(2.0 ** margin), OVERFLOW=overflow, TRANSPOSE_A=transpose_a,
              BF16_A=dtype_a == torch.bfloat16, BF16_B=dtype_b == torch.bfloat16, num_warps=4, **c)
    amax_kw = dict(BLOCK=_BLOCK, BF16_A=kw["BF16_A"], BF16_B=kw["BF16_B"], num_warps=8)
    return _PairPlan((pa + pb,), (tiles,), pa, pb, amax_kw, kw, elem.torch_dtype, {})


def pair(a: torch.Tensor, b: torch.Tensor, elem, transpose_a: bool, launch=eager_launch, delayed=None):
    """The casts of a (M, K) and b (N, K) in one launch per kernel (module docstring), checked
    by `pairable`: `((q_a, scale_inv_a, q_a^T or empty), (q_b, scale_inv_b, q_b^T))`. Tensor-wise
    current scaling, or with `delayed` = (state_a, state_b, margin, most_recent, overflow)
    delayed scaling: each state (history, count, scratch, ticket) as `cast_transpose.delayed`
    takes it; `overflow` (or None) counts overflow steps at index 0 for a, 1 for b."""
    (ma, k), mb = a.shape, b.shape[0]
    dev = a.device
    sa, sb, margin, most_recent, overflow = delayed if delayed is not None else (None, None, 0, False, None)
    plan = _pair_plan(ma, mb, k, elem, a.dtype, b.dtype, transpose_a, delayed is not None,
                      sa[0].numel() if sa else 1, most_recent, margin, overflow is not None)
    qa = torch.empty((ma, k), dtype=plan.fp8, device=dev)
    qta = torch.empty((k, ma) if transpose_a else (0, 0), dtype=plan.fp8, device=dev)
    qb = torch.empty((mb, k), dtype=plan.fp8, device=dev)
    qtb = torch.empty((k, mb), dtype=plan.fp8, device=dev)
    sia = torch.empty((), dtype=torch.float32, device=dev)
    sib = torch.empty((), dtype=torch.float32, device=dev)
    if delayed is None:
        partial = torch.empty(plan.pa + plan.pb, dtype=torch.float32, device=dev)
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
        sa[0].numel() if sa else 1, partial if overflow is None else overflow, ma, k, mb, k)
    return (qa, sia, qta), (qb, sib, qtb)
