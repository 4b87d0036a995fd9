"""lowprec.numerics.quantize against the slow scalar reference in quant_reference.py (written from the specs).

Values (scaled domain), per-block encode/decode scales and dequantized outputs must be
equal bit for bit, with one exception: NVFP4's dequantized output. The definition
multiplies and divides, x_q * sb / s_enc (one rounding: x_q * sb is exact), while
lowprec multiplies by a stored decode scale, x_q * fp32(sb / s_enc) (two roundings), so
the two can differ by 1 ulp; lowprec's output is checked to be exactly the latter.
For MX and power-of-two scales all of this is exact, and FP32-scaled formats divide by
the same FP32 scale in both, so there is nothing to allow.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import lowprec.numerics
from lowprec.numerics import ScaleEncoding, Scaling, get_format, quantize

import quant_reference as ref

REF_ELEM = {"e4m3": ref.E4M3, "e5m2": ref.E5M2, "e2m1": ref.E2M1}


# ----------------------------------------------------------------------------- helpers


def _ordered(t: torch.Tensor) -> torch.Tensor:
    """FP32 bit patterns mapped to integers that are monotonic in the value (+0 == -0)."""
    i = t.contiguous().view(torch.int32).to(torch.int64)
    return torch.where(i < 0, -(i & 0x7FFFFFFF), i)


def assert_same_bits(actual: torch.Tensor, expected, what: str, max_ulp: int = 0) -> None:
    exp = torch.tensor(expected, dtype=torch.float32)
    act = actual.detach().float().reshape(exp.shape)
    assert not torch.isnan(exp).any() and not torch.isnan(act).any(), what
    if max_ulp == 0:
        diff = act.view(torch.int32) != exp.view(torch.int32)   # -0.0 and +0.0 differ here
    else:
        diff = (_ordered(act) - _ordered(exp)).abs() > max_ulp
    if diff.any():
        idx = diff.nonzero()[:5].tolist()
        shown = [(tuple(i), act[tuple(i)].item(), exp[tuple(i)].item()) for i in idx]
        pytest.fail(f"{what}: {int(diff.sum())} of {diff.numel()} differ "
                    f"(index, lowprec, reference): {shown}")


def _check(x: torch.Tensor, spec, expected, *, amax=None, dequant_ulp: int = 0):
    q = quantize(x, spec, amax=amax)
    nb_r = len(expected.scale)
    assert_same_bits(q.values, expected.values, "values")
    assert_same_bits(q.scale.reshape(nb_r, -1), expected.scale, "encode scales")
    assert_same_bits(q.scale_inv.reshape(nb_r, -1), expected.scale_inv, "decode scales")
    assert_same_bits(q.dequantize(), expected.dequant, "dequantized", max_ulp=dequant_ulp)
    return q


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _mx_data(elem) -> torch.Tensor:
    """8 rows x 64 (two MX blocks per row), one kind of trouble per row."""
    g = _gen(1)
    x = torch.randn(8, 64, generator=g)
    x[1, :32] = 0.0                                           # an all-zero block
    x[2] = torch.randn(64, generator=g) * 1e-3
    x[2, 5], x[2, 40] = 1.0e4, -3.0e5                         # a single huge outlier per block
    x[3, :32] = torch.randn(32, generator=g) * 1e-39          # FP32 subnormals: scale clamped to 2**-127
    x[3, 32:] = torch.randn(32, generator=g) * 2.0 ** -120    # tiny normals
    # exact ties: midpoints between neighbouring grid values, times 8; the block amax is
    # elem.max * 8 so that X = 8 in both scale modes
    grid = elem.values
    mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
    row = [elem.max * 8] + [m * 8 * (-1) ** k for k, m in enumerate(mids)]
    row = (row * 64)[:64]
    x[4] = torch.tensor(row)
    x[5, :32] = torch.linspace(-1.0, 1.0, 32) * elem.max * 1.1  # amax just above max: floor != ceil
    x[5, 32:] = torch.randn(32, generator=g) * 3.0e37          # near FLT_MAX
    x[6] = -x[6].abs()
    x[6, 3] = -0.0
    x[7] = torch.randn(64, generator=g) * torch.exp2(torch.randint(-30, 30, (64,), generator=g).float())
    return x


# ----------------------------------------------------------------------------- MX


@pytest.mark.parametrize("mode", ["ceil", "floor"])
@pytest.mark.parametrize("name", ["mxfp8", "mxfp4"])
def test_mx_matches_ocp_reference(name, mode):
    spec = get_format(name).input
    assert spec.scaling is Scaling.BLOCK and spec.block == (1, 32)
    assert spec.scale_encoding is ScaleEncoding.E8M0
    spec = replace(spec, mx_scale_rounding=mode)
    elem = REF_ELEM[spec.element.name]
    x = _mx_data(elem)
    expected = ref.mx(x.tolist(), elem, mode=mode)
    q = _check(x, spec, expected)

    # the scales are E8M0 values: powers of two within [2**-127, 2**127]
    e = torch.log2(q.scale_inv.double())
    assert torch.equal(e, e.round()) and e.min() >= -127 and e.max() <= 127
    # the data reached the corners it was built for
    assert 2.0 ** -127 in q.scale_inv.flatten().tolist()
    assert sum(v == 0.0 for v in expected.values[2]) > 0       # small values next to an outlier flushed


def test_mx_scale_modes_differ_as_specified():
    """floor (OCP) saturates the block maximum when amax/X > max; ceil doubles X instead."""
    spec = get_format("mxfp8").input
    x = torch.zeros(1, 32)
    x[0, 0] = 500.0      # floor: X = 2**(8 - 8) = 1, 500 saturates to 448; ceil: X = 2, 250 -> 256
    x[0, 1] = 3.0
    qf = quantize(x, replace(spec, mx_scale_rounding="floor"))
    qc = quantize(x, replace(spec, mx_scale_rounding="ceil"))
    assert qf.scale_inv.flatten().tolist() == [1.0] and qc.scale_inv.flatten().tolist() == [2.0]
    assert qf.values[0, :2].tolist() == [448.0, 3.0]
    assert qc.values[0, :2].tolist() == [256.0, 1.5]


# ----------------------------------------------------------------------------- NVFP4


def _nvfp4_data() -> torch.Tensor:
    """32 x 64: a 2 x 4 grid of 16x16 blocks, one kind per block."""
    g = _gen(2)
    x = torch.randn(32, 64, generator=g)

    def blk(i, j):
        return (slice(16 * i, 16 * i + 16), slice(16 * j, 16 * j + 16))

    x[blk(0, 0)] = 0.0                                                  # all zeros
    x[blk(0, 1)] = torch.randn(16, 16, generator=g) * 1e-3
    x[blk(0, 1)][3, 7] = 1.0e3                                          # the tensor's outlier
    x[blk(0, 2)] = torch.randn(16, 16, generator=g) * 1e-4              # E4M3 block scale underflows to 0
    x[blk(0, 3)] = torch.randn(16, 16, generator=g) * 3e-3              # E4M3 block scale subnormal
    x[blk(1, 0)] = torch.randn(16, 16, generator=g) * 1e-39             # FP32 subnormal inputs
    x[blk(1, 1)] = torch.randn(16, 16, generator=g) * 30.0
    x[blk(1, 2)] = -x[blk(1, 2)].abs()
    x[blk(1, 3)] = torch.randn(16, 16, generator=g) * torch.exp2(
        torch.randint(-20, 8, (16, 16), generator=g).float())
    return x


@pytest.mark.parametrize("role,block", [("input", (1, 16)), ("weight", (16, 16))])
def test_nvfp4_matches_reference(role, block):
    spec = getattr(get_format("nvfp4"), role)
    assert spec.block == block and spec.scale_encoding is ScaleEncoding.E4M3_FP32
    x = _nvfp4_data()
    expected = ref.nvfp4(x.tolist(), block=block)
    q = _check(x, spec, expected, dequant_ulp=1)
    # lowprec's dequantized value is exactly x_q * fp32(sb / s_enc): the 1 ulp is the order
    # of operations and nothing else
    nb_r = len(expected.scale)
    dec = torch.tensor(expected.scale_inv, dtype=torch.float32)
    dec = dec.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    assert torch.equal(q.dequantize(), torch.tensor(expected.values, dtype=torch.float32) * dec)
    # the corners are in the data: an underflowed block scale and a subnormal E4M3 scale
    sb = [v * 2688.0 / 1000.0 for row in expected.scale_inv for v in row]  # ~ E4M3 scales
    assert 0.0 in sb
    assert any(2.0 ** -10 < v < 2.0 ** -6 for v in sb)
    assert nb_r == 32 // block[0]


def test_nvfp4_with_explicit_tensor_amax():
    """amax= replaces the tensor amax behind the FP32 scale (e.g. reduced over a shard group)."""
    spec = get_format("nvfp4").input
    x = _nvfp4_data()
    for amax in (2.0e3, 500.0):     # larger than the data's, and smaller (the outlier block saturates)
        expected = ref.nvfp4(x.tolist(), block=(1, 16), tensor_amax=amax)
        _check(x, spec, expected, amax=amax, dequant_ulp=1)


def test_nvfp4_underflowed_block_is_zero():
    spec = get_format("nvfp4").input
    x = torch.zeros(2, 16)
    x[0, 0] = 1000.0
    x[1] = torch.linspace(-1e-4, 1e-4, 16)       # 448 * 1e-4 / 1000 < 2**-10: E4M3(s) == 0
    expected = ref.nvfp4(x.tolist())
    assert expected.scale_inv[1] == [0.0]
    q = _check(x, spec, expected, dequant_ulp=1)
    assert q.scale[1].flatten().tolist() == [0.0] and not q.dequantize()[1].any()
    assert not torch.isnan(q.dequantize()).any()


def test_nvfp4_tiny_tensor_keeps_zeros_and_signs():
    """A tensor amax below 2688 / FLT_MAX would make s_enc overflow: the tensor is taken 2**64
    times larger first (the reference does the same), so 0 stays 0, not NaN, and the values
    keep their precision (tests/lowprec/numerics/test_nvfp4_tiny.py)."""
    for role, shape in (("input", (1, 16)), ("weight", (16, 16))):
        spec = getattr(get_format("nvfp4"), role)
        x = torch.zeros(shape)
        x[0, 0], x[0, 1] = 1e-38, -3e-39
        expected = ref.nvfp4(x.tolist(), block=spec.block)
        q = _check(x, spec, expected, dequant_ulp=1)
        out = q.dequantize()
        assert not torch.isnan(out).any() and (out[x == 0] == 0).all()
        assert out[0, 0] > 0 > out[0, 1]


# ----------------------------------------------------------------------------- FP32 / POW2 scales


def _wide_data(rows: int, cols: int, seed: int) -> torch.Tensor:
    g = _gen(seed)
    mag = torch.exp2(torch.randint(-40, 40, (rows, 1), generator=g).float())
    x = torch.randn(rows, cols, generator=g) * mag
    x[0] = 0.0
    x[1, 7] = 1e30                                        # outlier in a row of ~2**?
    x[2] = torch.randn(cols, generator=g) * 1e-40         # FP32 subnormals (amax below eps)
    x[3] = torch.randn(cols, generator=g) * 1e-9
    x[3, 0] = 1e-13                                       # a value below eps in a normal row
    return x


@pytest.mark.parametrize("block", [(1, 128), (128, 128)])
def test_blockwise_pow2_matches_reference(block):
    fmt = get_format("fp8_blockwise")
    spec = fmt.input if block == (1, 128) else fmt.weight
    assert spec.block == block and spec.scale_encoding is ScaleEncoding.POW2
    x = _wide_data(128, 256, seed=3)
    if block == (128, 128):
        x[:, :128] *= 1e-3                                 # the two blocks differ in scale
    expected = ref.fp32_scaled(x.tolist(), ref.E4M3, block, pow2=True)
    q = _check(x, spec, expected)
    e = torch.log2(q.scale.double())
    assert torch.equal(e, e.round())


@pytest.mark.parametrize("role", ["input", "grad_output"])
def test_rowwise_matches_reference(role):
    spec = getattr(get_format("fp8_rowwise"), role)
    elem = REF_ELEM[spec.element.name]
    x = _wide_data(8, 96, seed=4)
    expected = ref.fp32_scaled(x.tolist(), elem, (1, 96))
    _check(x, spec, expected)


@pytest.mark.parametrize("name,role", [("fp8_tensorwise", "input"),
                                       ("fp8_tensorwise", "grad_output"),
                                       ("fp4_tensorwise", "input")])
def test_tensorwise_matches_reference(name, role):
    spec = getattr(get_format(name), role)
    elem = REF_ELEM[spec.element.name]
    x = _wide_data(8, 64, seed=5)
    x[1, 7] = 30.0                       # keep most rows representable under one scale
    x = x * 1e-2
    expected = ref.fp32_scaled(x.tolist(), elem, (8, 64))
    _check(x, spec, expected)
    # all-zero and all-tiny tensors: the amax floor keeps the scale finite
    for y in (torch.zeros(2, 8), torch.full((2, 8), 1e-20)):
        _check(y, spec, ref.fp32_scaled(y.tolist(), elem, (2, 8)))


# ----------------------------------------------------------------------------- the grids


@pytest.mark.parametrize("elem", [lowprec.numerics.E4M3, lowprec.numerics.E5M2, lowprec.numerics.E2M1], ids=lambda e: e.name)
def test_element_grid_matches_bit_layout(elem):
    """ElementFormat.grid() and .max agree with the values enumerated code by code."""
    r = REF_ELEM[elem.name]
    assert elem.grid().tolist() == r.values
    assert elem.max == r.max and elem.max_exp == r.emax
    assert elem.min_subnormal == r.values[1]


def test_round_to_grid_matches_reference_scalars():
    g = _gen(6)
    for elem in (lowprec.numerics.E4M3, lowprec.numerics.E5M2, lowprec.numerics.E2M1):
        r = REF_ELEM[elem.name]
        grid = r.values
        mids = [(a + b) / 2 for a, b in zip(grid, grid[1:])]
        x = torch.cat([
            torch.tensor(grid + mids, dtype=torch.float32),
            -torch.tensor(mids, dtype=torch.float32),
            torch.randn(4000, generator=g) * torch.exp2(torch.randint(-20, 18, (4000,), generator=g).float()),
            torch.tensor([1e-45, -1e-40, 3e38, -3.4e38, 0.0, -0.0]),
        ])
        got = lowprec.numerics.round_to_grid(x, elem)
        assert_same_bits(got, [ref.round_rne(v, r) for v in x.tolist()], f"round_to_grid {elem.name}")
