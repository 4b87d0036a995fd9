"""Decisions from numbers: gate files, the statistics behind a verdict, and reading runs.

    from lowprec.gates import GateSpec, Scores, check_all, summarize
    spec = GateSpec.from_yaml("default")    # a gate file shipped with this package, by name; or a path
    summary = summarize(check_all(spec, Scores.from_eval(base_results, base_samples),
                                  Scores.from_eval(cand_results, cand_samples)))
    summary.verdict, summary.reason        # Verdict.PASS | .REGRESS | .INCONCLUSIVE (lowprec.policy.verdicts)

Modules: `spec` (gate files), `scores` (what is compared), `stats` (intervals), `gate` (verdicts),
`runs` (MLflow runs -> Scores), `report` (table, Markdown, JUnit), `cli` (`lowprec gate`).
The in-memory API needs no MLflow (the rollout controller uses it in the training loop);
`lowprec.gates.runs` imports MLflow when it reads a run. The gate files themselves (YAML) are
package data, `lowprec.gates.files` (the repository's top-level `gates/` folder), found by name.
No other layer imports this package: the CLI finds `cli.register` and the runtime finds
`inloop.GateFileChecker` through entry points (pyproject.toml).

May import: lowprec.tracking, lowprec.policy, lowprec.base.
"""

from lowprec.gates.errors import GateInputError, GateSpecError
from lowprec.gates.gate import (HIGHER_IS_BETTER, LOWER_IS_BETTER, Gate, GateResult, GateSummary, Tolerance,
                                check_all, step_gate, summarize)
from lowprec.gates.scores import MetricScores, Scores
from lowprec.gates.spec import GateSpec
from lowprec.policy.verdicts import Verdict

__all__ = ["GateSpec", "Gate", "Tolerance", "GateResult", "GateSummary", "Scores", "MetricScores", "check_all",
           "summarize", "step_gate", "GateSpecError", "GateInputError", "Verdict",
           "LOWER_IS_BETTER", "HIGHER_IS_BETTER"]
