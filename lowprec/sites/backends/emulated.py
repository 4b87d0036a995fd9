"""The `emulated` backend: quantized GEMMs in FP32 arithmetic, every format, any device.

Operands arrive quantized (`lowprec.numerics.quantize.Quantized`: grid values plus scales);
the GEMM dequantizes them the way the hardware applies scales (values times
`scale_inv`, per block) and multiplies in FP32, so the accumulation is FP32 as in
Transformer Engine's and cuBLAS's FP8 GEMMs. For tensor-wise and row-wise FP8 this is
exactly what `torch._scaled_mm` computes on CPU, so the `emulated` and `torch` backends
agree bit for bit there (tests/lowprec/sites/test_layers.py).
"""

from __future__ import annotations

import torch

from lowprec.numerics.formats import Format
from lowprec.numerics.quantize import Quantized
from lowprec.sites.backends.linear_sites import PrecisionLinearSites

__all__ = ["EmulatedBackend", "dequantize_for_gemm"]


def dequantize_for_gemm(t) -> torch.Tensor:
    """The FP32 operand a GEMM sees: values * scale_inv per block, or the tensor itself."""
    if not isinstance(t, Quantized):
        return t
    rows, k = t.values.shape
    sr, _, sc, _ = t.scale_inv.shape
    vb = t.values.reshape(sr, rows // sr, sc, k // sc)
    return (vb * t.scale_inv).reshape(rows, k)


class EmulatedBackend(PrecisionLinearSites):
    name = "emulated"
    fast_path = False     # every format through PrecisionLinear's quantized GEMMs
    fp8_storage = False   # cached weights stay FP32 grid values (what this GEMM multiplies)

    def supports(self, fmt: Format) -> tuple[bool, str]:
        return True, ""

    def gemm(self, a, b) -> torch.Tensor:
        return dequantize_for_gemm(a) @ dequantize_for_gemm(b).t()

    def __repr__(self) -> str:
        return "EmulatedBackend()"
