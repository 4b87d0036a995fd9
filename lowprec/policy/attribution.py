"""Attribution by replay: is precision to blame for an anomalous step, and which sites?

When a step is anomalous (`lowprec.policy.anomaly`), the session replays the same batch from
the same weights, RNG and scaling state with a set of sites in high precision, before
the step is applied. `attribute` decides which sets to replay:

1. every low-precision site in high precision. If the anomaly persists, precision is not
   to blame: nothing is demoted (the step is skipped, or the run rewinds);
2. otherwise precision is to blame: narrow it down, first by stage (newest first: the
   sites a stage promoted together, and the sites that started in low precision), then by
   halving the remaining set in forward order. A half whose replay is clean holds the
   cause; when the first half's replay is not clean, the cause is taken to be in the
   second half, and that inference is confirmed by a replay of its own before anything is
   blamed on it;
3. the sites blamed are the smallest set whose replay was clean (`verified`): a fault that
   needs two sites in high precision at once is blamed on the set that cleared it.

The number of replays per anomaly is bounded (`max_replays`); when the budget runs out
the last verified set is blamed. Every replay is recorded with its evidence (the sites in
high precision, the loss and grad norm it gave, whether it was still anomalous) and
becomes an event. `Megatron-LM`'s rerun state machine re-runs a step to tell transient
from persistent faults; here the replay also finds which sites' precision caused it.

This module is pure logic: `replay(sites) -> Replay` is the caller's (a `Session` runs
the model), so its tests need no model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

__all__ = ["Replay", "Attribution", "attribute"]


@dataclass(frozen=True)
class Replay:
    """One replay of the anomalous step: `high_precision` sites in high precision."""

    high_precision: tuple[str, ...]
    loss: float
    grad_norm: float
    anomalous: bool

    def to_evidence(self) -> dict:
        return {"high_precision": list(self.high_precision), "loss": self.loss, "grad_norm": self.grad_norm,
                "anomalous": self.anomalous}


@dataclass(frozen=True)
class Attribution:
    """The outcome: whether precision is to blame, the sites blamed, and every replay."""

    precision_to_blame: bool
    blamed: tuple[str, ...]
    replays: tuple[Replay, ...]
    exhausted: bool = False          # the replay budget ran out before the search ended

    @property
    def evidence(self) -> dict:
        return {"replays": len(self.replays), "precision_to_blame": self.precision_to_blame,
                "budget_exhausted": self.exhausted,
                "clean_with": [list(r.high_precision) for r in self.replays if not r.anomalous]}


def attribute(candidates: Sequence[str], groups: Sequence[Sequence[str]],
              replay: Callable[[tuple[str, ...]], Replay], max_replays: int) -> Attribution:
    """Search which of `candidates` (the low-precision sites, in forward order) to blame.

    groups: sets of candidates to try before halving (the stages, newest first); sites
    missing from `candidates` are ignored. replay: runs the step with the given sites in
    high precision. max_replays >= 1."""
    if max_replays < 1:
        raise ValueError(f"max_replays must be >= 1, got {max_replays}")
    order = list(dict.fromkeys(candidates))
    done: list[Replay] = []

    def budget() -> bool:
        return len(done) < max_replays

    def clean(sites: Sequence[str]) -> bool:
        r = replay(tuple(sites))
        done.append(r)
        return not r.anomalous

    if not order:
        return Attribution(False, (), ())
    if not clean(order):
        return Attribution(False, (), tuple(done))
    verified = order
    current = order
    position = {s: i for i, s in enumerate(order)}
    for group in groups:
        g = sorted({s for s in group if s in position}, key=position.__getitem__)
        if not g or len(g) >= len(current) or not budget():
            continue
        if clean(g):
            verified = current = g
            break
    while len(current) > 1 and budget():
        half = len(current) // 2
        first, second = current[:half], current[half:]
        if clean(first):
            verified = current = first
        else:
            current = second          # inferred: confirmed below before it is blamed
    if current is not verified and budget() and clean(current):
        verified = current
    exhausted = len(current) > 1 or current is not verified
    return Attribution(True, tuple(verified), tuple(done), exhausted and not budget())
