"""lowprec: staged low-precision (FP8/FP4) rollout for PyTorch training.

Importing this package is light on purpose: it imports torch and the numerics, never
MLflow, lm-eval or CUDA initialisation (tests/test_lean_import.py holds it to that).
"""

from lowprec.numerics.formats import (E2M1, E4M3, E5M2, E8M0, FORMATS, DelayedScalingConfig, ElementFormat,
                             Format, QuantSpec, Rounding, ScaleEncoding, Scaling, format_names,
                             get_format)
from lowprec.numerics.hadamard import RandomHadamard
from lowprec.numerics.quantize import QuantStats, Quantized, fake_quantize, quantize, round_to_grid
from lowprec.sites.precision_state import PrecisionState, Site, prepare

__version__ = "0.1.0"

__all__ = [
    "E2M1", "E4M3", "E5M2", "E8M0", "FORMATS", "DelayedScalingConfig", "ElementFormat", "Format",
    "QuantSpec", "Rounding", "ScaleEncoding", "Scaling", "format_names", "get_format",
    "RandomHadamard", "QuantStats", "Quantized", "fake_quantize", "quantize", "round_to_grid",
    "PrecisionState", "Site", "prepare",
]
