"""The format -> Transformer Engine recipe mapping, in plain Python (no TE import): which TE
recipe class and arguments compute a lowprec `Format` (`recipe_spec`), why none does
(`UnsupportedFormatError`), and the formats backend 'te' can run (`te_format_names`).
`lowprec.sites.backends.te` builds the TE recipe objects from these specs."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from lowprec.numerics.formats import E2M1, E4M3, E5M2, FORMATS, Format, Rounding, ScaleEncoding, Scaling, get_format
from lowprec.sites.backends.protocol import UnsupportedFormatError

__all__ = ["RecipeSpec", "recipe_spec", "te_format_names"]


class _NoRecipe(Exception):
    """Why no TE recipe computes a format; recipe_spec raises UnsupportedFormatError with it."""


@dataclasses.dataclass(frozen=True)
class RecipeSpec:
    """A TE recipe described without TE: class `cls` of `transformer_engine.common.recipe`,
    `kwargs` it must accept (`fp8_format` by `Format` member name), `pins` passed where the
    installed TE has the field (they override NVTE_* defaults), the availability check
    `capability`, and the `QParams.power_2_scale` the recipe must end up with."""

    cls: str
    kwargs: dict[str, Any]
    capability: str
    pins: dict[str, Any] = dataclasses.field(default_factory=dict)
    pow2_scales: bool | None = None


def _fp8_format(fmt: Format) -> str:
    fwd, bwd = {fmt.input.element, fmt.weight.element}, {fmt.grad_output.element}
    if fwd == {E4M3} and bwd in ({E4M3}, {E5M2}):
        return "E4M3" if bwd == {E4M3} else "HYBRID"
    raise _NoRecipe("TE's FP8 recipes are E4M3 throughout or HYBRID (E4M3 forward, E5M2 backward)")


def _block_dim(block: tuple[int, int]) -> int:
    if block in ((1, 128), (128, 128)):
        return 1 if block == (1, 128) else 2
    raise _NoRecipe(f"Float8BlockScaling has 1x128 or 128x128 blocks, not {block}")


def recipe_spec(fmt: Format | str) -> RecipeSpec | None:
    """The TE recipe `fmt` maps to (None for high precision); UnsupportedFormatError if none."""
    fmt = get_format(fmt)
    try:
        return _spec(fmt)
    except _NoRecipe as exc:
        torch_too = fmt.input is not None and fmt.input.element in (E4M3, E5M2)
        raise UnsupportedFormatError(
            f"format {fmt.name!r} cannot run on backend 'te': {exc}. Backend 'te' runs "
            f"{', '.join(te_format_names())}; run {fmt.name!r} on backend 'emulated'"
            + (" or 'torch'." if torch_too else ".")) from None


def _spec(fmt: Format) -> RecipeSpec | None:
    if fmt.is_high_precision:
        return None
    inp, wgt, grad = fmt.input, fmt.weight, fmt.grad_output
    if inp is None or wgt is None or grad is None:
        raise _NoRecipe("TE recipes quantize input, weight and grad_output together")
    if len({(s.scaling, s.scale_encoding) for s in (inp, wgt, grad)}) > 1:
        raise _NoRecipe("a TE recipe scales input, weight and grad_output the same way")
    pins = {"backward_override": None}       # NVTE_BACKWARD_OVERRIDE would change the backward GEMMs
    if inp.scaling is Scaling.DELAYED:
        d = fmt.delayed
        if d is None:
            raise _NoRecipe("a delayed-scaling format needs its DelayedScalingConfig")
        return RecipeSpec("DelayedScaling", {"fp8_format": _fp8_format(fmt), "margin": d.margin,
                                             "amax_history_len": d.history_len,
                                             "amax_compute_algo": d.algo}, "fp8", pins)
    if inp.scaling is Scaling.TENSOR and inp.element is not E2M1:
        return RecipeSpec("Float8CurrentScaling", {"fp8_format": _fp8_format(fmt)}, "fp8",
                          {**pins, "use_power_2_scales": False}, pow2_scales=False)
    if inp.scaling is not Scaling.BLOCK:
        raise _NoRecipe(f"Transformer Engine has no {inp.element.name} recipe with "
                        f"{inp.scaling.value} scaling")
    if inp.scale_encoding is ScaleEncoding.E8M0:
        if inp.element is not E4M3 or {inp.block, wgt.block, grad.block} != {(1, 32)}:
            raise _NoRecipe("Transformer Engine trains MX formats only as MXFP8 (E4M3, 1x32 blocks)")
        return RecipeSpec("MXFP8BlockScaling", {"fp8_format": _fp8_format(fmt)}, "mxfp8", pins)
    if inp.scale_encoding is ScaleEncoding.E4M3_FP32:
        return _nvfp4_spec(fmt, pins)
    pow2 = inp.scale_encoding is ScaleEncoding.POW2
    return RecipeSpec("Float8BlockScaling",
                      {"fp8_format": _fp8_format(fmt), "x_block_scaling_dim": _block_dim(inp.block),
                       "w_block_scaling_dim": _block_dim(wgt.block),
                       "grad_block_scaling_dim": _block_dim(grad.block)},
                      "fp8_block_scaling", {**pins, "use_f32_scales": not pow2}, pow2_scales=pow2)


def _nvfp4_spec(fmt: Format, pins: dict[str, Any]) -> RecipeSpec:
    inp, wgt, grad = fmt.input, fmt.weight, fmt.grad_output
    wgrad_in, wgrad_grad = fmt.input_wgrad or inp, fmt.grad_output_wgrad or grad
    if {inp.element, wgt.element, grad.element} != {E2M1}:
        raise _NoRecipe("NVFP4BlockScaling quantizes every operand to E2M1")
    if inp.block != (1, 16) or grad.block != (1, 16) or wgt.block not in ((1, 16), (16, 16)):
        raise _NoRecipe("NVFP4BlockScaling has 1x16 blocks (16x16 for weights)")
    if inp.hadamard or grad.hadamard or wgt.hadamard or wgrad_in.hadamard != wgrad_grad.hadamard:
        raise _NoRecipe("TE applies its Hadamard transform to both weight-gradient operands "
                        "together and to nothing else")
    if Rounding.STOCHASTIC in (inp.rounding, wgt.rounding) or grad.rounding != wgrad_grad.rounding:
        raise _NoRecipe("TE rounds stochastically only the gradient (in both its GEMMs)")
    return RecipeSpec("NVFP4BlockScaling", {
        "disable_rht": not wgrad_in.hadamard,
        "disable_stochastic_rounding": grad.rounding is not Rounding.STOCHASTIC,
        "disable_2d_quantization": wgt.block != (16, 16)}, "nvfp4",
        {**pins, "row_scaled_activation": False, "nvfp4_4over6": "none"})


def te_format_names() -> list[str]:
    """The formats backend 'te' can run (on a GPU that has them)."""
    names = []
    for name, fmt in FORMATS.items():
        with contextlib.suppress(_NoRecipe):
            _spec(fmt)
            names.append(name)
    return names
