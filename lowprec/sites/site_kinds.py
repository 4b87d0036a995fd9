"""What part of a mixture-of-experts model a site is: `SiteKind`, as the plan's `kind:` selects it.

* `experts`: one routed expert of a grouped-experts module (`lowprec.sites.experts.ExpertSite`,
  FQN `<experts module>.<index>`, e.g. `model.layers.0.mlp.experts.3`);
* `shared_experts`: a layer under a shared expert (`shared_expert` in transformers' Qwen2-MoE,
  `shared_experts` in DeepSeek-V3 and torchtitan), which sees every token;
* `router`: the router's gate (torchtitan's `moe.router.gate`, HF's `mlp.gate` beside the
  experts). A router stays in high precision unless a rule names it (`kind: router` or its FQN
  in `fqns`): `lowprec.sites.resolution` holds that;
* `dense`: everything else (attention, dense MLPs, the output head).

A small module of its own: the plan (selectors), the resolution and the FLOP count share it
without importing the experts' modules (an expert site is known by its `expert_index`).
"""

from __future__ import annotations

from torch import nn

from lowprec.base.enums import StrEnum

__all__ = ["SiteKind", "SITE_KINDS", "kind_of", "expert_index_of"]


class SiteKind(StrEnum):
    DENSE = "dense"
    EXPERTS = "experts"
    SHARED_EXPERTS = "shared_experts"
    ROUTER = "router"


SITE_KINDS = tuple(k.value for k in SiteKind)
_SHARED = ("shared_expert", "shared_experts")


def expert_index_of(module: nn.Module | None) -> int | None:
    """The expert index of an expert site, None for any other module."""
    idx = getattr(module, "expert_index", None)
    return idx if isinstance(idx, int) else None


def kind_of(fqn: str, module: nn.Module | None, modules: dict[str, nn.Module]) -> SiteKind:
    """The kind of the module at `fqn` (`modules`: the model's modules by FQN)."""
    if expert_index_of(module) is not None:
        return SiteKind.EXPERTS
    parts = fqn.split(".")
    if any(p in _SHARED for p in parts):
        return SiteKind.SHARED_EXPERTS
    if parts[-1] in ("experts", "inner_experts"):   # a grouped-experts module itself (its GEMMs, no site)
        return SiteKind.EXPERTS
    if "router" in parts:
        return SiteKind.ROUTER
    if parts[-1] == "gate":   # HF's `mlp.gate` / Mixtral's `block_sparse_moe.gate`: beside the experts
        parent = ".".join(parts[:-1])
        if f"{parent}.experts" in modules:
            return SiteKind.ROUTER
    return SiteKind.DENSE
