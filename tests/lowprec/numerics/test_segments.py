"""quantize_segments: several operands quantized in one call, each exactly as on its own; with
`transposed`, each segment's transpose quantized where it lies (by strides), as `quantize` of the
transposed copy."""

import pytest
import torch

from lowprec.numerics import FORMATS
from lowprec.numerics.quantize import quantize
from lowprec.numerics.segments import quantize_segments
from lowprec.sites.backends.emulated import dequantize_for_gemm

SPECS = {"row": FORMATS["fp8_rowwise"].weight, "mx": FORMATS["mxfp8"].input,
         "block_1x128": FORMATS["fp8_blockwise"].input, "tensor": FORMATS["fp8_tensorwise"].input,
         "nvfp4_input": FORMATS["nvfp4"].input}


@pytest.mark.parametrize("name", SPECS)
def test_each_transposed_segment_is_its_transposes_quantization(name):
    spec = SPECS[name]
    torch.manual_seed(0)
    n, k = 128, 256   # each segment (n, k): its transpose (k, n) a whole number of blocks along n
    x = torch.randn(3 * n, k) * torch.tensor([0.01, 1.0, 300.0]).repeat_interleave(n)[:, None]
    x[5, 7] = float("nan")
    whole, views = quantize_segments(x, spec, [n, n, n], transposed=True)
    deq = dequantize_for_gemm(whole)
    for g, v in enumerate(views):
        seg = x[g * n:(g + 1) * n]
        want = quantize(seg.t(), spec)
        assert v.shape == want.shape == (k, n)
        assert _same(v.values, want.values) and torch.equal(v.scale_inv.reshape(want.scale_inv.shape),
                                                            want.scale_inv), (name, g)
        assert _same(dequantize_for_gemm(v), dequantize_for_gemm(want)), (name, g)
        assert _same(deq[g * n:(g + 1) * n].t(), dequantize_for_gemm(want)), (name, g)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit for bit, NaN where NaN."""
    return torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0))


def test_transposed_refuses_statistics_and_row_segments_of_other_lengths():
    x = torch.randn(96, 32)
    with pytest.raises(ValueError, match="statistics"):
        quantize_segments(x, SPECS["mx"], [32, 64], transposed=True, stats=True)
    with pytest.raises(ValueError, match="one length"):
        quantize_segments(x, SPECS["row"], [32, 64], transposed=True)
