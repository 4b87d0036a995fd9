"""Quantize tensors to the formats of `lowprec.numerics.formats`, with statistics, on any device.

Every granularity goes through one code path. The operand is viewed as 2-D
`(rows, K)` (K, the last dimension, is the GEMM's reduction dimension) and then as
blocks `(rows/r, r, K/c, c)`: a tensor-wise scale is one block covering everything, a
row-wise scale is blocks of `(1, K)`, Float8BlockScaling is `(1, 128)` / `(128, 128)`,
MX is `(1, 32)` with E8M0 scales, NVFP4 is `(1, 16)` / `(16, 16)` with E4M3 scales under
an FP32 tensor scale. Per block: amax over finite values, a scale, `x * scale`
saturated to the format's max and rounded to its grid (nearest-even, or stochastic
with a seeded generator), and the dequantized value `q / scale`.

Rounding to a grid is done in FP32 arithmetic on any device, bit for bit a hardware
cast (`lowprec.numerics.grid`).

Non-finite inputs: scales are computed from finite values only, so one NaN never
turns a scale into NaN. NaN stays NaN. +-Inf stays +-Inf in E5M2 (which encodes
Inf) and becomes NaN in E4M3 and E2M1 (which do not). PyTorch's own E4M3 cast
saturates Inf to 448; we do not, because a saturated Inf hides a fault that the
monitors must see. Every non-finite input is counted in the statistics.

Statistics (`lowprec.numerics.quant_stats.QuantStats`) are tensors on the input's device, packed in one vector,
computed in the same pass and never read on the host here: amax, saturated count
(scaled values beyond what round-to-nearest would still have mapped to max),
underflow count (non-zero inputs that became zero), squared error, signal power,
non-finite count, element count, underflow energy (the sum of x**2 over the inputs
that were flushed to zero: divided by the signal power, the share of the operand's
energy lost to underflow, which measures harm where the count does not).

`fused=True` runs the same function through `torch.compile`, which fuses the passes
into one or two loops (see docs/performance.md); `fused=False` is plain eager PyTorch.
Only tensor-wise and delayed scaling are fused; row and block scalings always run the
eager path (their symbolic block shapes do not compile on CUDA yet).
"""

from __future__ import annotations

import functools
import math
import types
from dataclasses import dataclass

import torch

from lowprec.numerics.block_scales import _EPS, _div, below_fp32_max, block_scales  # noqa: F401 (kernels: _EPS, _div)
from lowprec.numerics.formats import Format, QuantSpec, Rounding, ScaleEncoding, Scaling
from lowprec.numerics.grid import round_magnitude, round_to_grid, saturated_mask
from lowprec.numerics.hadamard import RandomHadamard
from lowprec.numerics.quant_stats import QuantStats, sqnr_db

__all__ = ["QuantStats", "sqnr_db", "Quantized", "quantize", "fake_quantize", "round_to_grid",
           "operand_blocks", "check_fits", "check_layer_fits"]

# Scalings whose fused kernel compiles with dynamic shapes on CPU and CUDA alike. Row and
# block scalings take the eager path even with fused=True: with a symbolic block width,
# Inductor's CUDA codegen fails (CantSplit) on torch 2.11, see docs/performance.md.
_FUSABLE = (Scaling.TENSOR, Scaling.DELAYED)


@dataclass
class Quantized:
    """A quantized operand: `values` on the element grid in the scaled domain.

    `values` has the shape of the 2-D operand view (float32, exact grid points),
    `scale` / `scale_inv` have one entry per block, shaped `(rows/r, 1, K/c, 1)`: `values` are
    x * scale on the grid (NVFP4 on a tensor of amax below ~7.9e-36: x * 2**64 * scale, whose
    scale would overflow FP32 otherwise; `lowprec.numerics.block_scales.nvfp4_up`).
    `amax` is the operand's amax over finite values (what a delayed-scaling history
    records). `dequantize()` returns the operand's shape (in the Hadamard domain when the spec
    applies the transform: both GEMM operands are transformed, so it cancels).
    """

    values: torch.Tensor
    scale: torch.Tensor
    scale_inv: torch.Tensor
    spec: QuantSpec
    shape: torch.Size
    amax: torch.Tensor
    stats: QuantStats | None = None
    # the FP8 storage form when a caller keeps it (lowprec.sites.weight_cache), and its transpose
    storage: torch.Tensor | None = None
    storage_t: torch.Tensor | None = None

    def dequantize(self) -> torch.Tensor:
        r, c = _block_of(self.spec, self.values.shape)
        vb = _as_blocks(self.values, (r, c))
        out = _dequant_blocks(vb, self.scale, self.scale_inv, self.spec)
        return out.reshape(self.shape)

    def transposed(self) -> "Quantized":
        """The transpose of a 2-D quantization, as views: its values and its block scales turned
        round (no statistics, no storage form)."""
        return Quantized(self.values.t(), self.scale.permute(2, 1, 0, 3), self.scale_inv.permute(2, 1, 0, 3),
                         self.spec, torch.Size((self.shape[1], self.shape[0])), self.amax)

    def to_storage(self) -> torch.Tensor:
        """The values as PyTorch's float8 dtype (E4M3/E5M2 only), for torch._scaled_mm."""
        if self.storage is not None:
            return self.storage
        dt = self.spec.element.torch_dtype
        if dt is None:
            raise TypeError(f"{self.spec.element.name} has no PyTorch storage dtype; use .values")
        return self.values.to(dt)


def operand_blocks(spec: QuantSpec, shape: torch.Size | tuple[int, ...]) -> tuple[int, int]:
    """The (rows, cols) block of `spec` for an operand of `shape` (2-D view)."""
    rows, k = _view2d_shape(shape)
    return _block_of(spec, (rows, k))


def check_fits(spec: QuantSpec, shape: torch.Size | tuple[int, ...], what: str = "tensor") -> None:
    """Raise ValueError if an operand of `shape` cannot be cut into `spec`'s blocks."""
    rows, k = _view2d_shape(shape)
    r, c = _block_of(spec, (rows, k))
    bad = []
    if k % c:
        bad.append(f"its last (reduction) dimension {k} is not a multiple of {c}")
    if rows % r:
        bad.append(f"its {rows} rows (all leading dimensions together) are not a multiple of {r}")
    if spec.hadamard and k % 16:
        bad.append(f"the Hadamard transform needs the last dimension ({k}) to be a multiple of 16")
    if bad:
        raise ValueError(
            f"{what} of shape {tuple(shape)} does not fit {spec.element.name} blocks of "
            f"{r}x{c}: {'; '.join(bad)}. Pad that dimension, keep this layer in a format "
            f"with smaller blocks (e.g. fp8_tensorwise or fp8_rowwise), or in bf16.")


def check_layer_fits(fmt: Format, out_features: int, in_features: int, name: str) -> None:
    """Raise ValueError if the linear layer `name` (weight out x in) cannot run `fmt`: the
    weight must fit the weight blocks; inputs reduce over `in`, output gradients over `out`.
    The *_wgrad operands reduce over tokens, unknown until training. The one check of a
    layer's shape, at plan time (`lowprec.sites.resolution.resolve`) and at runtime (`set_format`)."""
    out, inp = out_features, in_features
    for role, rows, k, what in (("weight", out, inp, "weight (out x in)"), ("input", 0, inp, "input (tokens x in)"),
                                ("grad_output", 0, out, "grad_output (tokens x out)")):
        if (spec := fmt.specs().get(role)) is None:
            continue
        try:  # activations: one row of blocks stands for the tokens (block is (1, 1) unless Scaling.BLOCK)
            check_fits(spec, (rows or spec.block[0], k), what)
        except ValueError as e:
            raise ValueError(f"layer {name!r} (weight {out} x {inp}, out x in) cannot run {fmt.name}: "
                             f"its {e}") from None


def quantize(x: torch.Tensor, spec: QuantSpec, *, amax: torch.Tensor | float | None = None,
             scale: torch.Tensor | float | None = None, generator: torch.Generator | None = None,
             hadamard: RandomHadamard | None = None, stats: bool = False, fused: bool = False,
             validate: bool = True) -> Quantized:
    """Quantize `x` (any float dtype, any device) as `spec` says.

    amax: use this instead of the tensor's own (e.g. reduced over a shard group);
        for NVFP4 it is the tensor amax behind the FP32 tensor scale.
    scale: the scale for Scaling.DELAYED (from an `AmaxHistory`); required there.
    generator: random source for stochastic rounding (seeded, on x's device).
    hadamard: the transform to apply when spec.hadamard (default: seed 0).
    stats: attach QuantStats (device tensors, no sync).
    validate: check a user-given amax/scale is finite and positive (syncs if on GPU).
    """
    if not x.is_floating_point():
        raise TypeError(f"quantize expects a floating-point tensor, got {x.dtype}")
    check_fits(spec, x.shape)
    x2 = x.reshape(_view2d_shape(x.shape)).float()
    if spec.hadamard:
        x2 = (hadamard or RandomHadamard(0)).apply(x2)
    amax_t = _given(amax, "amax", x2.device, validate, allow_zero=True)
    scale_t = _given(scale, "scale", x2.device, validate, allow_zero=False)
    if spec.scaling is Scaling.DELAYED and scale_t is None:
        raise ValueError("Scaling.DELAYED needs scale= (from an AmaxHistory); "
                         "for a scale from the tensor itself use Scaling.TENSOR")
    noise = None
    if spec.rounding is Rounding.STOCHASTIC:
        noise = torch.rand(x2.shape, generator=generator, device=x2.device, dtype=torch.float32)
    block = _block_of(spec, x2.shape)
    fn = _core
    if fused and spec.scaling in _FUSABLE:
        # the compiled core's statistics write through `out=` temporaries shaped like x2,
        # which Dynamo refuses when they are not contiguous (a transposed view: weight^T)
        fn, x2 = _compiled_core(spec), x2.contiguous()
    values, sc, sc_inv, amax_out, packed = fn(x2, spec, block, amax_t, scale_t, noise, stats)
    return Quantized(values, sc, sc_inv, spec, x.shape, amax_out,
                     QuantStats(packed) if stats else None)


def fake_quantize(x: torch.Tensor, spec: QuantSpec, *, stats: bool = False, **kw):
    """quantize() then dequantize(), back in x's shape, dtype and (Hadamard-inverted) domain.

    Returns the tensor, or (tensor, QuantStats) when stats=True.
    """
    hadamard = kw.get("hadamard") or (RandomHadamard(0) if spec.hadamard else None)
    kw["hadamard"] = hadamard
    q = quantize(x, spec, stats=stats, **kw)
    out = q.dequantize()
    if spec.hadamard:
        out = hadamard.invert(out.reshape(_view2d_shape(x.shape))).reshape(x.shape)
    out = out.to(x.dtype)
    return (out, q.stats) if stats else out


# ----------------------------------------------------------------------------- internals


def _view2d_shape(shape) -> tuple[int, int]:
    shape = tuple(shape)
    if len(shape) == 0:
        return (1, 1)
    k = shape[-1]
    return (math.prod(shape[:-1]) if len(shape) > 1 else 1, k)


def _block_of(spec: QuantSpec, shape2d) -> tuple[int, int]:
    rows, k = shape2d
    if spec.scaling in (Scaling.TENSOR, Scaling.DELAYED):
        return (max(rows, 1), max(k, 1))
    if spec.scaling is Scaling.ROW:
        return (1, max(k, 1))
    return spec.block


def _as_blocks(x2: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    rows, k = x2.shape
    r, c = block
    return x2.reshape(rows // r, r, k // c, c)


def _given(v, what: str, device, validate: bool, allow_zero: bool) -> torch.Tensor | None:
    if v is None:
        return None
    t = torch.as_tensor(v, dtype=torch.float32, device=device)
    if validate:
        bad = ~torch.isfinite(t) | (t < 0 if allow_zero else t <= 0)
        if bool(bad.any()):
            raise ValueError(
                f"{what} must be finite and {'>= 0' if allow_zero else '> 0'}, got "
                f"{t.flatten()[:4].tolist()}: a non-finite {what} would make every quantized "
                f"value NaN. Compute amax over finite values (quantize does this itself when "
                f"amax is not given) or reset the amax history.")
    return t


def _finite_amax(xb: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(finite mask, |x| with 0 where not finite, block amaxes), in three passes
    (`torch.isfinite` alone takes four on CPU: x == x, abs, != inf, and)."""
    a = xb.abs()
    fin = a < float("inf")               # False for NaN and +-Inf
    ax = a.nan_to_num_(0.0, 0.0, 0.0)
    return fin, ax, ax.amax(dim=(1, 3), keepdim=True)


def _dequant_blocks(vb, scale, scale_inv, spec: QuantSpec):
    if spec.scale_encoding is ScaleEncoding.E4M3_FP32:
        return vb * scale_inv        # blocks whose E4M3 scale underflowed have scale 0
    return vb / scale


def _core(x2: torch.Tensor, spec: QuantSpec, block, amax_t, scale_t, noise, want_stats: bool):
    xb = _as_blocks(x2, block)
    fin, ax, bamax = _finite_amax(xb)
    values, scale, scale_inv, av, qa = _scale_round(xb, fin, ax, bamax, spec, amax_t, scale_t, noise, block)
    amax = bamax.amax()                              # the max of the block maxima
    if not want_stats:
        return values, scale, scale_inv, amax, None
    return values, scale, scale_inv, amax, _stats(xb, fin, ax, av, qa, scale, scale_inv, amax, spec)


def _scale_round(xb, fin, ax, bamax, spec: QuantSpec, amax_t, scale_t, noise, block):
    """(values as the 2-D view, scale, scale_inv, |x * scale|, |q|) of blocks `xb`."""
    elem = spec.element
    scale, scale_inv, up = block_scales(spec, bamax, ax, amax_t, scale_t)
    # |x * scale| where x is finite (scales are >= 0, and |a*b| = |a|*|b| in IEEE
    # arithmetic); the sign comes from x; non-finite positions are overwritten below
    av = ax * scale if up is None else (ax * up) * scale
    if spec.scale_encoding is ScaleEncoding.E8M0:
        av = below_fp32_max(av, scale, elem)
    nb = None if noise is None else _as_blocks(noise, block)
    qa = round_magnitude(av, elem, nb)              # |q|, 0 where x is not finite
    q = torch.copysign(qa, xb)
    if elem.has_inf:
        q = torch.where(fin, q, xb)                  # NaN stays NaN, Inf stays Inf
    else:
        q = torch.where(fin, q, float("nan"))        # no Inf encoding: NaN
    return q.reshape(xb.shape[0] * xb.shape[1], xb.shape[2] * xb.shape[3]), scale, scale_inv, av, qa


def _stats(xb, fin, ax, av, qa, scale, scale_inv, amax, spec: QuantSpec, spans=None) -> torch.Tensor:
    """The packed QuantStats, from magnitudes: ax = |x|, av = |x * scale|, qa = |q|, all 0
    where x is not finite (so nothing here needs the finite mask but the non-finite count).
    Overwrites ax, av and qa, which the caller no longer needs. `spans`: (start, stop) ranges of
    block rows, each an operand of its own (`lowprec.numerics.segments`), `amax` then one per
    span broadcast over its block rows: one packed vector per span, (spans, 8); None: one
    operand, (8,).

    On a check step the statistics cost about as much as the quantization itself, so they
    take float passes in place on those three buffers (on CPU a new large tensor, a
    boolean mask or a `where` costs several passes):

    * q has x's sign, so |x - dq| = | |x| - |dq| |;
    * sign(qa) is 1 where q != 0 and 0 where q == 0, and q != 0 implies x != 0, so
      (sign(qa) - 1) * |x| is -|x| exactly where a non-zero x was flushed to zero;
    * sums of squares of magnitudes divided by e = 2**floor(log2 amax) (exact): they are
      below 2, so their FP32 squares do not overflow, and what flushes in a square is
      below 2**-150 of amax**2, a share of the signal power no statistic can show; the
      sums are scaled back in FP64 (an FP32 square of |x| itself overflows above ~1.8e19
      and flushes below ~1e-23). The counts come from the unscaled values.
    """
    def per(fn, t):   # one reduction per operand: each span is the operand's own contiguous memory
        return fn(t) if spans is None else torch.stack([fn(t[a:b]) for a, b in spans])

    n = xb.numel() if spans is None else torch.tensor([(b - a) * xb[0].numel() for a, b in spans], device=xb.device)
    saturated = per(torch.count_nonzero, saturated_mask(av, spec.element))   # av is 0 where x is not finite
    nonfinite = n - per(torch.count_nonzero, fin)
    e = (amax.clamp(min=2.0 ** -126).view(torch.int32) & 0x7F800000).view(torch.float32)  # 2**floor(log2 amax)
    eb = e if spans is None else e.repeat_interleave(
        torch.tensor([b - a for a, b in spans], device=e.device)).reshape(-1, 1, 1, 1)
    flushed = torch.sign(qa, out=av).sub_(1.0).mul_(ax)           # -|x| where flushed, else 0
    err = _dequant_blocks_(qa, scale, scale_inv, spec).sub_(ax).div_(eb)   # (|dq| - |x|) / e
    sq_error = per(_sum_squares, err)
    underflow = per(torch.sum, torch.sign(flushed, out=err)).neg()   # -1s and 0s: exact below 2**24 values
    power = per(_sum_squares, ax.div_(eb))                          # |x| / e is in [0, 2)
    energy = per(_sum_squares, flushed.div_(eb))
    sq_error, power, energy = torch.stack([sq_error, power, energy]) * e.double().square()
    saturated, nonfinite = torch.stack([saturated, nonfinite]).double()
    numel = (torch.full((), float(n), dtype=torch.float64, device=xb.device) if spans is None
             else n.double())
    out = torch.stack([amax.double(), saturated, underflow.double(), sq_error, power, nonfinite, numel, energy])
    return out if spans is None else out.t()


def _sum_squares(t: torch.Tensor) -> torch.Tensor:
    """sum(t**2) as FP64; overwrites t. Eager: squared in place and summed in FP32 by
    `sum`'s cascade summation, accurate to a few FP32 ulps (an FP64 sum first copies the
    tensor to FP64; the FP32 `vector_norm` adds small terms to large ones in one running
    sum per lane and loses them: 2e-5 of a sum of 7 large and 65,000 small squares).
    Compiled: accumulated in FP64, which the fused loop does in registers at no cost."""
    if torch.compiler.is_compiling():
        return torch.linalg.vector_norm(t, dtype=torch.float64).square()
    return t.square_().sum().double()


def _dequant_blocks_(vb, scale, scale_inv, spec: QuantSpec):
    """_dequant_blocks in place on vb."""
    if spec.scale_encoding is ScaleEncoding.E4M3_FP32:
        return vb.mul_(scale_inv)
    return vb.div_(scale)


@functools.lru_cache(maxsize=None)
def _compiled_core(spec: QuantSpec):
    """`_core` through torch.compile, one compiled graph per spec (memoised)."""
    # dynamic=None: the first shape compiles static (fastest loops); a second shape of the
    # same spec recompiles once with symbolic sizes, which then serves every shape. Dynamo
    # keeps its cache (and its recompile limit) per code object, so each spec gets a copy
    # of `_core`'s code: specs do not evict each other or exhaust one shared limit.
    code = _core.__code__.replace(co_name=f"_core_{spec.element.name}_{spec.scaling.value}")
    fn = types.FunctionType(code, _core.__globals__, code.co_name, _core.__defaults__)
    compiled = torch.compile(fn, dynamic=None, fullgraph=True)

    def run(*args):
        try:
            return compiled(*args)
        except Exception as e:  # compilation needs a C++ compiler on CPU, Triton on GPU
            raise RuntimeError(
                f"fused quantization of {spec.element.name}/{spec.scaling.value} could not be "
                f"compiled by torch.compile ({type(e).__name__}: {e}). Use fused=False (eager), "
                f"or install a C++ compiler (CPU) / Triton (GPU).") from e
    return run
