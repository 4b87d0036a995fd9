"""Intervals for the difference between two models' eval scores (numpy only, no scipy).

Two ways, chosen by what the evaluation kept:

* `paired_bootstrap_interval(diffs, ...)`: per-example differences (candidate minus baseline
  on the same example, oriented by the caller), resampled with replacement `n_boot` times; the
  interval is the central `confidence` percentile interval of the resampled means. Pairing
  removes the between-example variance both models share (Miller, "Adding Error Bars to
  Evals", arXiv 2411.00640), which is most of it: two checkpoints of one model agree on which
  questions are hard. Seeded (`numpy.random.default_rng(seed)`), vectorised in chunks of about
  4M gathered elements so memory stays bounded for large n.
* `normal_interval(delta, se_baseline, se_candidate, ...)`: when only the aggregate values and
  their standard errors exist, the two are treated as independent samples:
  delta +- z * sqrt(se_b^2 + se_c^2). This is conservative when the two runs were evaluated on
  the same examples (it ignores their positive correlation), so it more often says
  "inconclusive" than the paired interval would.

Both return a two-sided central interval at level `confidence` (see lowprec.gates.gate for how the
verdicts read it).
"""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np

# the two directions a gated metric can have (a gate file's `direction:`)
LOWER_IS_BETTER, HIGHER_IS_BETTER = "lower_is_better", "higher_is_better"

__all__ = ["z_value", "t_quantile", "t_cdf", "normal_interval", "paired_bootstrap_interval", "paired_differences", "CHUNK_ELEMENTS"]

CHUNK_ELEMENTS = 1 << 22  # gathered elements per bootstrap chunk (32 MiB of float64)


def _check_confidence(confidence: float) -> None:
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence}")


def z_value(confidence: float) -> float:
    """The standard normal quantile of a two-sided central interval: 1.96 for 0.95."""
    _check_confidence(confidence)
    return NormalDist().inv_cdf(0.5 + confidence / 2)


def normal_interval(delta: float, se_baseline: float, se_candidate: float, confidence: float) -> tuple[float, float]:
    """delta +- z * sqrt(se_b^2 + se_c^2): the difference of two independent estimates."""
    half = z_value(confidence) * math.hypot(se_baseline, se_candidate)
    return delta - half, delta + half


def paired_differences(baseline: dict[str, float], candidate: dict[str, float], sign: float
                       ) -> tuple[np.ndarray, dict[str, int]]:
    """`sign * (candidate - baseline)` over the keys both have, in sorted key order, pairs with a
    non-finite score left out; plus counts (`shared`, `only_baseline`, `only_candidate`, `nonfinite`)."""
    shared = sorted(baseline.keys() & candidate.keys())
    b = np.fromiter((baseline[k] for k in shared), dtype=np.float64, count=len(shared))
    c = np.fromiter((candidate[k] for k in shared), dtype=np.float64, count=len(shared))
    ok = np.isfinite(b) & np.isfinite(c)
    counts = {"shared": int(ok.sum()), "only_baseline": len(baseline) - len(shared),
              "only_candidate": len(candidate) - len(shared), "nonfinite": int((~ok).sum())}
    return sign * (c[ok] - b[ok]), counts


def paired_bootstrap_interval(diffs: np.ndarray, confidence: float, n_boot: int = 2000, seed: int = 0
                              ) -> tuple[float, float]:
    """Central percentile interval of the bootstrap distribution of `diffs.mean()`."""
    _check_confidence(confidence)
    d = np.asarray(diffs, dtype=np.float64).ravel()
    n = d.size
    if n == 0:
        raise ValueError("a bootstrap needs at least one paired difference")
    if n_boot < 1:
        raise ValueError(f"n_boot must be >= 1, got {n_boot}")
    if np.all(d == d[0]):  # no spread: every resample has the same mean (exactly, not up to rounding)
        return float(d[0]), float(d[0])
    rng = np.random.default_rng(seed)
    means = np.empty(n_boot, dtype=np.float64)
    rows = max(1, CHUNK_ELEMENTS // n)
    for start in range(0, n_boot, rows):
        k = min(rows, n_boot - start)
        means[start:start + k] = d[rng.integers(0, n, size=(k, n))].mean(axis=1)
    alpha = (1.0 - confidence) / 2
    lo, hi = np.quantile(means, [alpha, 1.0 - alpha])
    return float(lo), float(hi)


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the regularized incomplete beta function (Lentz's method)."""
    tiny, qab, qap, qam = 1e-300, a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 300):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x))
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _betacf(a, b, x) / a
    return 1.0 - front * _betacf(b, a, 1.0 - x) / b


def t_cdf(t: float, df: int) -> float:
    """Student's t distribution function with `df` degrees of freedom."""
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t >= 0 else tail


def t_quantile(p: float, df: int) -> float:
    """The p-quantile of Student's t (12.71 for p 0.975 and 1 degree of freedom; 1.96 as df grows)."""
    if not 0.0 < p < 1.0 or df < 1:
        raise ValueError(f"need 0 < p < 1 and df >= 1, got p={p}, df={df}")
    lo, hi = -1e6, 1e6
    for _ in range(200):
        mid = (lo + hi) / 2
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2
