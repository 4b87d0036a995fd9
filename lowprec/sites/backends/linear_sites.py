"""`make_site` for the backends whose sites are lowprec's own layer, `PrecisionLinear`.

The `emulated` and `torch` backends differ only in the GEMM; the layer around it (casts,
statistics, delayed scaling, the three GEMMs of a linear layer, the FP8 fast path) is
`lowprec.sites.layers.PrecisionLinear` for both, built here from the linear layer it replaces.
"""

from __future__ import annotations

from torch import nn

from lowprec.numerics.formats import Format, get_format
from lowprec.sites.amax_scope import DEFAULT_AMAX_SCOPE, AmaxScope
from lowprec.sites.layers import PrecisionLinear

__all__ = ["PrecisionLinearSites"]


class PrecisionLinearSites:
    """Mixed into a backend: its sites are `PrecisionLinear` (or the subclass `layer_cls`) around
    the linear layer's own parameters, running their GEMMs on this backend."""

    def make_site(self, linear: nn.Module, fmt: Format | str, *, name: str = "", seed: int = 0, amax_group=None,
                  amax_scope: AmaxScope = DEFAULT_AMAX_SCOPE, fused: bool = False, gemm=None,
                  layer_cls: type[PrecisionLinear] | None = None, shared_amax=None) -> PrecisionLinear:
        cls = layer_cls or PrecisionLinear
        if not issubclass(cls, PrecisionLinear):
            raise ValueError(f"layer_cls={cls.__name__} is not a subclass of PrecisionLinear; backend "
                             f"{self.name!r} builds its sites from PrecisionLinear")
        return cls.from_module(linear, get_format(fmt), self, fqn=name, seed=seed, amax_group=amax_group, fused=fused,
                               amax_scope=amax_scope, gemm=gemm, shared_amax=shared_amax)
