"""Numerics: element formats and named recipes, rounding to a grid, quantizers with statistics,
Hadamard transforms, delayed-scaling histories, the Triton kernels and the custom ops around
them.

May import: lowprec.base (and torch; Triton only inside `kernels/`).
"""

from lowprec.numerics.formats import (E2M1, E4M3, E5M2, E8M0, FORMATS, DelayedScalingConfig, ElementFormat,
                                      Format, QuantSpec, Rounding, ScaleEncoding, Scaling, format_names,
                                      get_format)
from lowprec.numerics.hadamard import RandomHadamard
from lowprec.numerics.quantize import QuantStats, Quantized, fake_quantize, quantize, round_to_grid

__all__ = [
    "E2M1", "E4M3", "E5M2", "E8M0", "FORMATS", "DelayedScalingConfig", "ElementFormat", "Format",
    "QuantSpec", "Rounding", "ScaleEncoding", "Scaling", "format_names", "get_format",
    "RandomHadamard", "QuantStats", "Quantized", "fake_quantize", "quantize", "round_to_grid",
]
