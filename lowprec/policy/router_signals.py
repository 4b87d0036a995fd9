"""The routers' load balance: a signal that tells router collapse from a precision fault.

Each grouped-experts module's experts are sites (lowprec.sites.experts) that know how many tokens
the last forward routed to them. Per MoE layer (its experts module's FQN) this gives the
coefficient of variation of tokens per expert (0: even; sqrt(E - 1): every token to one expert)
and the busiest expert's tokens over the mean (1: even; E / top_k: every token's top k the same
experts). A precision fault shows in one expert's statistics (saturation, SQNR, NaN) while routing
stays as it was; a collapsing router shows here first, whatever the formats.

Two uses:

* `router_balance(sites, tokens)`: a step's tokens per expert, summed over every rank in the
  step's one all-gather (`Session.routed_tokens`: under expert parallelism each rank runs only
  its own experts), logged every logged step as `router/<experts FQN>/cv` and
  `router/<experts FQN>/max_over_mean` by `lowprec run` and the framework hosts;
* `router_windows(tokens, fractions)`: a check window's tokens, summed over every rank (the
  monitor's all-gather, `Signals.routers`), as `RouterSignals` per layer with `collapse`, how far
  the k busiest experts' share of the routed pairs went from even (k / E: 0) towards all of them
  (1: every token's top k the same experts). The controller names a layer whose collapse reaches
  `rollout.thresholds.router_collapse` a router fault: its experts are not judged and nothing
  is demoted for it (lowprec.policy.controller, rule 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["RouterSignals", "router_balance", "router_windows"]


@dataclass(frozen=True)
class RouterSignals:
    """One MoE layer's routing over a check window (all ranks)."""

    cv: float
    max_over_mean: float
    collapse: float       # 0: even; 1: every token's top k the same k experts
    tokens: float         # routed (token, expert) pairs of the window
    busiest: str          # the busiest expert's site

    def to_evidence(self) -> dict:
        return {"router/cv": self.cv, "router/max_over_mean": self.max_over_mean,
                "router/collapse": self.collapse, "router/tokens": self.tokens, "router/busiest": self.busiest}


def _by_layer(tokens: dict[str, float]) -> dict[str, list[tuple[str, float]]]:
    layers: dict[str, list[tuple[str, float]]] = {}
    for fqn, n in tokens.items():
        layers.setdefault(fqn.rpartition(".")[0], []).append((fqn, n))
    return layers


def _balance(counts: list[float]) -> tuple[float, float]:
    mean = sum(counts) / len(counts)
    std = math.sqrt(sum((c - mean) ** 2 for c in counts) / len(counts))
    return std / mean, max(counts) / mean


def router_balance(sites: dict, tokens: dict[str, float] | None = None) -> dict[str, float]:
    """`router/<experts module>/cv` and `.../max_over_mean` from `tokens` (expert site FQN ->
    tokens of a step, every rank's), else from the expert sites among `sites` (fqn -> Site of a
    PrecisionState), this rank's last forward; {} for a model without experts."""
    if tokens is None:
        tokens = {fqn: s.module.tokens for fqn, s in sites.items()
                  if getattr(s.module, "expert_index", None) is not None
                  and isinstance(getattr(s.module, "tokens", None), int)}
    out: dict[str, float] = {}
    for layer, rows in _by_layer(tokens).items():
        counts = [n for _, n in rows]
        if sum(counts) <= 0:
            continue
        out[f"router/{layer}/cv"], out[f"router/{layer}/max_over_mean"] = _balance(counts)
    return out


def router_windows(tokens: dict[str, float], fractions: dict[str, float]) -> dict[str, RouterSignals]:
    """Experts module FQN -> RouterSignals from a window's tokens per expert site (`fqn` ->
    tokens, every expert of a layer) and each expert's `routed_fraction` (top_k / E); layers
    without tokens in the window are left out. `collapse`: the share of the window's (token,
    expert) pairs that went to the k busiest experts, from k / E (even) to 1 (every token's top k
    the same experts), as a fraction of that way."""
    out: dict[str, RouterSignals] = {}
    for layer, rows in _by_layer(tokens).items():
        counts = [n for _, n in rows]
        total = sum(counts)
        if total <= 0:
            continue
        cv, mom = _balance(counts)
        even = fractions[rows[0][0]]                # top_k / E
        k = max(1, round(even * len(rows)))
        share = sum(sorted(counts, reverse=True)[:k]) / total
        collapse = (share - even) / (1 - even) if even < 1 else 0.0
        busiest = max(range(len(rows)), key=lambda i: counts[i])
        out[layer] = RouterSignals(cv, mom, min(max(collapse, 0.0), 1.0), float(total), rows[busiest][0])
    return out
