"""The gate statistics against independent computations, and the verdict rule's promises.

* The bootstrap of a 0/1 difference has a known distribution (Binomial(n, p)/n), so its
  percentile interval is checked against binomial quantiles computed here with math.comb.
* For large n the bootstrap interval approaches mean +- z * sd / sqrt(n).
* The normal interval is delta +- z * sqrt(se_b^2 + se_c^2) with z from the normal quantile.
* Properties (hypothesis): identical runs never regress, by either statistic; a candidate
  worse by more than the tolerance plus a clear margin regresses when n is large; one better
  by a clear margin passes.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lowprec.gates.stats as gstats
from lowprec.gates import (HIGHER_IS_BETTER, LOWER_IS_BETTER, Gate, GateInputError, MetricScores, Scores, Tolerance,
                           check_all, summarize)
from lowprec.gates.stats import normal_interval, paired_bootstrap_interval, z_value
from lowprec.policy.verdicts import Verdict

FAST = settings(max_examples=40, deadline=None)


def _binom_quantile(q: float, n: int, p: float) -> int:
    """Smallest k with P(Binomial(n, p) <= k) >= q, from the exact pmf."""
    acc = 0.0
    for k in range(n + 1):
        acc += math.comb(n, k) * p ** k * (1 - p) ** (n - k)
        if acc >= q - 1e-12:
            return k
    return n


def test_bootstrap_of_a_zero_one_difference_matches_binomial_quantiles():
    n, ones = 200, 60                           # 30% of the paired differences are 1, the rest 0
    d = np.array([1.0] * ones + [0.0] * (n - ones))
    lo, hi = paired_bootstrap_interval(d, 0.95, n_boot=20000, seed=1)
    want_lo, want_hi = _binom_quantile(0.025, n, 0.3) / n, _binom_quantile(0.975, n, 0.3) / n
    assert abs(lo - want_lo) <= 1.0 / n + 1e-12 and abs(hi - want_hi) <= 1.0 / n + 1e-12


def test_bootstrap_approaches_the_normal_interval_for_large_n():
    rng = np.random.default_rng(7)
    d = rng.normal(0.3, 2.0, size=10000)
    lo, hi = paired_bootstrap_interval(d, 0.95, n_boot=3000, seed=0)
    half = 1.959964 * d.std() / math.sqrt(d.size)   # the plug-in sd: what the bootstrap resamples
    assert lo == pytest.approx(d.mean() - half, abs=0.06 * half)  # Monte Carlo error of a 2.5% quantile, B=3000: ~3%
    assert hi == pytest.approx(d.mean() + half, abs=0.06 * half)


def test_bootstrap_is_seeded_and_independent_of_the_chunk_size(monkeypatch):
    d = np.random.default_rng(0).normal(size=300)
    a = paired_bootstrap_interval(d, 0.9, n_boot=1000, seed=5)
    assert a == paired_bootstrap_interval(d, 0.9, n_boot=1000, seed=5)
    monkeypatch.setattr(gstats, "CHUNK_ELEMENTS", 300 * 7)   # 7 resamples per chunk instead of all
    assert a == paired_bootstrap_interval(d, 0.9, n_boot=1000, seed=5)
    assert a != paired_bootstrap_interval(d, 0.9, n_boot=1000, seed=6)


def test_normal_interval_and_z():
    assert z_value(0.95) == pytest.approx(1.959964, abs=1e-6) and z_value(0.9) == pytest.approx(1.644854, abs=1e-6)
    lo, hi = normal_interval(0.5, 0.3, 0.4, 0.95)
    assert (lo, hi) == pytest.approx((0.5 - 1.959964 * 0.5, 0.5 + 1.959964 * 0.5), abs=1e-6)


# ------------------------------------------------------------------ gates on in-memory scores
def _scores(values: dict[str, float], stderr: float | None = None, metric: str = "eval/t/m") -> Scores:
    arr = list(values.values())
    return Scores({metric: MetricScores(sum(arr) / len(arr), stderr, values)})


def _gate(direction=LOWER_IS_BETTER, tol=Tolerance("absolute", 0.0), **kw) -> Gate:
    return Gate("eval/t/m", direction, tol, bootstrap_samples=kw.pop("bootstrap_samples", 300), **kw)


@FAST
@given(scores=st.lists(st.floats(-1e6, 1e6, allow_nan=False), min_size=1, max_size=80),
       tol=st.floats(0, 1), direction=st.sampled_from([LOWER_IS_BETTER, HIGHER_IS_BETTER]),
       kind=st.sampled_from(["absolute", "relative"]), confidence=st.floats(0.51, 0.999),
       stderr=st.floats(0, 1e3))
def test_identical_runs_never_regress(scores, tol, direction, kind, confidence, stderr):
    s = _scores({f"k{i}": v for i, v in enumerate(scores)}, stderr)
    for statistic in ("paired_bootstrap", "stderr"):
        g = _gate(direction, Tolerance(kind, tol), statistic=statistic, confidence=confidence, min_samples=1)
        r = g.check(s, s)
        assert r.verdict != Verdict.REGRESS, r.reason
        if statistic == "paired_bootstrap":
            assert r.verdict == Verdict.PASS and r.delta == 0 and r.interval == (0.0, 0.0)


@FAST
@given(seed=st.integers(0, 2**32 - 1), tol=st.floats(0, 0.5), extra=st.floats(0, 2),
       direction=st.sampled_from([LOWER_IS_BETTER, HIGHER_IS_BETTER]), noise=st.floats(0.01, 1.0))
def test_a_shift_beyond_tolerance_plus_margin_regresses_and_one_below_passes(seed, tol, extra, direction, noise):
    n = 2000
    rng = np.random.default_rng(seed)
    base = rng.normal(1.0, 1.0, size=n)             # per-example difficulty, shared by both runs
    jitter = rng.normal(0.0, noise, size=n)         # per-example change the candidate makes
    margin = 8 * noise / math.sqrt(n)               # far beyond the interval's half width (about 2 sd)
    worse = 1.0 if direction == LOWER_IS_BETTER else -1.0
    keys = [f"q{i}" for i in range(n)]
    b = _scores(dict(zip(keys, base)))
    g = _gate(direction, Tolerance("absolute", tol), min_samples=100)
    bad = _scores(dict(zip(keys, base + jitter + worse * (tol + margin + extra))))
    r = g.check(b, bad)
    assert r.verdict == Verdict.REGRESS and r.n == n, r.reason
    assert "eval/t/m" in r.reason and "regression" in r.reason and f"{tol:.4g}" in r.reason
    good = _scores(dict(zip(keys, base + jitter + worse * (tol - margin - extra))))
    assert g.check(b, good).verdict == Verdict.PASS


def test_relative_tolerance_direction_and_stderr_fallback():
    b = Scores.from_eval({"t": {"acc,none": 0.50, "acc_stderr,none": 0.01}})
    c = Scores.from_eval({"t": {"acc,none": 0.40, "acc_stderr,none": 0.01}})
    g = Gate("eval/t/acc", HIGHER_IS_BETTER, Tolerance("relative", 0.1))   # allowed: 10% of 0.5 = 0.05
    r = g.check(b, c)
    assert r.statistic == "stderr" and r.allowed == pytest.approx(0.05) and r.delta == pytest.approx(0.1)
    half = z_value(0.95) * math.hypot(0.01, 0.01)
    assert r.interval == pytest.approx((0.1 - half, 0.1 + half))
    assert r.verdict == Verdict.REGRESS and "no per-example scores in the baseline and candidate" in r.reason
    assert g.check(c, b).verdict == Verdict.PASS       # the other way round it improved
    loose = Gate("eval/t/acc", HIGHER_IS_BETTER, Tolerance("absolute", 0.09))
    assert loose.check(b, c).verdict == Verdict.INCONCLUSIVE


def test_inconclusive_cases_say_why():
    keys = {f"k{i}": float(i % 2) for i in range(40)}
    g = _gate(min_samples=50)
    r = g.check(_scores(keys), _scores({**keys, "extra": 1.0}))
    assert r.verdict == Verdict.INCONCLUSIVE and r.n == 40 and "fewer than min_samples 50" in r.reason
    assert "1 only candidate" in r.reason
    no_se = Scores({"eval/t/m": MetricScores(1.0)})
    r = g.check(no_se, no_se)
    assert r.verdict == Verdict.INCONCLUSIVE and "the baseline and the candidate have neither a stderr" in r.reason
    r = g.check(Scores({"eval/t/m": MetricScores(1.0, 0.1)}), no_se)
    assert "the candidate has neither a stderr" in r.reason
    nan = Scores({"eval/t/m": MetricScores(math.nan, 0.1)})
    ok = Scores({"eval/t/m": MetricScores(1.0, 0.1)})
    assert g.check(ok, nan).verdict == Verdict.REGRESS and g.check(nan, ok).verdict == Verdict.INCONCLUSIVE
    with pytest.raises(GateInputError, match=r"no metric 'eval/t/x'.*Did you mean 'eval/t/m'"):
        Gate("eval/t/x", LOWER_IS_BETTER, Tolerance("absolute", 0)).check(ok, ok)


def test_summary_rule():
    ok = Scores({"eval/a/m": MetricScores(1.0, 0.001), "eval/b/m": MetricScores(1.0, 0.001),
                 "eval/c/m": MetricScores(1.0, 0.5)})
    worse = Scores({"eval/a/m": MetricScores(1.0, 0.001), "eval/b/m": MetricScores(2.0, 0.001),
                    "eval/c/m": MetricScores(1.1, 0.5)})
    tol = Tolerance("absolute", 0.01)
    pass_, regress, unsure = (Gate(f"eval/{t}/m", LOWER_IS_BETTER, tol) for t in "abc")
    assert summarize(check_all([pass_], ok, worse)).verdict == Verdict.PASS
    assert summarize(check_all([pass_, unsure], ok, worse)).verdict == Verdict.INCONCLUSIVE
    s = summarize(check_all([pass_, unsure, regress], ok, worse))
    assert s.verdict == Verdict.REGRESS and "eval/b/m" in s.reason and len(s.results) == 3


def test_scores_from_eval_shapes():
    s = Scores.from_eval({"t": {"acc,none": 0.5, "acc_stderr,none": "N/A", "alias": "t"}},
                         {"t": {"acc,none": {"a": 1, "b": 0}}, "u": {"bpb": {"a": 1.0, "b": 3.0}}}, prefix="eval_hp")
    assert s.names() == ["eval_hp/t/acc", "eval_hp/u/bpb"]
    acc, bpb = s.get("eval_hp/t/acc"), s.get("eval_hp/u/bpb")
    assert (acc.value, acc.stderr, acc.samples) == (0.5, None, {"a": 1.0, "b": 0.0})
    assert acc.stderr_estimate() == pytest.approx(0.5)            # sd 0.7071 / sqrt(2)
    assert bpb.value == 2.0 and bpb.n == 2                        # no value logged: the mean of the samples
    with pytest.raises(GateInputError, match=r"samples\['t'\]\['acc'\] must be \{example key: score\}"):
        Scores.from_eval({}, {"t": {"acc": [1, 0]}})
    with pytest.raises(GateInputError, match="standard error must be a finite number >= 0"):
        MetricScores(1.0, -0.1)
