"""The `emulated` backend: quantized GEMMs in FP32 arithmetic, every format, any device.

Operands arrive quantized (`lowprec.numerics.quantize.Quantized`: grid values plus scales);
the GEMM dequantizes them the way the hardware applies scales (values times
`scale_inv`, per block) and multiplies in FP32, so the accumulation is FP32 as in
Transformer Engine's and cuBLAS's FP8 GEMMs.

Against the `torch` backend on a CPU (tensor-wise and row-wise FP8 through
`torch._scaled_mm`): the same quantized operands, but not the same arithmetic bit for bit.
`_scaled_mm` (oneDNN) accumulates the FP8 products and applies the scales in an order of
its own, at every row count (a = ones(1, 7), b = ones(4, 7) with b[0, 0] = 5 under
fp8_tensorwise: 10.892857551574707 here, 10.89285945892334 there). Both evaluate each dot
product of K terms in FP32 with at most K + 2 roundings per term (K - 1 additions, the
product, the two scales), so each is within gamma(K + 2) * (|A| @ |B|^T) of the exact
product of the dequantized operands, gamma(n) = n u / (1 - n u), u = 2**-24 (Higham,
Accuracy and Stability of Numerical Algorithms, 2nd ed., eq. 3.5), and the two backends
are within twice that of each other: `gemm_bound` (tests/lowprec/sites/backends/test_scaled_mm_bound.py,
over shapes from 1 row up; measured at most half of it).
"""

from __future__ import annotations

import torch

from lowprec.numerics.formats import Format
from lowprec.numerics.quantize import Quantized
from lowprec.sites.backends.linear_sites import PrecisionLinearSites

__all__ = ["EmulatedBackend", "dequantize_for_gemm", "gemm_bound"]

_U = 2.0 ** -24   # FP32's unit roundoff


def dequantize_for_gemm(t) -> torch.Tensor:
    """The FP32 operand a GEMM sees: values * scale_inv per block, or the tensor itself."""
    if not isinstance(t, Quantized):
        return t
    rows, k = t.values.shape
    sr, _, sc, _ = t.scale_inv.shape
    vb = t.values.reshape(sr, rows // sr, sc, k // sc)
    return (vb * t.scale_inv).reshape(rows, k)


def gemm_bound(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How far two FP32 evaluations of `a @ b.t()` (the dequantized operands of a GEMM, K the
    shared last dimension) may be apart elementwise, each with at most K + 2 roundings per
    term: 2 * gamma(K + 2) * (|a| @ |b|^T), in FP64 (see the module docstring)."""
    n = a.shape[-1] + 2
    gamma = n * _U / (1 - n * _U)
    return 2 * gamma * (a.double().abs() @ b.double().abs().t())


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
