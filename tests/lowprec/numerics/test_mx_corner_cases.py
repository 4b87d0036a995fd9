"""MXFP8 at the exact E8M0 boundaries, FP16 inputs with a tiny amax, E8M0 scale bytes, and
axis-wise casts of 3-D and 4-D tensors: the cases torchao's tests hold (its
test/prototype/mx_formats), here against definitions written out by hand.

lowprec's MX semantics (lowprec.numerics.quantize, QuantSpec.mx_scale_rounding): the block
scale is 2**e with e = floor(log2 amax) - 8 for E4M3 (OCP MX v1.0), raised by one under
"ceil" (the default) when amax / 2**e exceeds 448, clamped to [-127, 127]; amax over finite
values only (a NaN or Inf never spoils the block's scale: it becomes NaN, E4M3 has no Inf);
an all-zero or all-NaN block takes 2**-127. Each row of the table gives the block, the
expected exponent and the expected first value, computed by hand below.
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from lowprec.numerics.formats import get_format
from lowprec.numerics.quantize import quantize

MX = get_format("mxfp8").specs()["input"]
NAN, INF = float("nan"), float("inf")
F32_MAX = torch.finfo(torch.float32).max


def _up(v: float) -> float:
    return torch.nextafter(torch.tensor(v), torch.tensor(INF)).item()


def _down(v: float) -> float:
    return torch.nextafter(torch.tensor(v), torch.tensor(0.0)).item()


# name: (first values of a 1x32 block (the rest: 0), E8M0 exponent, expected first quantized value)
TABLE = {
    "zero": ([0.0], -127, 0.0),
    "fp8_max": ([448.0], 0, 448.0),
    "fp8_max_times_2**10": ([448.0 * 2 ** 10], 10, 448.0),
    "fp8_max_times_2**-10": ([448.0 * 2 ** -10], -10, 448.0),
    "just_above_fp8_max": ([_up(448.0)], 1, 224.0),                      # ceil: the next exponent
    "just_below_fp8_max": ([_down(448.0)], 0, 448.0),                    # rounds to 448 in E4M3
    "power_of_two": ([2.0 ** 20], 12, 256.0),
    "fp32_just_below_512": ([_down(512.0)], 1, 256.0),
    "negative_fp8_max": ([-448.0], 0, -448.0),
    "smallest_normal": ([2.0 ** -126], -127, 2.0),                       # e = -134 clamped to -127
    "smallest_subnormal": ([2.0 ** -149], -127, 0.0),                    # 2**-22 underflows E4M3
    "negative_smallest_subnormal": ([-(2.0 ** -149)], -127, -0.0),
    "mixed_saturation_and_underflow": ([448.0 * 2 ** 5, 2.0 ** -5], 5, 448.0),
    "mixed_nan": ([NAN, 1.0], -8, NAN),                                  # 1.0 sets the scale
    "mixed_inf": ([INF, 1.0], -8, NAN),
    "mixed_negative_inf": ([-INF, 2.0], -7, NAN),
    "all_nan": ([NAN] * 32, -127, NAN),
    # 2**128 (1 - 2**-24) / 2**120 rounds to 256 in E4M3, and 256 * 2**120 is Inf in FP32: the
    # largest grid value below it instead (lowprec.numerics.quantize._below_fp32_max)
    "fp32_max": ([F32_MAX], 120, 240.0),
    "negative_fp32_max": ([-F32_MAX], 120, -240.0),
}


def _block(first: list[float]) -> torch.Tensor:
    x = torch.zeros(1, 32)
    x[0, :len(first)] = torch.tensor(first)
    return x


@pytest.mark.parametrize("name", sorted(TABLE))
def test_the_table(name):
    first, exp, value = TABLE[name]
    q = quantize(_block(first), MX)
    assert q.scale_inv.flatten().tolist() == [2.0 ** exp], name
    got = q.values[0, 0].item()
    assert (math.isnan(got) and math.isnan(value)) or (got == value and math.copysign(1, got) == math.copysign(1, value))
    rest = q.values[0, len(first):]
    assert (rest == 0).all()
    if name == "mixed_saturation_and_underflow":
        assert q.values[0, 1].item() == 0.0   # 2**-5 / 2**5 = 2**-10: below E4M3's smallest subnormal 2**-9 / 2
    assert torch.isfinite(q.dequantize()[~torch.isnan(q.values)]).all()   # no finite input dequantizes to Inf
    if name in ("mixed_nan", "mixed_inf", "mixed_negative_inf"):
        assert q.values[0, 1].item() == first[1] * 2.0 ** -exp   # the finite value, exactly


def test_floor_rounding_saturates_where_ceil_moves_the_exponent():
    floor = replace(MX, mx_scale_rounding="floor")
    q = quantize(_block([_down(512.0)]), floor)
    assert q.scale_inv.item() == 1.0 and q.values[0, 0].item() == 448.0   # OCP: the block max saturates


@pytest.mark.parametrize("name", sorted(TABLE))
def test_scale_bytes_are_never_the_e8m0_nan(name):
    """E8M0's 0xFF is NaN (OCP MX v1.0, 5.4): no block, NaN and Inf ones included, may get it;
    each byte is the exponent + 127, as PyTorch's own E8M0 cast encodes it."""
    if not hasattr(torch, "float8_e8m0fnu"):
        pytest.skip("this torch has no float8_e8m0fnu")
    first, exp, _ = TABLE[name]
    scale = quantize(_block(first), MX).scale_inv.flatten()
    byte = scale.to(torch.float8_e8m0fnu).view(torch.uint8)
    assert byte.tolist() == [exp + 127] and byte.item() != 0xFF
    nan_byte = torch.tensor([0xFF], dtype=torch.uint8).view(torch.float8_e8m0fnu).float()
    assert torch.isnan(nan_byte).all()   # what a reader of a 0xFF byte would multiply by


@pytest.mark.parametrize("fmt", ["fp8_tensorwise", "fp8_rowwise", "mxfp8", "nvfp4"])
def test_fp16_inputs_with_a_tiny_amax(fmt):
    """FP16 subnormals (amax 2**-24 .. 2**-14): quantized as their FP32 values are (lowprec
    scales in FP32; an FP16 scale 448 / 2**-24 would overflow FP16), finite, and close to them."""
    spec = get_format(fmt).specs()["input"]
    g = torch.Generator().manual_seed(0)
    for amax_exp in (-24, -20, -14):
        x16 = (torch.rand(16, 64, generator=g) * 2.0 ** amax_exp).half()
        x16[0, 0] = 2.0 ** amax_exp
        a, b = quantize(x16, spec), quantize(x16.float(), spec)
        assert torch.equal(a.values, b.values) and torch.equal(a.scale_inv, b.scale_inv)
        dq = a.dequantize()
        assert torch.isfinite(dq).all() and torch.isfinite(a.scale).all()
        step = 2.0 ** -3 if fmt != "nvfp4" else 0.5   # half a grid step at the block's top, relative
        assert (dq.float() - x16.float()).abs().max() <= step * x16.float().abs().amax()


def _rowwise_by_hand(x: torch.Tensor) -> torch.Tensor:
    """Row-wise E4M3 by its definition: per row (last dim) scale 448 / amax, correctly rounded
    in FP32, and PyTorch's own E4M3 cast of x * scale."""
    amax = x.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12).double()
    scale = (448.0 / amax).float()
    return (x * scale).to(torch.float8_e4m3fn).float()


@pytest.mark.parametrize("shape", [(2, 3, 64), (2, 2, 3, 64), (1, 1, 1, 32)])
def test_axis_wise_casts_of_3d_and_4d_tensors(shape):
    g = torch.Generator().manual_seed(len(shape))
    x = torch.randn(*shape, generator=g) * torch.logspace(-3, 3, shape[-2]).unsqueeze(-1)
    q = quantize(x, get_format("fp8_rowwise").specs()["input"])
    assert torch.equal(q.values.reshape(shape), _rowwise_by_hand(x))
    assert q.dequantize().shape == x.shape
    mx = quantize(x, MX)   # blocks of 32 along the last dimension, any leading dimensions
    flat = quantize(x.reshape(-1, shape[-1]), MX)
    assert torch.equal(mx.values, flat.values) and torch.equal(mx.scale_inv, flat.scale_inv)
    first = x.reshape(-1, shape[-1])[:, :32]
    e = torch.floor(torch.log2(first.abs().amax(dim=-1).double())) - 8
    e = e + (first.abs().amax(dim=-1).double() > 448.0 * 2.0 ** e).double()
    assert torch.equal(mx.scale_inv[:, 0, 0, 0].double(), 2.0 ** e)
