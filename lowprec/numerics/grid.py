"""An element format's grid: rounding a magnitude to it, and where it saturates.

Rounding is done in FP32 arithmetic on any device (PyTorch has no FP4 dtype and no float8
arithmetic on CPU): the step at `|v|` is `2**(max(exponent(|v|), min_normal_exp) -
mantissa_bits)` and `round(|v| / step)` is exact, so the result equals a hardware cast bit
for bit (tested against `torch.float8_e4m3fn` / `float8_e5m2` on every BF16 value).
`lowprec.numerics.quantize` scales operands onto these grids; the statistics count what saturates.
"""

from __future__ import annotations

import torch

from lowprec.numerics.formats import ElementFormat

__all__ = ["round_to_grid", "round_magnitude", "overflow_threshold", "saturated_mask", "saturates"]


def round_to_grid(v: torch.Tensor, elem: ElementFormat, noise: torch.Tensor | None = None) -> torch.Tensor:
    """Round FP32 `v` to `elem`'s grid, saturating at +-max; NaN stays NaN.

    Nearest-even when `noise` is None, else stochastic: floor(|v|/step + noise) with
    noise uniform in [0, 1). Infinities saturate here; callers decide their fate.
    """
    return _round_abs(v.abs(), v, elem, noise)


def _round_abs(a: torch.Tensor, sign: torch.Tensor, elem: ElementFormat,
               noise: torch.Tensor | None = None) -> torch.Tensor:
    """round_to_grid of a value whose magnitude is `a` and whose sign is `sign`'s."""
    return torch.copysign(round_magnitude(a, elem, noise), sign)


def round_magnitude(a: torch.Tensor, elem: ElementFormat, noise: torch.Tensor | None = None) -> torch.Tensor:
    """`a` (>= 0) rounded to `elem`'s grid and saturated: a new tensor, >= 0, 0 where `a` is 0.

    The operations in place on one fresh temporary: on CPU a new large tensor costs more
    than the pass that fills it.
    """
    a = a.clamp(max=elem.max)
    step = (a.view(torch.int32) & 0x7F800000).view(torch.float32)  # 2**floor(log2 a), 0 for FP32 subnormals
    step = step.clamp_(min=elem.min_normal).mul_(2.0 ** -elem.mantissa_bits)
    n = a.div_(step).round_() if noise is None else a.div_(step).add_(noise).floor_()
    return n.mul_(step)


def overflow_threshold(elem: ElementFormat) -> float:
    """|v| beyond which clamping changed the result: round-to-nearest without saturation
    would have left max (half the top binade's step above it)."""
    return elem.max + 0.5 * 2.0 ** (elem.max_exp - elem.mantissa_bits)


def saturated_mask(a: torch.Tensor, elem: ElementFormat) -> torch.Tensor:
    """|v| = a that round-to-nearest-even (unbounded) would take past max. The tie at the
    threshold goes past max when max's mantissa is odd (E5M2 57344, E2M1 6: PyTorch's
    E5M2 cast gives inf there), and back to max when it is even (E4M3 448)."""
    odd = round((elem.max / 2.0**elem.max_exp - 1) * 2**elem.mantissa_bits) % 2 == 1
    thr = overflow_threshold(elem)
    return a >= thr if odd else a > thr


def saturates(a: torch.Tensor, elem: ElementFormat) -> torch.Tensor:
    """Whether a scaled magnitude `a` saturates in `elem` (a bool tensor, no sync): what the
    statistics count as saturated, for callers that only have an amax times its scale."""
    return saturated_mask(a, elem)
