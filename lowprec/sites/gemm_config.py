"""How the `torch` backend's fast path runs each of a linear layer's three FP8 GEMMs.

The `precision.gemm` section, beside the per-operand formats:

    precision:
      gemm:
        fprop: {use_fast_accum: true}    # y  = x  @ w^T
        dgrad: {use_fast_accum: false}   # dx = dy @ w
        wgrad: {use_fast_accum: false}   # dw = dy^T @ x
        pad_inner_dim: false

`use_fast_accum` is `torch._scaled_mm`'s flag: on Hopper the FP8 tensor cores then
accumulate without the periodic promotion to FP32 (faster, fewer accumulator bits). The
defaults are torchao's (`torchao.float8.config.Float8LinearConfig`: `gemm_config_output`
with fast accumulation, `gemm_config_grad_input` and `gemm_config_grad_weight` without), so
that the two run the same GEMMs. On CPU `_scaled_mm` accumulates in FP32 whatever the flag.

`pad_inner_dim`: on CUDA, `_scaled_mm` needs K and N (both dimensions of its second
operand) multiples of 16; the CPU kernel takes any shape. The token count is K of the wgrad
GEMM, so a batch of, say, 37 tokens does not fit there (an eval's forward does: tokens are
M in fprop). Off (torchao's default), a GEMM that does not fit is refused with an error that
names this key; on, its operands are zero-padded to multiples of 16 and the result sliced
back (zeros change no product; it costs a copy of each operand).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from lowprec.base.parse import parse

__all__ = ["GemmConfig", "LinearGemmConfig", "GEMM_ROLES", "misaligned"]

GEMM_ROLES = ("fprop", "dgrad", "wgrad")
ALIGN = 16   # what cuBLASLt's FP8 GEMMs need of every dimension


@dataclass(frozen=True)
class GemmConfig:
    """One GEMM's settings (torchao's `Float8GemmConfig`)."""

    use_fast_accum: bool = False


@dataclass(frozen=True)
class LinearGemmConfig:
    """The three GEMMs of a linear layer on the fast path, and whether to pad their shapes."""

    fprop: GemmConfig = field(default_factory=lambda: GemmConfig(use_fast_accum=True))
    dgrad: GemmConfig = field(default_factory=GemmConfig)
    wgrad: GemmConfig = field(default_factory=GemmConfig)
    pad_inner_dim: bool = False

    @classmethod
    def from_dict(cls, d: Any, path: str = "precision.gemm") -> "LinearGemmConfig":
        """Parse the `gemm:` mapping (ConfigError with the key's path and a did-you-mean)."""
        return parse(cls, d if d is not None else {}, path)

    def to_dict(self) -> dict[str, Any]:
        return {**{r: {"use_fast_accum": getattr(self, r).use_fast_accum} for r in GEMM_ROLES},
                "pad_inner_dim": self.pad_inner_dim}

    def fast_accum(self) -> tuple[bool, bool, bool]:
        """(fprop, dgrad, wgrad) `use_fast_accum`, as the autograd function takes them."""
        return (self.fprop.use_fast_accum, self.dgrad.use_fast_accum, self.wgrad.use_fast_accum)


def misaligned(gemm: str, m: int, n: int, k: int, rowwise: bool = False) -> str | None:
    """Why a `gemm` of (m, k) x (n, k)^T cannot run unpadded on CUDA, or None if it can:
    one line saying what was found, what is needed and the key that pads. `_scaled_mm`
    checks K and N (both dimensions of its second operand); M, the rows, may be any, except
    under row-wise scales, where it is held to 16 too (as the padding always did)."""
    dims = (("M", m), ("N", n), ("K", k)) if rowwise else (("N", n), ("K", k))
    bad = [f"{name} {v}" for name, v in dims if v % ALIGN]
    if not bad:
        return None
    return (f"the {gemm} FP8 GEMM ({m}x{k} @ {k}x{n}) has {', '.join(bad)}: cuBLASLt needs multiples of "
            f"{ALIGN}; set `precision.gemm.pad_inner_dim: true` to zero-pad (a copy of each operand), "
            f"or give the layer such shapes (a token count that is a multiple of {ALIGN})")
