"""Triton kernels: a BF16/FP32 2-D operand (K last) to FP8 storage plus its FP32 `scale_inv`.

One public function per scaling, each in as few passes over the operand as the scaling
allows, with no host synchronisation:

* `cast_rowwise(x, elem)`: ONE kernel, one program per row: the row's amax, its scale
  and the cast (the second read of the row comes from cache).
* `cast_tensorwise(x, elem)`: two kernels: partial maxima (one per program, at most
  1024 programs), then the cast, whose programs each reduce the partial maxima
  themselves and derive the scale on the device.
* `cast_delayed(x, elem, scale)`: ONE kernel: the cast with the given scale (a device
  tensor, from an `AmaxHistory`) and this operand's amax written out in the same pass,
  for the history.

Numerics are those of `lowprec.numerics.quantize.quantize`, bit for bit: amax over finite values;
scale = max / max(amax, 1e-12) and scale_inv = 1 / scale, each divided in FP64 and
rounded once to FP32 (as `quantize._div`); `|x| * scale` clamped to the format's max and
rounded half-to-even to its grid in FP32 arithmetic; NaN stays NaN, Inf stays Inf in
E5M2 and becomes NaN in E4M3 (no saturation of Inf). The kernels do not use Triton's
float8 conversion (under the interpreter it does not round like PyTorch): they compute
the FP8 bit pattern themselves from the exact grid index, so the result is the same
under the interpreter and on any GPU, and they write bytes that are viewed as
`torch.float8_e4m3fn` / `torch.float8_e5m2`.

`stats=True` (a `constexpr` in the kernels: no cost when off) computes, in the same
pass, the statistics of `QuantStats` that are counts or maxima: amax, saturated,
underflow, nonfinite and numel. The sums (`sq_error`, `signal_power`,
`underflow_energy`) are not computed here; `quantize(..., stats=True)` has them.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from lowprec.numerics.formats import E4M3, E5M2, ElementFormat
from lowprec.numerics.grid import overflow_threshold
from lowprec.numerics.quantize import _EPS

__all__ = ["CastStats", "cast_rowwise", "cast_tensorwise", "cast_delayed", "kernels_available"]

_FP32_MAX = tl.constexpr(3.4028234663852886e38)
_MAX_PARTIALS = 1024          # programs of the tensor-wise amax kernel (a power of two)


@dataclass
class CastStats:
    """Statistics of one cast, device tensors (no sync): what `QuantStats` calls amax
    (FP32, over finite values), saturated, underflow and nonfinite (int64 counts), numel."""

    amax: torch.Tensor
    saturated: torch.Tensor
    underflow: torch.Tensor
    nonfinite: torch.Tensor
    numel: int

    FIELDS = ("amax", "saturated", "underflow", "nonfinite", "numel")

    def to_dict(self) -> dict[str, float]:
        """Host values (this syncs)."""
        return {f: float(getattr(self, f)) for f in self.FIELDS}


# ----------------------------------------------------------------------------- device code


@triton.jit
def _load_f32(ptrs, mask, BF16: tl.constexpr):
    """FP32 values of BF16 (a BF16 or an int16 tensor of its bits, read as int16 bits and
    shifted into FP32's top half, exact; the interpreter's own BF16 conversion loses the
    smallest subnormals) or FP16/FP32 input."""
    if BF16:
        bits = tl.load(ptrs, mask=mask, other=0).to(tl.int16, bitcast=True).to(tl.int32) << 16
        return bits.to(tl.float32, bitcast=True)
    return tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _finite_abs(x):
    """|x| as FP32 with 0 where x is NaN or +-Inf, and the finite mask."""
    ax = tl.abs(x)
    fin = ax <= _FP32_MAX
    return tl.where(fin, ax, 0.0), fin


@triton.jit
def _scale_of(amax, MAX: tl.constexpr, EPS: tl.constexpr):
    """(scale, scale_inv) from an amax, as lowprec.numerics.quantize._scales / _div compute them."""
    a = tl.maximum(amax, EPS).to(tl.float64)
    scale = (MAX / a).to(tl.float32)
    scale_inv = (1.0 / scale.to(tl.float64)).to(tl.float32)
    return scale, scale_inv


@triton.jit
def _encode(x, scale, MAX: tl.constexpr, M: tl.constexpr, BIAS: tl.constexpr, HAS_INF: tl.constexpr,
            THR: tl.constexpr, ODD: tl.constexpr):
    """FP8 bytes of x * scale (x FP32), and per element: |x| (0 where not finite), saturated,
    underflowed, non-finite, and |q| (the grid magnitude, for the error sums).

    |v| is clamped to MAX; with E the FP32 biased exponent of |v| (at least that of the
    format's smallest normal), |v| / 2**(E - 127 - M) is exact and below 2**(M + 1);
    rounding it half to even (adding and subtracting 2**23 in FP32) gives the grid index
    n, and the FP8 code is ((E - 128 + BIAS) << M) + n for normals and subnormals alike
    (n = 2**(M+1) carries into the next exponent, as the encoding does).
    """
    ax, fin = _finite_abs(x)
    av = ax * scale
    a = tl.minimum(av, MAX)
    e = (a.to(tl.int32, bitcast=True) >> 23) & 0xFF
    e = tl.maximum(e, 128 - BIAS)                        # subnormals: the fixed step
    inv_step = ((254 - (e - M)) << 23).to(tl.float32, bitcast=True)   # 2**-(E - 127 - M)
    y = a * inv_step
    n = ((y + 8388608.0) - 8388608.0).to(tl.int32)       # round half to even
    code = ((e - 128 + BIAS) << M) + n
    neg = x.to(tl.int32, bitcast=True) < 0
    sign = tl.where(neg, 128, 0)
    if HAS_INF:   # NaN keeps its sign (PyTorch's E5M2 cast), Inf stays Inf (0x7C / 0xFC)
        special = tl.where(x != x, 0x7F, 0x1F << M) | sign
    else:         # E4M3 has no Inf: every non-finite input is the positive NaN 0x7F
        special = tl.full(code.shape, 0x7F, tl.int32)
    code = tl.where(fin, code | sign, special)
    if ODD:
        sat = av >= THR
    else:
        sat = av > THR
    under = (n == 0) & (ax > 0)
    qa = n.to(tl.float32) * (((e - M) << 23).to(tl.float32, bitcast=True))   # |q|, exact
    return code.to(tl.uint8), ax, sat, under, fin == 0, qa


@triton.jit
def _add_stats(stats_ptr, sat, under, nonfin):
    tl.atomic_add(stats_ptr + 0, tl.sum(sat.to(tl.int32), axis=0).to(tl.int64))
    tl.atomic_add(stats_ptr + 1, tl.sum(under.to(tl.int32), axis=0).to(tl.int64))
    tl.atomic_add(stats_ptr + 2, tl.sum(nonfin.to(tl.int32), axis=0).to(tl.int64))


@triton.jit
def _rowwise_kernel(x_ptr, out_ptr, scale_inv_ptr, stats_ptr, amax_ptr, K, stride_x,
                    BLOCK_K: tl.constexpr, MAX: tl.constexpr, M: tl.constexpr, BIAS: tl.constexpr,
                    HAS_INF: tl.constexpr, THR: tl.constexpr, ODD: tl.constexpr, EPS: tl.constexpr,
                    STATS: tl.constexpr, BF16: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    xrow = x_ptr + row * stride_x
    orow = out_ptr + row * K
    cols = tl.arange(0, BLOCK_K)
    amax = tl.zeros((), tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = _load_f32(xrow + k0 + cols, k0 + cols < K, BF16)
        ax, _ = _finite_abs(x)
        amax = tl.maximum(amax, tl.max(ax, axis=0))
    scale, scale_inv = _scale_of(amax, MAX, EPS)
    tl.store(scale_inv_ptr + row, scale_inv)
    for k0 in range(0, K, BLOCK_K):
        m = k0 + cols < K
        x = _load_f32(xrow + k0 + cols, m, BF16)
        q, ax, sat, under, nonfin, _ = _encode(x, scale, MAX, M, BIAS, HAS_INF, THR, ODD)
        tl.store(orow + k0 + cols, q, mask=m)
        if STATS:
            _add_stats(stats_ptr, sat & m, under & m, nonfin & m)
    if STATS:
        tl.atomic_max(amax_ptr, amax)


@triton.jit
def _amax_partial_kernel(x_ptr, partial_ptr, N, BLOCK: tl.constexpr, BF16: tl.constexpr, TICKET: tl.constexpr):
    """One partial maximum per program into partial[pid]; with TICKET, program 0 also zeroes
    partial[programs], the float ticket counter of the cast launched next (cast_transpose's
    statistics: no separate launch clears it)."""
    pid = tl.program_id(0)
    if TICKET:
        if pid == 0:
            tl.store(partial_ptr + tl.num_programs(0), 0.0)
    tl.store(partial_ptr + pid, _amax_part(x_ptr, N, pid, tl.num_programs(0), BLOCK, BF16))


@triton.jit
def _amax_part(x_ptr, N, pid, programs, BLOCK: tl.constexpr, BF16: tl.constexpr):
    """Program `pid` of `programs`' maximum of |x| over its blocks of the flat x (finite values).
    `programs` may be a constant (Triton makes an integer argument of 1 one): widened by way of
    `pid`, a tensor."""
    offs = tl.arange(0, BLOCK)
    amax = tl.zeros((), tl.float32)
    for start in range(pid.to(tl.int64) * BLOCK, N, (pid * 0 + programs).to(tl.int64) * BLOCK):
        ax, _ = _finite_abs(_load_f32(x_ptr + start + offs, start + offs < N, BF16))
        amax = tl.maximum(amax, tl.max(ax, axis=0))
    return amax


@triton.jit
def _cast_kernel(x_ptr, out_ptr, partial_ptr, P, scale_ptr, scale_inv_ptr, stats_ptr, amax_ptr, N,
                 BLOCK: tl.constexpr, BLOCK_P: tl.constexpr, MAX: tl.constexpr, M: tl.constexpr,
                 BIAS: tl.constexpr, HAS_INF: tl.constexpr, THR: tl.constexpr, ODD: tl.constexpr,
                 EPS: tl.constexpr, DELAYED: tl.constexpr, STATS: tl.constexpr,
                 BF16: tl.constexpr):
    """Tensor-wise cast (scale from the P partial maxima) or delayed cast (scale given;
    this operand's amax atomically maxed into amax_ptr, which starts at 0)."""
    pid = tl.program_id(0)
    if DELAYED:
        scale = tl.load(scale_ptr)
        scale_inv = (1.0 / scale.to(tl.float64)).to(tl.float32)
    else:
        po = tl.arange(0, BLOCK_P)
        amax = tl.max(tl.load(partial_ptr + po, mask=po < P, other=0.0), axis=0)
        scale, scale_inv = _scale_of(amax, MAX, EPS)
    if pid == 0:
        tl.store(scale_inv_ptr, scale_inv)
        if not DELAYED:
            tl.store(amax_ptr, amax)
    step = tl.num_programs(0).to(tl.int64) * BLOCK
    offs = tl.arange(0, BLOCK)
    own = tl.zeros((), tl.float32)
    for start in range(pid.to(tl.int64) * BLOCK, N, step):
        m = start + offs < N
        x = _load_f32(x_ptr + start + offs, m, BF16)
        q, ax, sat, under, nonfin, _ = _encode(x, scale, MAX, M, BIAS, HAS_INF, THR, ODD)
        tl.store(out_ptr + start + offs, q, mask=m)
        if DELAYED:
            own = tl.maximum(own, tl.max(ax, axis=0))
        if STATS:
            _add_stats(stats_ptr, sat & m, under & m, nonfin & m)
    if DELAYED:
        tl.atomic_max(amax_ptr, own)


# ----------------------------------------------------------------------------- host code

# Triton decides at decoration time (this module's import) whether a kernel is interpreted.
_INTERPRET = type(_rowwise_kernel).__name__ == "InterpretedFunction"


def kernels_available(x: torch.Tensor) -> bool:
    """Whether the kernels can run on `x`: a CUDA tensor, or any tensor under the interpreter."""
    return x.is_cuda or _INTERPRET


def _element(elem) -> ElementFormat:
    if isinstance(elem, str):
        elem = {"e4m3": E4M3, "e5m2": E5M2}.get(elem, elem)
    if elem not in (E4M3, E5M2):
        raise ValueError(f"the FP8 cast kernels support E4M3 and E5M2, got {elem!r}; "
                         "other formats go through lowprec.numerics.quantize.quantize")
    return elem


def _prepare(x: torch.Tensor, elem, what: str):
    """(element format, x as a contiguous 2-D (rows, K) tensor, the kernels' constants: a copy)."""
    elem, x2 = _checked(x, elem, what)
    return elem, x2, dict(_consts(elem, x2.dtype == torch.bfloat16))


def _checked(x: torch.Tensor, elem, what: str):
    """(element format, x as a contiguous 2-D (rows, K) tensor), or a clear error."""
    elem = _element(elem)
    if x.dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise TypeError(f"{what} expects a BF16, FP16 or FP32 tensor, got {x.dtype}")
    if not kernels_available(x):
        raise RuntimeError(
            f"{what} runs Triton kernels: on a CUDA tensor, or on a {x.device.type} tensor "
            f"only with Triton's interpreter (TRITON_INTERPRET=1 set before triton is first "
            f"imported). For CPU quantization use lowprec.numerics.quantize.quantize.")
    x2 = x if x.dim() == 2 else x.reshape(math.prod(x.shape[:-1]), x.shape[-1] if x.dim() else 1)
    if not x2.is_contiguous():
        x2 = x2.contiguous()
    return elem, x2


@functools.lru_cache(maxsize=None)
def _consts(elem: ElementFormat, bf16: bool) -> dict:
    """The kernels' constexpr arguments of an element format (computed once per format:
    the host time of a cast is mostly such per-call work). Callers get a copy."""
    return dict(MAX=elem.max, M=elem.mantissa_bits, BIAS=1 - elem.min_normal_exp, HAS_INF=elem.has_inf,
                THR=overflow_threshold(elem), ODD=_odd_max(elem), EPS=_EPS, BF16=bf16)


def cdiv(n: int, d: int) -> int:
    """ceil(n / d) for host code (`triton.cdiv` is a constexpr function: slow on the host)."""
    return -(-n // d)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n (>= 1), as `triton.next_power_of_2`, in plain Python."""
    return 1 << max(n - 1, 0).bit_length()


def _bits(x2: torch.Tensor) -> torch.Tensor:
    """What the kernels load: BF16 as its int16 bits (see _load_f32), others as they are."""
    return x2.view(torch.int16) if x2.dtype == torch.bfloat16 else x2


def _odd_max(elem: ElementFormat) -> bool:
    """As lowprec.numerics.grid.saturated_mask: the tie at the threshold saturates when max's mantissa is odd."""
    return round((elem.max / 2.0**elem.max_exp - 1) * 2**elem.mantissa_bits) % 2 == 1


def _outputs(x2: torch.Tensor, elem: ElementFormat, stats: bool):
    out = torch.empty(x2.shape, dtype=torch.uint8, device=x2.device)
    counts = torch.zeros(3 if stats else 1, dtype=torch.int64, device=x2.device)
    amax = torch.zeros((), dtype=torch.float32, device=x2.device)
    return out, counts, amax


def _result(out, scale_inv, elem, counts, amax, numel, stats, extra=()):
    fp8 = out.view(elem.torch_dtype)
    res = (fp8, scale_inv, *extra)
    if stats:
        res += (CastStats(amax, counts[0], counts[1], counts[2], numel),)
    return res


def cast_rowwise(x: torch.Tensor, elem, *, stats: bool = False, block_k: int | None = None):
    """Row-wise FP8 cast in one kernel: `(fp8 (rows, K), scale_inv (rows, 1) FP32[, CastStats])`.

    `x` is viewed as (rows, K), K its last dimension; `elem` is E4M3/E5M2 or its name.
    Equals `quantize(x, QuantSpec(elem, Scaling.ROW))`: `.to_storage()` and `.scale_inv`.
    `block_k` (a power of two) is how many columns a program handles at a time.
    """
    elem, x2, c = _prepare(x, elem, "cast_rowwise")
    rows, k = x2.shape
    out, counts, amax = _outputs(x2, elem, stats)
    scale_inv = torch.empty((rows, 1), dtype=torch.float32, device=x2.device)
    bk = block_k or min(next_power_of_2(max(k, 16)), 4096)
    if rows:
        _rowwise_kernel[(rows,)](_bits(x2), out, scale_inv, counts, amax, k, k,
                                 BLOCK_K=bk, STATS=stats, num_warps=8 if bk >= 2048 else 4, **c)
    return _result(out, scale_inv, elem, counts, amax, x2.numel(), stats)


def _flat_grid(n: int, block: int) -> int:
    return max(1, min(cdiv(n, block), _MAX_PARTIALS))


def cast_tensorwise(x: torch.Tensor, elem, *, stats: bool = False, block: int | None = None):
    """Tensor-wise (current scaling) FP8 cast: `(fp8 (rows, K), scale_inv () FP32[, CastStats])`.

    Two kernels (partial maxima, then the cast, which derives the scale on the device).
    Equals `quantize(x, QuantSpec(elem, Scaling.TENSOR))`: `.to_storage()`, `.scale_inv`.
    """
    elem, x2, c = _prepare(x, elem, "cast_tensorwise")
    n = x2.numel()
    bl = block or 2048
    out, counts, amax = _outputs(x2, elem, stats)
    p = _flat_grid(n, bl)
    partial = torch.empty(p, dtype=torch.float32, device=x2.device)
    scale_inv = torch.empty((), dtype=torch.float32, device=x2.device)
    _amax_partial_kernel[(p,)](_bits(x2), partial, n, BLOCK=bl, BF16=c["BF16"], TICKET=False,
                                     num_warps=8)
    _cast_kernel[(p,)](_bits(x2), out, partial, p, partial, scale_inv, counts, amax, n, BLOCK=bl,
                       BLOCK_P=next_power_of_2(p), DELAYED=False, STATS=stats, num_warps=8, **c)
    return _result(out, scale_inv, elem, counts, amax, n, stats)


def cast_delayed(x: torch.Tensor, elem, scale: torch.Tensor, *, stats: bool = False,
                 block: int | None = None):
    """Delayed-scaling FP8 cast in one kernel: `(fp8, scale_inv () FP32, amax () FP32[, CastStats])`.

    `scale` is a one-element FP32 device tensor (e.g. `AmaxHistory.scale()`); it is not
    validated here (that would sync): it must be finite and positive. `amax` is this
    operand's amax over finite values, for `AmaxHistory.record`. Equals
    `quantize(x, QuantSpec(elem, Scaling.DELAYED), scale=scale)`.
    """
    elem, x2, c = _prepare(x, elem, "cast_delayed")
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor(float(scale), dtype=torch.float32)
    scale = scale.to(device=x2.device, dtype=torch.float32).reshape(1)
    n = x2.numel()
    bl = block or 2048
    out, counts, amax = _outputs(x2, elem, stats)
    scale_inv = torch.empty((), dtype=torch.float32, device=x2.device)
    p = _flat_grid(n, bl)
    _cast_kernel[(p,)](_bits(x2), out, scale, 1, scale, scale_inv, counts, amax, n, BLOCK=bl, BLOCK_P=1,
                       DELAYED=True, STATS=stats, num_warps=8, **c)
    return _result(out, scale_inv, elem, counts, amax, n, stats, extra=(amax,))
