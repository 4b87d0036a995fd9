"""Number formats: element encodings, how one operand is scaled, and the named recipes.

Three layers of description, from small to large:

* `ElementFormat` is an encoding of one number (FP8 E4M3, FP8 E5M2, FP4 E2M1, and the
  E8M0 power-of-two scale format): its mantissa width, smallest normal exponent, largest
  finite value and whether it has Inf/NaN. Rounding to its grid lives in `quantize`.
* `QuantSpec` says how one GEMM operand is quantized: the element format, the scaling
  granularity (`Scaling`), the block shape, how scales are encoded, the rounding mode,
  and whether a random Hadamard transform is applied first.
* `Format` is what a user names in a config (`fp8_tensorwise`, `mxfp8`, `nvfp4`, ...):
  one `QuantSpec` for each operand of the three GEMMs of a linear layer, as Transformer
  Engine's recipes do (forward: input, weight; data gradient: grad_output, weight;
  weight gradient: input, grad_output). `bf16` is the high-precision format.

Strings exist only at the edges: `get_format(name)` turns a name into a `Format` (with
a did-you-mean error) and everything inside compares typed objects.
"""

from __future__ import annotations

import enum
import math
import typing
from dataclasses import dataclass, field, replace

import torch

from lowprec.base.parse import suggest

__all__ = [
    "ElementFormat", "E4M3", "E5M2", "E2M1", "E8M0", "Scaling", "Rounding", "ScaleEncoding",
    "QuantSpec", "DelayedScalingConfig", "Format", "FormatFamily", "FORMATS", "get_format", "format_names",
    "suggest",
]


@dataclass(frozen=True)
class ElementFormat:
    """A floating-point element encoding with `exponent_bits` and `mantissa_bits`.

    `min_normal_exp` is the unbiased exponent of the smallest normal number; values
    below `2**min_normal_exp` are subnormal with a fixed step `2**(min_normal_exp -
    mantissa_bits)`. `max` is the largest finite value.
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    max: float
    min_normal_exp: int
    has_inf: bool
    has_nan: bool
    torch_dtype: torch.dtype | None = None

    @property
    def max_exp(self) -> int:
        """floor(log2(max)): OCP MX calls this emax_elem."""
        return math.floor(math.log2(self.max))

    @property
    def min_subnormal(self) -> float:
        return 2.0 ** (self.min_normal_exp - self.mantissa_bits)

    @property
    def min_normal(self) -> float:
        return 2.0 ** self.min_normal_exp

    def grid(self) -> torch.Tensor:
        """Every non-negative finite value of the format, ascending (for tests and plots)."""
        m = self.mantissa_bits
        values = {0.0}
        step = self.min_subnormal
        values.update(k * step for k in range(1, 2**m))
        e = self.min_normal_exp
        while True:
            for k in range(2**m):
                v = (1 + k / 2**m) * 2.0**e
                if v > self.max:
                    return torch.tensor(sorted(values), dtype=torch.float64)
                values.add(v)
            e += 1

    def __repr__(self) -> str:  # short: these appear in error messages and tables
        return f"ElementFormat({self.name})"


E4M3 = ElementFormat("e4m3", 4, 3, 448.0, -6, has_inf=False, has_nan=True,
                     torch_dtype=torch.float8_e4m3fn)
E5M2 = ElementFormat("e5m2", 5, 2, 57344.0, -14, has_inf=True, has_nan=True,
                     torch_dtype=torch.float8_e5m2)
E2M1 = ElementFormat("e2m1", 2, 1, 6.0, 0, has_inf=False, has_nan=False)
# E8M0: unsigned powers of two 2**-127 .. 2**127, 0xFF is NaN (OCP MX v1.0, section 5.4).
E8M0 = ElementFormat("e8m0", 8, 0, 2.0**127, -127, has_inf=False, has_nan=True,
                     torch_dtype=getattr(torch, "float8_e8m0fnu", None))


class Scaling(enum.Enum):
    """Granularity of the scale factors of one operand."""

    TENSOR = "tensor"      # one scale from this tensor's amax (current scaling)
    DELAYED = "delayed"    # one scale from an amax history (Transformer Engine DelayedScaling)
    ROW = "row"            # one scale per row (along the reduction dimension)
    BLOCK = "block"        # one scale per block of `block` elements (1x128, 128x128, MX 1x32, NVFP4 1x16/16x16)


class ScaleEncoding(enum.Enum):
    """How block or row scales are stored."""

    FP32 = "fp32"          # any positive FP32 value
    POW2 = "pow2"          # FP32 rounded down to a power of two (Float8BlockScaling default)
    E8M0 = "e8m0"          # OCP MX shared exponent, a power of two in [2**-127, 2**127]
    E4M3_FP32 = "e4m3+fp32"  # NVFP4: E4M3 block scales under one FP32 tensor scale


class Rounding(enum.Enum):
    NEAREST_EVEN = "nearest_even"
    STOCHASTIC = "stochastic"


@dataclass(frozen=True)
class QuantSpec:
    """How one operand of one GEMM is quantized.

    `block` is (rows, cols) of one scale block in the operand's 2-D view, whose last
    dimension is the GEMM's reduction dimension. `mx_scale_rounding` chooses how an
    E8M0 block exponent is rounded: "floor" is OCP MX v1.0 (the block max may saturate),
    "ceil" picks the smallest power of two that does not saturate (arXiv 2506.08027).
    """

    element: ElementFormat
    scaling: Scaling
    block: tuple[int, int] = (1, 1)
    scale_encoding: ScaleEncoding = ScaleEncoding.FP32
    rounding: Rounding = Rounding.NEAREST_EVEN
    hadamard: bool = False
    mx_scale_rounding: str = "ceil"

    def __post_init__(self) -> None:
        r, c = self.block
        if r < 1 or c < 1:
            raise ValueError(f"QuantSpec block must be positive, got {self.block}")
        if self.scaling is Scaling.BLOCK and self.block == (1, 1):
            raise ValueError("Scaling.BLOCK needs a block shape, e.g. (1, 128) or (128, 128)")
        if self.scaling is not Scaling.BLOCK and self.block != (1, 1):
            raise ValueError(f"block={self.block} only applies to Scaling.BLOCK, not {self.scaling}")
        if self.mx_scale_rounding not in ("floor", "ceil"):
            raise ValueError(f"mx_scale_rounding must be 'floor' or 'ceil', got {self.mx_scale_rounding!r}")
        if self.scale_encoding is ScaleEncoding.E8M0 and self.scaling is not Scaling.BLOCK:
            raise ValueError("E8M0 scales are per block (MX); use Scaling.BLOCK")
        if self.scale_encoding is ScaleEncoding.E4M3_FP32 and self.scaling is not Scaling.BLOCK:
            raise ValueError("E4M3 block scales (NVFP4) are per block; use Scaling.BLOCK")

    @property
    def block_elems(self) -> int:
        return self.block[0] * self.block[1]

    def with_rounding(self, rounding: Rounding) -> "QuantSpec":
        return replace(self, rounding=rounding)


@dataclass(frozen=True)
class DelayedScalingConfig:
    """Transformer Engine's DelayedScaling knobs: scale = (max / amax) / 2**margin."""

    history_len: int = 1024
    algo: str = "max"          # "max" over the history, or "most_recent"
    margin: int = 0

    def __post_init__(self) -> None:
        if self.history_len < 1:
            raise ValueError(f"amax history length must be >= 1, got {self.history_len}")
        if self.algo not in ("max", "most_recent"):
            raise ValueError(f"amax algo must be 'max' or 'most_recent', got {self.algo!r}")
        if self.margin < 0:
            raise ValueError(f"margin must be >= 0, got {self.margin}")


class FormatFamily(enum.Enum):
    """What kind of precision a format is: the high-precision baseline, FP8 or FP4."""

    HIGH = "high"
    FP8 = "fp8"
    FP4 = "fp4"


@dataclass(frozen=True)
class Format:
    """A named low-precision recipe for a linear layer: one QuantSpec per GEMM operand.

    `None` specs mean the operand stays in high precision (the `bf16` format has no
    specs at all). Operands are named as in Transformer Engine:
    fprop = input @ weight^T, dgrad = grad_output @ weight, wgrad = grad_output^T @ input.
    The `*_wgrad` specs are the same tensors quantized along the token dimension for
    the weight-gradient GEMM (NVFP4 applies the Hadamard transform there).
    """

    # what a config names a format by (`lowprec.base.parse`'s value types): its name
    config_description: typing.ClassVar[str] = "a format name"

    @classmethod
    def from_config_value(cls, v) -> "Format":
        return get_format(v)

    name: str
    input: QuantSpec | None = None
    weight: QuantSpec | None = None
    grad_output: QuantSpec | None = None
    input_wgrad: QuantSpec | None = None
    grad_output_wgrad: QuantSpec | None = None
    delayed: DelayedScalingConfig | None = None
    description: str = ""
    bits: int = field(default=0, compare=False)  # bits per element: ladders rise in it, plots sort by it

    @property
    def is_high_precision(self) -> bool:
        return self.input is None and self.weight is None and self.grad_output is None

    @property
    def family(self) -> "FormatFamily":
        """High precision, FP8 or FP4, from the bit width (no name is parsed)."""
        return FormatFamily.HIGH if self.is_high_precision else FormatFamily.FP8 if self.bits == 8 else FormatFamily.FP4

    def specs(self) -> dict[str, QuantSpec]:
        out = {}
        for role in ("input", "weight", "grad_output", "input_wgrad", "grad_output_wgrad"):
            spec = getattr(self, role)
            if spec is not None:
                out[role] = spec
        return out

    def block_constraints(self) -> dict[str, tuple[int, int]]:
        """Block shape each operand needs its 2-D view to divide, by role."""
        return {role: s.block for role, s in self.specs().items() if s.scaling is Scaling.BLOCK}

    def __str__(self) -> str:
        return self.name


def _hybrid(name: str, scaling: Scaling, desc: str, **fmt_kw) -> Format:
    fwd = QuantSpec(E4M3, scaling)
    bwd = QuantSpec(E5M2, scaling)
    return Format(name, input=fwd, weight=fwd, grad_output=bwd, input_wgrad=fwd,
                  grad_output_wgrad=bwd, description=desc, bits=8, **fmt_kw)


def _rowwise_e4m3_pow2() -> Format:
    spec = QuantSpec(E4M3, Scaling.ROW, scale_encoding=ScaleEncoding.POW2)
    return Format("fp8_rowwise_e4m3_pow2", input=spec, weight=spec, grad_output=spec, input_wgrad=spec,
                  grad_output_wgrad=spec, bits=8,
                  description="E4M3 in all three GEMMs (gradients too), one scale per row along the "
                              "reduction dimension rounded down to a power of two (torchao's "
                              "`rowwise` recipe)")


def _blockwise() -> Format:
    act = QuantSpec(E4M3, Scaling.BLOCK, (1, 128), ScaleEncoding.POW2)
    wgt = QuantSpec(E4M3, Scaling.BLOCK, (128, 128), ScaleEncoding.POW2)
    grad = QuantSpec(E4M3, Scaling.BLOCK, (1, 128), ScaleEncoding.POW2)
    return Format("fp8_blockwise", input=act, weight=wgt, grad_output=grad, input_wgrad=act,
                  grad_output_wgrad=grad, bits=8,
                  description="E4M3, 1x128 blocks for activations/gradients, 128x128 for "
                              "weights, power-of-two scales (TE Float8BlockScaling, DeepSeek-V3)")


def _mx(name: str, element: ElementFormat, desc: str, bits: int) -> Format:
    spec = QuantSpec(element, Scaling.BLOCK, (1, 32), ScaleEncoding.E8M0)
    return Format(name, input=spec, weight=spec, grad_output=spec, input_wgrad=spec,
                  grad_output_wgrad=spec, description=desc, bits=bits)


def _nvfp4() -> Format:
    act = QuantSpec(E2M1, Scaling.BLOCK, (1, 16), ScaleEncoding.E4M3_FP32)
    wgt = QuantSpec(E2M1, Scaling.BLOCK, (16, 16), ScaleEncoding.E4M3_FP32)
    grad = act.with_rounding(Rounding.STOCHASTIC)
    return Format("nvfp4", input=act, weight=wgt, grad_output=grad,
                  input_wgrad=replace(act, hadamard=True),
                  grad_output_wgrad=replace(grad, hadamard=True), bits=4,
                  description="E2M1, 1x16 blocks with E4M3 scales and an FP32 tensor scale, "
                              "16x16 weight blocks, stochastic rounding on gradients, random "
                              "Hadamard transform on weight-gradient inputs (TE NVFP4BlockScaling)")


def _fp4_plain() -> Format:
    spec = QuantSpec(E2M1, Scaling.TENSOR)
    return Format("fp4_tensorwise", input=spec, weight=spec, grad_output=spec, input_wgrad=spec,
                  grad_output_wgrad=spec, bits=4,
                  description="E2M1 with one FP32 scale per tensor and none of the NVFP4 tricks "
                              "(the aggressive, unstable plan)")


FORMATS: dict[str, Format] = {f.name: f for f in (
    Format("bf16", description="high precision: BF16 operands, FP32 accumulation", bits=16),
    _hybrid("fp8_tensorwise", Scaling.TENSOR,
            "E4M3 forward / E5M2 backward, one scale per tensor from its current amax "
            "(TE Float8CurrentScaling)"),
    _hybrid("fp8_delayed", Scaling.DELAYED,
            "E4M3 forward / E5M2 backward, scale from an amax history (TE DelayedScaling)",
            delayed=DelayedScalingConfig()),
    _hybrid("fp8_rowwise", Scaling.ROW,
            "E4M3 forward / E5M2 backward, one scale per row along the reduction dimension"),
    _rowwise_e4m3_pow2(),
    _blockwise(),
    _mx("mxfp8", E4M3, "E4M3 in blocks of 32 with E8M0 scales (OCP MX, TE MXFP8BlockScaling)", 8),
    _mx("mxfp4", E2M1, "E2M1 in blocks of 32 with E8M0 scales (OCP MX)", 4),
    _nvfp4(),
    _fp4_plain(),
)}


def format_names() -> list[str]:
    """Every format's name, as a config or the CLI names it (`bf16`, `fp8_tensorwise`, `mxfp8`, ...)."""
    return list(FORMATS)


def get_format(name: str | Format) -> Format:
    """The Format called `name`; an unknown name raises a ValueError listing the known ones."""
    if isinstance(name, Format):
        return name
    try:
        return FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown precision format {name!r}.{suggest(str(name), format_names())} "
            f"Known formats: {', '.join(format_names())}."
        ) from None
