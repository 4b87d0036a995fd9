"""The in-loop gate's error budget (issue 33): a run that checks many times is rolled back by luck
at most at the configured rate, however many stages it has.

Simulated scores: per-document bits per byte of the high-precision model, and the model as
trained exactly 2% worse on average (the tolerance: the worst harmless case, where a gate at
confidence 0.95 says `regress` 2.5% of the time), with per-document noise. Each simulated run
makes 12 checks (10 stage promotions, a periodic eval, the final one) through the real
GateFileChecker and gate file; it is "held back" when any check regresses (the controller then
rolls a stage back). With `error_budget: {alpha: 0.05}` at most ~5% of runs are held back; the
same checker without the budget holds back about a quarter of them (1 - 0.975^12 = 26%), so the
test can fail.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from lowprec.gates.budget import ErrorBudget
from lowprec.gates.errors import GateSpecError
from lowprec.gates.inloop import GateFileChecker
from lowprec.gates.power import clopper_pearson
from lowprec.gates.spec import GateSpec
from lowprec.policy.verdicts import Verdict

GATE = """
defaults: {statistic: paired_bootstrap, confidence: 0.95, min_samples: 8, bootstrap_samples: 1000, seed: 0}
gates:
  - metric: eval/t/bits_per_byte
    direction: lower_is_better
    max_regression: {relative: 0.02}
"""
N_DOCS, CHECKS, RUNS, ALPHA = 200, 12, 200, 0.05


def _outcome(bpb: np.ndarray) -> SimpleNamespace:
    keys = [f"d{i}" for i in range(bpb.size)]
    return SimpleNamespace(results={"t": {"bits_per_byte": float(bpb.mean())}},
                           samples={"t": {"bits_per_byte": dict(zip(keys, bpb.tolist()))}})


def _held_back(checker_for, runs: int = RUNS) -> int:
    held = 0
    for seed in range(runs):
        rng = np.random.default_rng(seed)
        checker = checker_for()
        checker.plan_checks(CHECKS)            # what `lowprec run` tells it (lowprec.runtime.trainer.run.prepare_run)
        bad = False
        for _ in range(CHECKS):
            hp = rng.gamma(20.0, 0.08, size=N_DOCS)
            as_trained = hp * 1.02 + rng.normal(0.0, 0.05, size=N_DOCS)   # true regression = the tolerance
            bad |= checker.check(_outcome(hp), _outcome(as_trained)).verdict is Verdict.REGRESS
        held += bad
    return held


def test_many_checks_hold_a_harmless_run_back_at_most_at_the_budget(tmp_path):
    plain = tmp_path / "plain.yaml"
    plain.write_text(GATE)
    budget = tmp_path / "budget.yaml"
    budget.write_text(GATE + f"error_budget: {{alpha: {ALPHA}}}\n")
    with_budget = _held_back(lambda: GateFileChecker(budget))
    lo, hi = clopper_pearson(with_budget, RUNS)
    assert lo <= ALPHA, f"{with_budget}/{RUNS} harmless runs held back: more than {ALPHA:.0%} (CI {lo:.3f}-{hi:.3f})"
    without = _held_back(lambda: GateFileChecker(plain), runs=80)
    assert clopper_pearson(without, 80)[0] > ALPHA, f"without a budget only {without}/80 were held back"
    print(f"held back: {with_budget}/{RUNS} with the budget, {without}/80 without")


def test_budget_shares_sum_to_alpha_and_reach_the_checker(tmp_path):
    b = ErrorBudget(0.05)
    planned = 7
    assert sum(b.share(i, planned) for i in range(1, 200)) <= 0.05 + 1e-12   # unplanned extra checks included
    assert b.share(1, planned) == pytest.approx(0.05 / 8)
    assert b.confidence(1, planned, gates=3) == pytest.approx(1 - 2 * 0.05 / 8 / 3)
    path = tmp_path / "g.yaml"
    path.write_text(GATE + "error_budget: {alpha: 0.05}\n")
    checker = GateFileChecker(path)
    checker.plan_checks(planned)
    rng = np.random.default_rng(0)
    hp = rng.gamma(20.0, 0.08, size=N_DOCS)
    summary = checker.check(_outcome(hp), _outcome(hp * 1.001))
    assert "check 1 of 7 planned" in summary.reason and f"{1 - 2 * 0.05 / 8:.5g}" in summary.reason
    for bad, part in (("{alpha: 0.7}", "between 0 and 0.5"), ("{alpha: 0.05, planned: 3}", "Did you mean"),
                      ("{alpha: 0.05, planned_checks: 0}", ">= 1")):
        with pytest.raises(GateSpecError, match="error_budget") as e:
            GateSpec.from_dict({"gates": [{"metric": "m", "direction": "lower_is_better",
                                           "max_regression": {"relative": 0.1}}],
                                "error_budget": __import__("yaml").safe_load(bad)}, source="g.yaml")
        assert part in str(e.value)


def test_lowprec_run_tells_the_checker_how_many_checks_it_plans(monkeypatch):
    """The hook in lowprec.runtime.trainer.run.prepare_run: stages + periodic evals + the final one."""
    from pathlib import Path

    from lowprec.config import LowprecConfig
    from lowprec.runtime.trainer import run as runmod
    import yaml

    root = Path(__file__).resolve().parents[3]
    monkeypatch.chdir(root)
    d = yaml.safe_load((root / "experiments" / "configs" / "default.yaml").read_text())
    d["rollout"].pop("baseline")                      # no BF16 loss curve here: no loss-gap detector
    d["rollout"]["thresholds"].pop("loss_gap")
    cfg = LowprecConfig.from_dict(d)
    prepared = runmod.prepare_run(cfg, with_data=False)
    checker = prepared.evals.checker
    # 3 stages, periodic evals at 150 (of 300 steps), the final one
    assert isinstance(checker, GateFileChecker) and checker.planned == 3 + 1 + 1


def test_a_resumed_run_continues_the_budget_where_its_checkpoint_left_it(tmp_path):
    """The checks made are saved with a checkpoint (the loop's AfterStep state, `extra` of
    lowprec.state.checkpoint) and restored: the check after a resume is the 4th of 5, not the 1st."""
    import torch

    from lowprec.runtime.session.after_step import AfterStep
    from lowprec.runtime.session.evals import EvalCheckpoints
    from lowprec.state.durable import check_plain

    path = tmp_path / "g.yaml"
    path.write_text(GATE + "error_budget: {alpha: 0.05}\n")
    evaluator, state = SimpleNamespace(tasks=["t"]), SimpleNamespace(formats=dict)

    def run_parts():
        checker = GateFileChecker(path)
        checker.plan_checks(5)
        return checker, AfterStep(None, None, evals=EvalCheckpoints(SimpleNamespace(every=0), evaluator, checker, state))

    rng = np.random.default_rng(0)
    hp = rng.gamma(20.0, 0.08, size=N_DOCS)
    checker, after = run_parts()
    for _ in range(3):
        checker.check(_outcome(hp), _outcome(hp))
    saved = after.state_dict()
    check_plain(saved, "extra")
    torch.save(saved, tmp_path / "extra.pt")
    checker, after = run_parts()   # the resumed process
    after.load_state_dict(torch.load(tmp_path / "extra.pt", weights_only=True))
    assert "check 4 of 5 planned" in checker.check(_outcome(hp), _outcome(hp)).reason
