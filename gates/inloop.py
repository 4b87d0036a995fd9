"""The in-loop gate of lowprec's training runtime (entry point `lowprec.gate_checkers`: default).

`EvalCheckpoints` evaluates the model as trained and the same weights in high precision;
this checker compares the two with a gate file (`eval.gates`), example by example, and
returns a `GateSummary` (a `Verdict` and a reason) that the rollout controller acts on.
"""

from __future__ import annotations

from pathlib import Path

from gates.gate import GateSummary, check_all, summarize
from gates.scores import Scores
from gates.spec import GateSpec

__all__ = ["GateFileChecker"]


class GateFileChecker:
    """`check(high_precision, as_trained)` against the gates of one gate file."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"eval.gates: gate file {str(path)!r} not found; give a gate file (see "
                                    f"docs/gates.md) or null for no in-loop gate")
        self.spec = GateSpec.from_yaml(self.path)
        self.metrics = tuple(self.spec.metrics)

    def check(self, baseline, candidate) -> GateSummary:
        return summarize(check_all(self.spec, Scores.from_eval(baseline.results, baseline.samples,
                                                               source="high precision"),
                                   Scores.from_eval(candidate.results, candidate.samples, source="as trained")))
