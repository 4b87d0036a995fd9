"""Damage an eval checkpoint sees that the in-loop gate's FP8-against-high-precision comparison cannot.

The in-loop gate (`eval.gates`) compares the model as trained with the same weights in high
precision: it measures what precision costs *now*, and is blind to damage already in the
weights (a diverged model is equally broken in both passes, so the gate says pass). Each eval
checkpoint therefore also looks at its own numbers against two references:

* the run's previous checkpoint of the same mode (the last one that was not itself damaged);
* the baseline run's evals at the same step and of the same mode, where `rollout.baseline`
  names an MLflow run that logged evals (a losses file has none).

A metric is **damaged** when it is not finite (NaN, +-inf, or a perplexity saturated to the
largest float), or, for a loss-like metric (bits per byte, perplexities, compared on the
log scale: bits or nats per unit), when it exceeds a reference by more than `ratio` times
(`DEFAULT_RATIO`, 1.5: half again as many bits per byte as before). Bounded metrics
(accuracies) are left to the gate files; they cannot explode. `damage(...)` lists the
problems; `DamageVerdict` is the outcome the controller reads (verdict `regress`), which
replaces a passing or inconclusive gate outcome.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from typing import Any, Mapping

from lowprec.policy.verdicts import Verdict

__all__ = ["DEFAULT_RATIO", "DamageVerdict", "damage", "loss_scale", "flat_metrics"]

DEFAULT_RATIO = 1.5
_LOSS_LIKE = ("bits_per_byte", "bits_per_token", "loss")
_PERPLEXITY = "perplexity"


def flat_metrics(results: Mapping[str, Any] | None) -> dict[str, float]:
    """{task: {metric: value}} -> {"task/metric": value} (lm-eval's `acc,none` as `acc`; no stderrs)."""
    out: dict[str, float] = {}
    for task, per in (results or {}).items():
        if not isinstance(per, Mapping):
            continue
        for m, v in per.items():
            name = str(m).replace(",none", "").replace(",", "_")
            if name.endswith("_stderr") or isinstance(v, bool) or not isinstance(v, (int, float)):
                continue
            out[f"{task}/{name}"] = float(v)
    return out


def _finite(v: float) -> bool:
    return math.isfinite(v) and abs(v) < sys.float_info.max   # MLflow stores inf as the largest float


def loss_scale(metric: str, value: float) -> float | None:
    """A loss-like metric on a scale where `ratio` means "that many times the bits": bits per byte
    as it is, a perplexity as its log; None for a metric that is not loss-like."""
    name = metric.rsplit("/", 1)[-1]
    if _PERPLEXITY in name:
        return math.log(value) if value > 0 else None
    if any(name == k or name.startswith(k) for k in _LOSS_LIKE):
        return value
    return None


def damage(results: Mapping[str, Any] | None, references: list[tuple[str, Mapping[str, Any] | None]],
           ratio: float = DEFAULT_RATIO) -> list[str]:
    """The problems of `results` ({task: {metric: value}}): non-finite metrics, and loss-like
    metrics above `ratio` times a reference's (`references`: (what it is, its results); a
    reference without the metric, or with it not finite, says nothing)."""
    now = flat_metrics(results)
    problems = [f"{m} = {v:g} is not finite" for m, v in now.items() if not _finite(v)]
    bad = {p.split(" = ")[0] for p in problems}
    for label, ref in references:
        before = flat_metrics(ref)
        for m, v in now.items():
            if m in bad or m not in before or not _finite(before[m]):
                continue
            a, b = loss_scale(m, v), loss_scale(m, before[m])
            if a is None or b is None or b <= 0:
                continue
            if a > ratio * b:
                problems.append(f"{m} = {v:.4g} against {before[m]:.4g} at {label} (more than {ratio:g}x "
                                f"{'in log' if _PERPLEXITY in m else 'as much'})")
                bad.add(m)
    return problems


@dataclass(frozen=True)
class DamageVerdict:
    """A failed eval checkpoint: what the controller reads (`verdict`, `reason`), and the in-loop
    gate's own outcome kept beside it (`gate`: None without a gate)."""

    problems: tuple[str, ...]
    gate: Any = None

    @property
    def verdict(self) -> Verdict:
        return Verdict.REGRESS

    @property
    def reason(self) -> str:
        said = getattr(self.gate, "verdict", None)
        gate = (f"; the in-loop gate (as trained against high precision) said "
                f"{getattr(said, 'value', said)}, which cannot see damage both share" if said is not None else "")
        return "damage in the evals: " + "; ".join(self.problems) + gate
