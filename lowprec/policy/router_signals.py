"""The routers' load balance, per step: a signal that tells router collapse from a precision fault.

Each grouped-experts module's experts are sites (lowprec.sites.experts) that know how many tokens
the last forward routed to them. Per MoE layer (its experts module's FQN) this gives the
coefficient of variation of tokens per expert (0: even; sqrt(E - 1): every token to one expert)
and the busiest expert's tokens over the mean (1: even; E: collapse). A precision fault shows in
one expert's statistics (saturation, SQNR, NaN) while routing stays as it was; a collapsing
router shows here first, whatever the formats. `lowprec run` and the framework hosts log them
every logged step as `router/<experts FQN>/cv` and `router/<experts FQN>/max_over_mean`.
These are this rank's tokens (a data-parallel rank's own batch).
"""

from __future__ import annotations

import math

__all__ = ["router_balance"]


def router_balance(sites: dict) -> dict[str, float]:
    """`router/<experts module>/cv` and `.../max_over_mean` from the expert sites among `sites`
    (fqn -> Site of a PrecisionState); {} for a model without experts."""
    layers: dict[str, list[int]] = {}
    for fqn, s in sites.items():
        tokens = getattr(s.module, "tokens", None)
        if getattr(s.module, "expert_index", None) is not None and isinstance(tokens, int):
            layers.setdefault(fqn.rpartition(".")[0], []).append(tokens)
    out: dict[str, float] = {}
    for layer, counts in layers.items():
        mean = sum(counts) / len(counts)
        if mean <= 0:
            continue
        std = math.sqrt(sum((c - mean) ** 2 for c in counts) / len(counts))
        out[f"router/{layer}/cv"] = std / mean
        out[f"router/{layer}/max_over_mean"] = max(counts) / mean
    return out
