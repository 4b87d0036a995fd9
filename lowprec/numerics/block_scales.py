"""The scales of one quantization, per block: what `lowprec.numerics.quantize` multiplies by.

`block_scales` gives (scale, scale_inv, up) for every scaling and scale encoding: a delayed
scale as given, FP32 scales max / amax correctly rounded (`_div`: an FP64 quotient rounded
once; also the delayed-scaling history's, `lowprec.numerics.delayed`), power-of-two ones,
OCP MX E8M0 exponents (floor or ceil), and NVFP4's FP32 tensor scale over E4M3 block scales
(`_nvfp4_scales`, with `up` for tensors too small for its FP32 tensor scale).
`below_fp32_max` keeps an MX block of amax near FP32 max from dequantizing to Inf.
"""

from __future__ import annotations

import torch

from lowprec.numerics.formats import E4M3, QuantSpec, ScaleEncoding, Scaling
from lowprec.numerics.grid import round_to_grid

__all__ = ["block_scales", "below_fp32_max", "nvfp4_up"]

_EPS = 1e-12                       # amax floor for FP32 scales (torchao's choice)
_NVFP4_TENSOR_RANGE = 6.0 * 448.0  # E2M1 max times E4M3 max
_FP32_MAX = torch.finfo(torch.float32).max
_NVFP4_TINY = _NVFP4_TENSOR_RANGE / _FP32_MAX   # a tensor amax below it: 2688 / amax overflows FP32
_NVFP4_UP = 2.0 ** 64


def block_scales(spec: QuantSpec, bamax: torch.Tensor, ax: torch.Tensor, amax_t, scale_t):
    """(scale, scale_inv, up) per block; x * scale is on the element grid's range (x * up *
    scale where `up` is not None: see _nvfp4_scales)."""
    elem = spec.element
    enc = spec.scale_encoding
    if spec.scaling is Scaling.DELAYED:
        s = scale_t.reshape(-1, 1, 1, 1).expand_as(bamax)   # one scale, or one per block row
        return s, _div(1.0, s), None
    if enc is ScaleEncoding.E4M3_FP32:
        return _nvfp4_scales(bamax, ax.amax() if amax_t is None else amax_t, elem)
    if enc is ScaleEncoding.E8M0:
        a = bamax.clamp(min=2.0 ** -126)
        e = ((a.view(torch.int32) >> 23) & 0xFF) - 127 - elem.max_exp      # OCP: floor(log2 amax) - emax
        if spec.mx_scale_rounding == "ceil":
            e = e + (a > elem.max * torch.exp2(e.float())).to(e.dtype)
        e = torch.where(bamax > 0, e, -127).clamp(-127, 127)
        x_scale = torch.exp2(e.float())                                   # the E8M0 value
        return 1.0 / x_scale, x_scale, None
    amax = bamax if amax_t is None else amax_t.reshape(-1, 1, 1, 1).expand_as(bamax)
    amax = amax.clamp(min=_EPS)
    scale = _div(elem.max, amax)
    if enc is ScaleEncoding.POW2:
        scale = (scale.view(torch.int32) & 0x7F800000).view(torch.float32)  # round down to 2**k
    return scale, _div(1.0, scale), None


def below_fp32_max(av: torch.Tensor, scale: torch.Tensor, elem) -> torch.Tensor:
    """MX blocks whose E8M0 scale 2**e is so large (e >= 120 for E4M3) that a grid value times
    it exceeds FP32 max: a block of amax near FP32 max has values that round up to 2**(128 - e)
    (255.99 -> 256 at 2**120), which dequantize to Inf. There |x * scale| is capped at the
    largest grid value of the binade below 2**(128 - e), (2 - 2**-m) * 2**(127 - e), whose
    dequantized value is finite; every other block's cap is above the format's max (a no-op)."""
    cap = (2.0 - 2.0 ** -elem.mantissa_bits) * (scale * 2.0 ** 127)   # inf where 2**(127 - e) overflows
    return torch.minimum(av, cap)


def nvfp4_up(tensor_amax: torch.Tensor) -> torch.Tensor:
    """What NVFP4 multiplies a tensor of this amax by before its scale: 2**64 below 2688 /
    FP32 max (there `Quantized.values` are on the grid of x * 2**64 * scale), else 1."""
    return torch.where(tensor_amax < _NVFP4_TINY, _NVFP4_UP, 1.0)


def _nvfp4_scales(bamax: torch.Tensor, tamax: torch.Tensor, elem):
    """NVFP4's (scale, scale_inv, up): the FP32 tensor encode scale 2688 / amax, the E4M3 block
    decode scales, and `up`, a power of two the magnitudes are multiplied by before the scale.

    For a tensor amax below 2688 / FP32 max (~7.9e-36) the encode scale overflows FP32 (Transformer
    Engine clamps it to FP32 max, and such a tensor then lost up to 31%: an all-2**-126 tensor came
    back as 8.08e-39). There the tensor is taken 2**64 times larger (exact: every |x| is below
    ~1.6e-16) and scaled as such, and 2**-64 goes into the decode scale; `up` is 1 otherwise,
    which leaves every other tensor's numbers as they were, bit for bit."""
    up = nvfp4_up(tamax)
    tamax, bamax = tamax * up, bamax * up   # exact: powers of two, far from overflow
    # full_like(...) / t, not a Python float / t: PyTorch computes `float / tensor` as
    # reciprocal(t) * float, which is 1 ulp off the quotient for about a quarter of inputs.
    s_enc = torch.where(tamax > 0, torch.full_like(tamax, _NVFP4_TENSOR_RANGE) / tamax,
                        1.0).clamp(max=_FP32_MAX)
    sb = round_to_grid((bamax / elem.max) * s_enc, E4M3)       # E4M3 block decode scale
    # at most FP32 max, as Transformer Engine clamps it: an infinite scale turns 0 into NaN
    scale = torch.where(sb > 0, s_enc / sb, 0.0).clamp(max=_FP32_MAX)
    return scale, (sb / s_enc) / up, up


def _div(num: float, den: torch.Tensor) -> torch.Tensor:
    """num / den correctly rounded to FP32 on every device, eager or fused: divided in FP64
    (IEEE everywhere; Triton's FP32 division is approximate, up to 2 ulp) and rounded once
    to FP32 (double rounding through FP64 is innocuous for a quotient: 53 >= 2 * 24 + 2)."""
    return (torch.full_like(den, num, dtype=torch.float64) / den.double()).float()
