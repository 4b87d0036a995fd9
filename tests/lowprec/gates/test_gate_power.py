"""lowprec.gates.power and the seed-spread gate, in memory (issue 33): known values, and verdicts that can fail."""

from __future__ import annotations

import math

import numpy as np
import pytest

from lowprec.gates import Gate, Scores, Tolerance, Verdict, summarize
from lowprec.gates.gate import Noise, check_spread
from lowprec.gates.power import clopper_pearson, detectable, headroom, metric_bounds
from lowprec.gates.stats import t_quantile


def test_clopper_pearson_matches_the_beta_quantiles():
    # reference values: scipy.stats.beta.ppf(0.025, k, n - k + 1) and beta.ppf(0.975, k + 1, n - k)
    assert clopper_pearson(0, 50) == pytest.approx((0.0, 0.0711217), abs=1e-6)
    assert clopper_pearson(2, 50) == pytest.approx((0.0048814, 0.1371376), abs=1e-6)
    assert clopper_pearson(3, 12) == pytest.approx((0.0548606, 0.5718585), abs=1e-6)
    assert clopper_pearson(50, 50)[1] == 1.0
    with pytest.raises(ValueError):
        clopper_pearson(3, 2)


def test_t_quantiles():
    assert t_quantile(0.975, 1) == pytest.approx(12.7062, abs=1e-3)
    assert t_quantile(0.975, 3) == pytest.approx(3.1824, abs=1e-3)
    assert t_quantile(0.975, 1000) == pytest.approx(1.9623, abs=1e-3)
    assert t_quantile(0.025, 5) == pytest.approx(-2.5706, abs=1e-3)


def test_detectable_regression_and_headroom():
    z, zp = 1.959964, 0.841621
    assert detectable(0.01, 0.002, 0.003) == pytest.approx(0.01 + z * 0.002 + zp * math.hypot(0.003, 0.002))
    assert detectable(0.01, 0.0) == pytest.approx(0.01)            # no noise at all: the tolerance itself
    assert detectable(0.01, 0.002, 0.006) > detectable(0.01, 0.002, 0.003)
    assert metric_bounds("eval/cloze_shakespeare/acc") == (0.0, 1.0)
    assert metric_bounds("eval/x/acc,none") == (0.0, 1.0)
    assert metric_bounds("eval/x/bits_per_byte") == (-math.inf, math.inf)
    assert headroom(0.001, "higher_is_better", (0.0, 1.0)) == pytest.approx(0.001)
    assert headroom(0.3, "lower_is_better", (0.0, 1.0)) == pytest.approx(0.7)


def test_power_of_a_paired_gate_grows_with_the_calibrated_noise():
    rng = np.random.default_rng(0)
    base = rng.gamma(20.0, 0.08, size=300)
    cand = base * (1 + rng.normal(0, 0.01, size=300))
    keys = [str(i) for i in range(300)]
    b = Scores.from_eval({"t": {"bpb": base.mean()}}, {"t": {"bpb": dict(zip(keys, base))}})
    c = Scores.from_eval({"t": {"bpb": cand.mean()}}, {"t": {"bpb": dict(zip(keys, cand))}})
    quiet = Gate("eval/t/bpb", "lower_is_better", Tolerance("relative", 0.01))
    noisy = Gate("eval/t/bpb", "lower_is_better", Tolerance("relative", 0.01), noise=Noise(0.01))
    rq, rn = quiet.with_power(quiet.check(b, c)), noisy.with_power(noisy.check(b, c))
    assert rq.allowed < rq.detectable < rn.detectable < math.inf
    assert "no calibrated noise" in rq.power_note and "calibrated noise sd" in rn.power_note


def _scores(v: float) -> Scores:
    return Scores.from_eval({"t": {"bpb": v}})


def test_seed_spread_verdicts():
    gate = Gate("eval/t/bpb", "lower_is_better", Tolerance("relative", 0.01))
    bases = [_scores(v) for v in (3.50, 3.52, 3.48, 3.51, 3.49)]      # mean 3.50, sd 0.0158
    inside = check_spread(gate, bases, _scores(3.53))
    assert inside.verdict is Verdict.INCONCLUSIVE and inside.n == 5
    half = t_quantile(0.975, 4) * np.std([3.50, 3.52, 3.48, 3.51, 3.49], ddof=1) * math.sqrt(1.2)
    assert inside.interval == pytest.approx((0.03 - half, 0.03 + half))
    assert check_spread(gate, bases, _scores(3.70)).verdict is Verdict.REGRESS
    assert check_spread(gate, bases, _scores(3.40)).verdict is Verdict.PASS
    assert check_spread(gate, bases, _scores(math.nan)).verdict is Verdict.REGRESS
    acc = Gate("eval/t/bpb", "higher_is_better", Tolerance("absolute", 0.0))
    assert check_spread(acc, bases, _scores(3.70)).verdict is Verdict.PASS     # higher is better: 3.70 is better


def test_informational_results_never_decide():
    gate = Gate("eval/t/bpb", "lower_is_better", Tolerance("relative", 0.01), informational=True)
    other = Gate("eval/t/x", "lower_is_better", Tolerance("relative", 0.5))
    b = Scores.from_eval({"t": {"bpb": 1.0, "bpb_stderr": 0.001, "x": 1.0, "x_stderr": 0.001}})
    c = Scores.from_eval({"t": {"bpb": 2.0, "bpb_stderr": 0.001, "x": 1.0, "x_stderr": 0.001}})
    r = [gate.check(b, c), other.check(b, c)]
    assert r[0].verdict is Verdict.REGRESS and r[0].informational
    s = summarize(r)
    assert s.verdict is Verdict.PASS and "1 informational not counted" in s.reason


def test_seed_spread_reason_prints_no_float_noise():
    gate = Gate("eval/t/bpb", "lower_is_better", Tolerance("relative", 0.01))
    bases = [_scores(v) for v in (0.8 + 0.16, math.nan)]    # 0.9600000000000001 as computed
    r = check_spread(gate, bases, _scores(3.5))
    assert r.verdict is Verdict.INCONCLUSIVE and "not finite (0.96, nan)" in r.reason, r.reason
