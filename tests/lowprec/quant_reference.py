"""A slow, readable reference for lowprec's scaled formats, written from the specifications.

Nothing here calls lowprec. Everything is scalar Python on lists of floats:

* Element formats are defined by their bit layout (OCP 8-bit Floating Point Specification
  (OFP8) v1.0 for E4M3/E5M2, OCP Microscaling Formats (MX) v1.0 section 5.3.3 for E2M1),
  and their values are enumerated code by code.
* Rounding is round-to-nearest, ties to the code with an even mantissa, saturating at
  the largest finite value, done by locating the value between two neighbouring grid
  points and comparing it with their midpoint (an exact comparison in double: grid
  points have at most 4 significant bits).
* FP32 arithmetic is emulated as "compute in double, round once to FP32" (`f32`). For
  one +, -, * or / of FP32 operands this is exactly the FP32 result, because double has
  53 >= 2*24 + 2 bits and double rounding is then innocuous (S. Figueroa, "When is
  double rounding innocuous?", SIGNUM Newsletter 30(3), 1995).

Recipes:

* MX (OCP MX v1.0, section 6.3): blocks of 32 along the last dimension, one shared
  E8M0 scale X = 2**(floor(log2(amax)) - emax_elem) ("floor"), elements V/X rounded to
  the element format with saturation. "ceil" is the variant lowprec uses by default:
  the smallest power of two X with amax / X <= elem_max, so the block maximum never
  saturates (arXiv 2506.08027 rounds the scale up for the same reason).
  X is clamped to E8M0's range [2**-127, 2**127]; an all-zero block gets 2**-127.
* NVFP4 (NVIDIA, arXiv 2509.25149): s_enc = 6 * 448 / amax_tensor (FP32; 1 for an
  all-zero tensor and at most FLT_MAX, as Transformer Engine's kernels do);
  per block s_dec_b = amax_b / 6, stored as sb = E4M3(s_dec_b * s_enc); elements
  E2M1(x * min(s_enc / sb, FLT_MAX)); dequantized x_q * sb / s_enc. A block whose E4M3 scale
  underflows to 0 is all zeros.
* FP32-scaled (tensorwise, rowwise, Float8BlockScaling): s = elem_max / max(amax, eps)
  with eps = 1e-12 (torchao's choice), optionally rounded down to a power of two
  ("pow2", Transformer Engine's Float8BlockScaling default); elements E(x * s);
  dequantized x_q / s.

Inputs to the reference are finite (the OCP spec makes a whole block NaN when it holds
a NaN or Inf; lowprec deliberately differs there and that policy is tested elsewhere).
"""

from __future__ import annotations

import bisect
import math
import struct
from dataclasses import dataclass

FLT_MAX = struct.unpack("<f", b"\xff\xff\x7f\x7f")[0]
AMAX_EPS = struct.unpack("<f", struct.pack("<f", 1e-12))[0]


def f32(x: float) -> float:
    """Round a double to the nearest FP32 value (ties to even); overflow gives +-inf."""
    if not math.isfinite(x):
        return x
    try:
        return struct.unpack("<f", struct.pack("<f", x))[0]
    except OverflowError:
        return math.copysign(math.inf, x)


def floor_log2(a: float) -> int:
    """floor(log2(a)) for a finite a > 0, exactly (frexp: a = m * 2**e, 0.5 <= m < 1)."""
    _, e = math.frexp(a)
    return e - 1


@dataclass(frozen=True)
class Elem:
    """A small float format given by its bit layout."""

    name: str
    exp_bits: int
    man_bits: int
    bias: int
    nan_codes: str  # "top_mantissa_all_ones" (E4M3 fn), "top_exponent" (E5M2, IEEE-like), "none"

    def _is_special(self, e: int, m: int) -> bool:
        top = 2**self.exp_bits - 1
        if self.nan_codes == "top_exponent":
            return e == top
        if self.nan_codes == "top_mantissa_all_ones":
            return e == top and m == 2**self.man_bits - 1
        return False

    def codes(self) -> list[tuple[float, int]]:
        """(value, mantissa bits) of every non-negative finite code, ascending."""
        out = []
        for e in range(2**self.exp_bits):
            for m in range(2**self.man_bits):
                if self._is_special(e, m):
                    continue
                if e == 0:  # subnormal: 0.m * 2**(1 - bias)
                    v = math.ldexp(m / 2**self.man_bits, 1 - self.bias)
                else:       # normal: 1.m * 2**(e - bias)
                    v = math.ldexp(1 + m / 2**self.man_bits, e - self.bias)
                out.append((v, m))
        out.sort()
        return out

    @property
    def values(self) -> list[float]:
        return [v for v, _ in self.codes()]

    @property
    def max(self) -> float:
        return self.values[-1]

    @property
    def emax(self) -> int:
        """OCP MX emax_elem: the exponent of the largest normal number."""
        return floor_log2(self.max)


E4M3 = Elem("e4m3", 4, 3, 7, "top_mantissa_all_ones")
E5M2 = Elem("e5m2", 5, 2, 15, "top_exponent")
E2M1 = Elem("e2m1", 2, 1, 1, "none")

_GRIDS: dict[str, tuple[list[float], list[int]]] = {}


def _grid(elem: Elem) -> tuple[list[float], list[int]]:
    """(values, mantissa bits) of `elem`, ascending (cached: enumerating is slow)."""
    if elem.name not in _GRIDS:
        codes = elem.codes()
        _GRIDS[elem.name] = ([v for v, _ in codes], [m for _, m in codes])
    return _GRIDS[elem.name]


def neighbours(a: float, elem: Elem) -> tuple[float, float]:
    """The grid points lo <= a < hi around a non-negative a below elem.max."""
    vals, _ = _grid(elem)
    i = bisect.bisect_right(vals, a) - 1
    return vals[i], vals[i + 1]


def round_rne(x: float, elem: Elem) -> float:
    """x rounded to `elem`: nearest, ties to even mantissa, saturating at +-max; NaN stays NaN."""
    if math.isnan(x):
        return x
    vals, mant = _grid(elem)
    a = abs(x)
    if a >= vals[-1]:
        r = vals[-1]
    else:
        i = bisect.bisect_right(vals, a) - 1
        lo, hi = vals[i], vals[i + 1]
        mid = (lo + hi) / 2          # exact: lo and hi have few significant bits
        if a < mid:
            r = lo
        elif a > mid:
            r = hi
        else:
            r = lo if mant[i] % 2 == 0 else hi
    return math.copysign(r, x)


def rounds_beyond_max(x: float, elem: Elem) -> bool:
    """Would round-to-nearest-even with an unbounded exponent range give more than max?

    The next point above max is max + step (step of max's binade) and has the opposite
    mantissa parity, so the tie max + step/2 goes beyond max exactly when max's mantissa
    is odd (E5M2 57344 = 1.11b * 2**15, E2M1 6 = 1.1b * 2**2), not when it is even
    (E4M3 448 = 1.110b * 2**8: 480 would be the NaN code).
    """
    a = abs(x)
    mx = elem.max
    step = math.ldexp(1.0, floor_log2(mx) - elem.man_bits)
    tie = mx + step / 2
    max_is_odd = _grid(elem)[1][-1] % 2 == 1
    return a > tie or (a == tie and max_is_odd)


# ------------------------------------------------------------------------- block recipes


@dataclass
class RefQuantized:
    """Per-element values (scaled domain) and dequantized output as 2-D lists; per-block
    encode scale (values = round(x * scale)) and decode scale (what lowprec calls
    scale_inv) as 2-D lists indexed [block_row][block_col]."""

    values: list[list[float]]
    dequant: list[list[float]]
    scale: list[list[float]]
    scale_inv: list[list[float]]


def _blocks(x: list[list[float]], block: tuple[int, int]):
    rows, cols = len(x), len(x[0])
    r, c = block
    assert rows % r == 0 and cols % c == 0, (rows, cols, block)
    for bi in range(rows // r):
        for bj in range(cols // c):
            idx = [(bi * r + i, bj * c + j) for i in range(r) for j in range(c)]
            yield bi, bj, idx


def _empty(rows: int, cols: int) -> list[list[float]]:
    return [[0.0] * cols for _ in range(rows)]


def _run(x, block, block_scales, elem) -> RefQuantized:
    """Shared driver. block_scales(amax_b) -> (encode scale, decode scale, dequant(q))."""
    rows, cols = len(x), len(x[0])
    r, c = block
    values, deq = _empty(rows, cols), _empty(rows, cols)
    scale, scale_inv = _empty(rows // r, cols // c), _empty(rows // r, cols // c)
    for bi, bj, idx in _blocks(x, block):
        amax_b = max(abs(x[i][j]) for i, j in idx)
        enc, dec, dequant = block_scales(amax_b)
        scale[bi][bj], scale_inv[bi][bj] = enc, dec
        for i, j in idx:
            q = round_rne(f32(x[i][j] * enc), elem)
            values[i][j] = q
            deq[i][j] = dequant(q)
    return RefQuantized(values, deq, scale, scale_inv)


def mx(x: list[list[float]], elem: Elem, mode: str = "ceil", block: int = 32) -> RefQuantized:
    """OCP MX: one E8M0 scale per 1 x `block` elements along the last dimension."""

    def scales(amax_b: float):
        if amax_b == 0.0:
            shared = -127                    # log2(0) = -inf, clamped to E8M0's smallest value
        else:
            shared = floor_log2(amax_b) - elem.emax
            if mode == "ceil" and amax_b > elem.max * math.ldexp(1.0, shared):
                shared += 1                  # smallest 2**k with amax_b / 2**k <= elem.max
        shared = min(max(shared, -127), 127)
        x_scale = math.ldexp(1.0, shared)
        # x * (1/X) is rounded to FP32 as lowprec's product is; it is exact unless it
        # lands among FP32 subnormals, far below any element's smallest step. q * X is exact.
        return 1.0 / x_scale, x_scale, lambda q: q * x_scale

    return _run(x, (1, block), scales, elem)


def nvfp4(x: list[list[float]], block: tuple[int, int] = (1, 16),
          tensor_amax: float | None = None) -> RefQuantized:
    """NVFP4 (arXiv 2509.25149): E2M1 elements, E4M3 block scales, one FP32 tensor scale.
    A tensor amax below 2688 / FLT_MAX (where 2688 / amax overflows FP32) is taken 2**64
    times larger first (exact), and 2**-64 goes into the decode scale."""
    if tensor_amax is None:
        tensor_amax = max(abs(v) for row in x for v in row)
    up = 2.0 ** 64 if 0 < tensor_amax < 6.0 * 448.0 / FLT_MAX else 1.0
    tensor_amax, x = tensor_amax * up, [[v * up for v in row] for row in x]
    s_enc = min(f32(6.0 * 448.0 / tensor_amax), FLT_MAX) if tensor_amax > 0 else 1.0

    def scales(amax_b: float):
        s_dec_b = f32(amax_b / 6.0)
        sb = round_rne(f32(s_dec_b * s_enc), E4M3)        # the stored E4M3 block scale
        # an underflowed block is all zeros; the encode scale is at most FLT_MAX (Transformer
        # Engine's compute_block_encode_sf clamps it)
        enc = min(f32(s_enc / sb), FLT_MAX) if sb > 0 else 0.0
        dec = f32(f32(sb / s_enc) / up)
        # x_q * sb is exact (2 and 4 significant bits), so the dequantized value is
        # rounded once: f32(x_q * sb / s_enc / up).
        return enc, dec, lambda q: f32(q * sb / s_enc / up)

    return _run(x, block, scales, E2M1)


def fp32_scaled(x: list[list[float]], elem: Elem, block: tuple[int, int],
                pow2: bool = False) -> RefQuantized:
    """FP32 scales s = max / max(amax, eps) per block (tensorwise: block = whole tensor,
    rowwise: (1, cols)), rounded down to a power of two when `pow2`."""

    def scales(amax_b: float):
        s = f32(elem.max / max(amax_b, AMAX_EPS))
        if pow2:
            s = math.ldexp(1.0, floor_log2(s))
        return s, f32(1.0 / s), lambda q: f32(q / s)

    return _run(x, block, scales, elem)
