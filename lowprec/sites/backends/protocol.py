"""What every backend is and what every backend's site is: `Backend`, `SiteModule`, and the one
error a backend raises for a format it cannot run.

A backend answers `supports(fmt)` and builds a site from a linear layer with `make_site`;
`prepare` (lowprec.sites.precision_state) calls nothing else, whatever the backend. Its flags
`fast_path` and `fp8_storage` tell lowprec's own layer (`PrecisionLinear`) how to run on it.
A site is an `nn.Module` that `PrecisionState` switches and reads through `SiteModule`; the
`emulated` and `torch` backends' sites are `PrecisionLinear`, the `te` and `torchao` backends'
are their own modules around TE's and torchao's layers, and all four satisfy the protocol
(tests/lowprec/sites/backends/test_protocol.py holds each to it).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

from torch import nn

from lowprec.numerics.formats import Format
from lowprec.sites.amax_scope import DEFAULT_AMAX_SCOPE, AmaxScope

__all__ = ["Backend", "SiteModule", "UnsupportedFormatError"]


class UnsupportedFormatError(ValueError):
    """A format that a backend's library has no recipe for (`te`, `torchao`); the message says
    which format, why, and what the backend runs instead."""


@runtime_checkable
class SiteModule(Protocol):
    """The layer at one site, as `PrecisionState` and the controller use it."""

    format: Format                 # what it runs in now
    in_features: int
    out_features: int
    collect_stats: bool            # compute the per-role statistics on the next forward/backward
    stats: dict                    # role -> QuantStats from the last step ({} when none)
    histories: dict                # role -> delayed-scaling AmaxHistory ({} when the format keeps none)

    def set_format(self, fmt: Format) -> None:
        """Switch to `fmt` without touching the parameters."""

    def forward(self, x: Any) -> Any:
        ...


@runtime_checkable
class Backend(Protocol):
    """One way to run the sites' GEMMs (`precision.backend`)."""

    name: str
    fast_path: bool      # PrecisionLinear runs its FP8 formats on lowprec.sites.fp8_linear
    fp8_storage: bool    # PrecisionLinear's weight cache keeps weights in their FP8 storage form

    def supports(self, fmt: Format) -> tuple[bool, str]:
        """(True, "") if this backend can run `fmt`, else (False, why and what to do)."""

    def make_site(self, linear: nn.Module, fmt: Format, *, name: str, seed: int = 0, amax_group=None,
                  amax_scope: AmaxScope = DEFAULT_AMAX_SCOPE, fused: bool = False, gemm=None,
                  layer_cls: type | None = None, shared_amax=None) -> SiteModule:
        """The site that replaces `linear` (sharing its parameters), in format `fmt`.

        name: the site's FQN (in error messages); seed: its stochastic-rounding and Hadamard seed
        (a backend with neither ignores it); amax_group: the process group tensor-wise amaxes are
        reduced over (None: each rank's own); amax_scope: the plan's `amax_scope` (`local`: each
        rank scales by its own amaxes whatever `amax_group` says); gemm: the plan's `gemm`
        (`LinearGemmConfig`: how the fast path runs its three GEMMs; None for the defaults, and
        backends without lowprec's fast path ignore it); fused: the plan's `fused` (fused quantization kernels
        where the backend has them); layer_cls: a PrecisionLinear subclass for the backends whose
        sites are PrecisionLinear (a framework's module protocol mixed in), None for PrecisionLinear
        itself; shared_amax: the model's `lowprec.sites.shared_amax.SharedAmax` (one reduced amax
        for the sites reading one sequence-parallel input; backends with their own casts ignore
        it). A backend that cannot honour an `amax_group` or a `layer_cls` raises ValueError."""
