"""One error budget for the in-loop gate's repeated checks (Bonferroni alpha spending).

A rollout gates before every stage promotion, and its periodic evals gate too: one run makes
K checks, each of G gates. Were each check a test at the gate file's own confidence (a
one-sided false-alarm level of (1 - confidence) / 2 per gate, 2.5% at 0.95), a run whose
numerics are harmless would be rolled back by luck with a chance growing with K*G (about
1 - 0.975^(K*G): 40% for 20 checks of one gate). `error_budget:` in the gate file bounds it:

    error_budget: {alpha: 0.05}          # P(a harmless run is rolled back at least once) <= 5%
    error_budget: {alpha: 0.05, planned_checks: 8}   # when the run does not say how many

The budget alpha is spent by Bonferroni over the checks the run plans (`planned_checks`, or
the number `lowprec run` computes and hands the checker: one per rollout stage, one per
periodic eval, one final) and over the gates of a check: the i-th check (1-based) may spend
alpha / (K + 1) if i <= K, and alpha / (K + 1) / 2^(i - K) beyond (re-promotions after a
rollback make checks nobody planned), split evenly over the G gates. The shares sum to at
most alpha however many checks happen, and a union bound does the rest: P(any false regress)
<= sum of the shares <= alpha, with no assumption about how the checks depend on each other.
Each gate then reads its interval at confidence 1 - 2 * share / G (so a gate's one-sided
false-alarm level at its tolerance is share / G). The price is wider intervals: more
`inconclusive` (a promotion held and asked again later), a larger regression needed to roll back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lowprec.base.parse import parse
from lowprec.gates.errors import spec_error

__all__ = ["ErrorBudget", "BUDGET_KEYS"]

BUDGET_KEYS = ("alpha", "planned_checks")


@dataclass(frozen=True)
class ErrorBudget:
    """`alpha`: the largest chance that a harmless run is rolled back by luck over all its checks;
    `planned_checks`: how many checks the run makes (None: the run tells the checker)."""

    alpha: float = 0.05
    planned_checks: int | None = None

    def __post_init__(self):
        a = self.alpha
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0.0 < a < 0.5:
            raise spec_error(f"must be a number strictly between 0 and 0.5 (e.g. 0.05), got {a!r}", key="alpha")
        object.__setattr__(self, "alpha", float(a))
        k = self.planned_checks
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 1):
            raise spec_error(f"must be a whole number >= 1, got {k!r}", key="planned_checks")

    @classmethod
    def from_dict(cls, d: Any) -> "ErrorBudget":
        """From a gate file's `error_budget:` mapping, by the one config parser (`lowprec.base.parse`)."""
        return parse(cls, d, "")

    def share(self, check: int, planned: int) -> float:
        """The budget the `check`-th check (1-based) of a run planning `planned` checks may spend."""
        if check < 1 or planned < 1:
            raise ValueError(f"check and planned must be >= 1, got {check}, {planned}")
        each = self.alpha / (planned + 1)
        return each if check <= planned else each / 2 ** (check - planned)

    def confidence(self, check: int, planned: int, gates: int) -> float:
        """The two-sided confidence each of `gates` gates reads at that check."""
        return 1.0 - 2.0 * self.share(check, planned) / max(1, gates)
