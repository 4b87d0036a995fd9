"""The `emulated` and `torch` backends on a CPU: how far apart their FP8 GEMMs may be.

Both multiply the same quantized operands in FP32, but not alike: `emulated` dequantizes
each operand (values times scale_inv) and calls an FP32 matmul; `torch._scaled_mm` on a CPU
(oneDNN) accumulates the FP8 products and applies the scales its own way, in a summation
order of its own. They are not equal bit for bit (a = ones(1, 7), b = ones(4, 7) with
b[0, 0] = 5: 10.892857551574707 against 10.89285945892334; most outputs of a GEMM of 1 to
100 rows differ in the last bits), at any row count. What holds (the bound stated in
lowprec.sites.backends.emulated) is the FP32 error bound of a dot product (Higham, Accuracy
and Stability of Numerical Algorithms, 2nd ed., eq. 3.5): each is within gamma(K + 2) *
(|A| @ |B|^T) of the exact product of the dequantized operands (K - 1 additions, the
product and two scale multiplications per term), so they are within 2 * gamma(K + 2) of
each other, gamma(n) = n u / (1 - n u), u = 2**-24. Measured over the shapes below: at most
0.51 of it. Tested over shapes with few rows (1, 3), 48 rows and more, every FP8 format the
`torch` backend runs, and magnitudes over many binades.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowprec.numerics.formats import get_format
from lowprec.numerics.quantize import quantize
from lowprec.sites.backends.emulated import EmulatedBackend, dequantize_for_gemm, gemm_bound
from lowprec.sites.backends.scaled_mm import ScaledMMBackend

FORMATS = ["fp8_tensorwise", "fp8_delayed", "fp8_rowwise"]


def _operands(fmt: str, a: torch.Tensor, b: torch.Tensor):
    spec = get_format(fmt).specs()
    kw = lambda t: {"scale": 224.0 / t.abs().amax()} if fmt == "fp8_delayed" else {}   # a history's scale
    return quantize(a, spec["input"], **kw(a)), quantize(b, spec["weight"], **kw(b))


def _check(fmt: str, a: torch.Tensor, b: torch.Tensor) -> tuple[int, int]:
    qa, qb = _operands(fmt, a, b)
    emu, tor = EmulatedBackend().gemm(qa, qb), ScaledMMBackend().gemm(qa, qb)
    bound = gemm_bound(dequantize_for_gemm(qa), dequantize_for_gemm(qb))
    diff = (emu.double() - tor.double()).abs()
    assert (diff <= bound).all(), (fmt, tuple(a.shape), tuple(b.shape), (diff / bound).max().item())
    return int((emu != tor).sum()), emu.numel()


def test_the_example_of_the_issue_is_within_the_bound_and_not_equal():
    a, b = torch.ones(1, 7), torch.ones(4, 7)
    b[0, 0] = 5
    differ, _ = _check("fp8_tensorwise", a, b)
    assert differ > 0   # not bit for bit: the reason the bound is stated


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows", [1, 3, 48])
def test_few_and_many_rows(fmt, rows):
    g = torch.Generator().manual_seed(rows)
    _check(fmt, torch.randn(rows, 128, generator=g) * 3, torch.randn(96, 128, generator=g))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(fmt=st.sampled_from(FORMATS), m=st.sampled_from([1, 2, 3, 5, 16, 48, 100]),
       n=st.integers(1, 130), k=st.integers(1, 300), scale_a=st.integers(-30, 30), scale_b=st.integers(-30, 30),
       seed=st.integers(0, 2 ** 16))
def test_over_shapes_and_magnitudes(fmt, m, n, k, scale_a, scale_b, seed):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(m, k, generator=g) * 2.0 ** scale_a
    b = torch.randn(n, k, generator=g).exp() * 2.0 ** scale_b   # skewed: some terms dominate
    _check(fmt, a, b)
