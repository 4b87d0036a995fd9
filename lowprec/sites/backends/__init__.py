"""Backends that run a quantized linear layer's GEMMs: `emulated`, `torch`, `te`, `torchao`.

`emulated` and `torch` share `lowprec.sites.layers.PrecisionLinear` and differ only in the
GEMM (their `gemm`): the emulated one multiplies grid values in FP32 on any device,
the torch one calls `torch._scaled_mm` on real FP8 tensors. `te` swaps in Transformer
Engine modules instead (see `lowprec.sites.backends.te`), and `torchao` swaps in torchao's
`Float8Linear` (see `lowprec.sites.backends.torchao_backend`); both are imported only when named.
Every backend implements `Backend` (lowprec.sites.backends.protocol: `supports`, `make_site`,
`fast_path`, `fp8_storage`) and every backend's site satisfies `SiteModule`; the two whose
sites are PrecisionLinear also have `gemm(a, b)`, a @ b.T in FP32 for two `Quantized`
operands, K last in both. `get_backend(name)` turns the config's string into an object; an
unknown name lists the known ones.
"""

from __future__ import annotations

from lowprec.base.parse import suggest
from lowprec.base.enums import StrEnum
from lowprec.sites.backends.protocol import Backend, SiteModule, UnsupportedFormatError

__all__ = ["Backend", "BackendName", "SiteModule", "UnsupportedFormatError", "get_backend", "BACKEND_NAMES"]


class BackendName(StrEnum):
    """The backends a plan names (`precision.backend`); str-valued: `BackendName.TE == "te"`,
    and `str()` and f-strings give the plain name."""

    EMULATED = "emulated"
    TORCH = "torch"
    TE = "te"
    TORCHAO = "torchao"


BACKEND_NAMES = tuple(b.value for b in BackendName)


def get_backend(name: str | BackendName) -> Backend:
    try:
        kind = BackendName(name)
    except ValueError:
        raise ValueError(f"unknown backend {name!r}.{suggest(str(name), BACKEND_NAMES)} "
                         f"Known backends: {', '.join(BACKEND_NAMES)}.") from None
    if kind is BackendName.EMULATED:
        from lowprec.sites.backends.emulated import EmulatedBackend
        return EmulatedBackend()
    if kind is BackendName.TORCH:
        from lowprec.sites.backends.scaled_mm import ScaledMMBackend
        return ScaledMMBackend()
    if kind is BackendName.TORCHAO:
        from lowprec.sites.backends.torchao_backend import TorchAOBackend
        return TorchAOBackend()
    from lowprec.sites.backends.te import TEBackend
    return TEBackend()
