"""Backends that run a quantized linear layer's GEMMs: `emulated`, `torch`, `te`.

`emulated` and `torch` share `lowprec.layers.PrecisionLinear` and differ only in the
GEMM (`Backend.gemm`): the emulated one multiplies grid values in FP32 on any device,
the torch one calls `torch._scaled_mm` on real FP8 tensors. `te` swaps in Transformer
Engine modules instead (see `lowprec.backends.te`). `get_backend(name)` turns the
config's string into an object; an unknown name lists the known ones.
"""

from __future__ import annotations

from typing import Protocol

import torch

from lowprec.formats import Format, suggest

__all__ = ["Backend", "get_backend", "BACKEND_NAMES"]

BACKEND_NAMES = ("emulated", "torch", "te")


class Backend(Protocol):
    name: str

    def supports(self, fmt: Format) -> tuple[bool, str]:
        """(True, "") if this backend can run `fmt`, else (False, why and what to do)."""

    def gemm(self, a, b) -> torch.Tensor:
        """a @ b.T in FP32 for two `Quantized` operands (or plain tensors), K last in both.
        (`te` has no gemm: its sites are whole te.Linear modules, built by `make_site`.)"""


def get_backend(name: str) -> "Backend":
    if name == "emulated":
        from lowprec.backends.emulated import EmulatedBackend
        return EmulatedBackend()
    if name == "torch":
        from lowprec.backends.scaled_mm import ScaledMMBackend
        return ScaledMMBackend()
    if name == "te":
        from lowprec.backends.te import TEBackend
        return TEBackend()
    raise ValueError(f"unknown backend {name!r}.{suggest(str(name), BACKEND_NAMES)} "
                     f"Known backends: {', '.join(BACKEND_NAMES)}.")
