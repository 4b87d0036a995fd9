"""The in-loop gate of lowprec's training runtime (entry point `lowprec.gate_checkers`: default).

`EvalCheckpoints` evaluates the model as trained and the same weights in high precision;
this checker compares the two with a gate file (`eval.gates`), example by example, and
returns a `GateSummary` (a `Verdict` and a reason) that the rollout controller acts on.

With `error_budget:` in the gate file the checks of one run share one error budget
(lowprec.gates.budget: Bonferroni spending over the planned checks and the gates): the i-th check
reads every gate at the confidence its share allows. `lowprec run` says how many checks it
plans through `plan_checks(n)` (one per rollout stage, per periodic eval, and the final one);
a gate file's `planned_checks` wins over it. Without `error_budget:` every check uses the
file's own confidence. The count of checks made is the checker's state (`state_dict`), saved
with a run's checkpoints: a resumed run's next check is the one after the last one made
(check 4 of 5, not 1 of 5), so the budget is not spent twice.
"""

from __future__ import annotations

from pathlib import Path

from lowprec.gates.gate import GateSummary, check_all, summarize
from lowprec.gates.scores import Scores
from lowprec.gates.spec import GateSpec, gate_file

__all__ = ["GateFileChecker"]


class GateFileChecker:
    """`check(high_precision, as_trained)` against the gates of one gate file."""

    def __init__(self, path: str | Path, planned_checks: int | None = None):
        """`path`: a gate file's path, or the name of one shipped with this package (`inloop`)."""
        self.path = gate_file(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"eval.gates: gate file {str(path)!r} not found; give a gate file (see "
                                    f"docs/gates.md), the name of a shipped one, or null for no in-loop gate")
        self.spec = GateSpec.from_yaml(self.path)
        self.metrics = tuple(self.spec.metrics)
        # the most examples per task a deciding gate needs (its min_samples): fewer make it inconclusive
        self.samples_needed = {g.metric.split("/")[1]: g.min_samples for g in self.spec.gates if not g.informational
                               and g.metric.count("/") == 2}
        self.checks = 0                    # checks made so far in this run
        self.planned = planned_checks

    def plan_checks(self, n: int) -> None:
        """How many checks the run plans (the gate file's `error_budget.planned_checks` wins)."""
        self.planned = max(1, int(n))

    def state_dict(self) -> dict:
        """What a resumed run needs to continue the budget: the checks made so far."""
        return {"checks": self.checks}

    def load_state_dict(self, saved: dict) -> None:
        self.checks = int(saved.get("checks", 0))

    def confidence(self, check: int) -> float | None:
        """The confidence every gate reads at the `check`-th check (None: the gate file's own)."""
        budget = self.spec.error_budget
        if budget is None:
            return None
        planned = budget.planned_checks or self.planned or 1
        deciding = sum(not g.informational for g in self.spec.gates)   # informational gates spend nothing
        return budget.confidence(check, planned, deciding)

    def check(self, baseline, candidate) -> GateSummary:
        self.checks += 1
        conf = self.confidence(self.checks)
        spec = self.spec if conf is None else self.spec.with_overrides(confidence=conf)
        summary = summarize(check_all(spec, Scores.from_eval(baseline.results, baseline.samples,
                                                             source="high precision"),
                                      Scores.from_eval(candidate.results, candidate.samples, source="as trained")))
        if conf is None:
            return summary
        note = (f" [check {self.checks} of {self.spec.error_budget.planned_checks or self.planned or 1} planned; "
                f"error budget {self.spec.error_budget.alpha:g} over the run: each gate at confidence {conf:.5g}]")
        return GateSummary(summary.verdict, summary.reason + note, summary.results)
