"""Error rates of gates: Clopper-Pearson intervals, the power of a gate, and immovable metrics.

* `clopper_pearson(k, n)`: the exact (conservative) two-sided interval for a binomial rate
  from k events in n trials, e.g. k false alarms in n calibration pairs. Computed by bisection
  on the binomial tail (no scipy): 0/50 gives [0, 7.1%], 2/50 gives [0.5%, 13.7%].
* `detectable(...)`: the smallest true regression a gate calls `regress` with probability
  `power` (80% by default). A gate regresses when the lower end of its interval,
  delta - z * se, exceeds the allowed regression a. Between two runs whose numerics are
  harmless the measured regression is not 0: it is spread with the calibrated noise
  (`noise:` in the gate file, the sd between runs measured by experiments/gate_calibration.py)
  plus the eval's own sampling error se (set by the eval set's size, read from the comparison
  at hand). With delta ~ Normal(r + mean, sd_between^2 + se^2):

      P(delta - z*se > a) = power  <=>  r = a - mean + z*se + z_power * sqrt(sd_between^2 + se^2)

  in the metric's units (callers pass relative quantities for relative tolerances).
* `headroom(...)`: how far a metric can still get worse before it hits its bound (an accuracy
  of 0.001 can lose 0.001 at most). A gate whose headroom is no more than its allowed
  regression cannot fire whatever the candidate does, and is refused.
"""

from __future__ import annotations

import math
from statistics import NormalDist

from lowprec.gates.stats import HIGHER_IS_BETTER

__all__ = ["clopper_pearson", "detectable", "headroom", "metric_bounds", "POWER"]

POWER = 0.8
UNIT_INTERVAL_METRICS = ("acc", "acc_norm", "accuracy", "exact_match", "f1", "mc1", "mc2", "goodput")


def _binom_cdf(k: int, n: int, p: float) -> float:
    """P(X <= k) for X ~ Binomial(n, p), summed in log space."""
    if p <= 0.0:
        return 1.0
    if p >= 1.0:
        return 1.0 if k >= n else 0.0
    lp, lq = math.log(p), math.log1p(-p)
    return min(1.0, sum(math.exp(math.lgamma(n + 1) - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp
                                 + (n - i) * lq) for i in range(0, k + 1)))


def _solve(f, target: float, increasing: bool) -> float:
    lo, hi = 0.0, 1.0
    for _ in range(100):
        mid = (lo + hi) / 2
        if (f(mid) < target) == increasing:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def clopper_pearson(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """The exact two-sided interval for a rate of k events in n trials."""
    if n < 1 or not 0 <= k <= n:
        raise ValueError(f"need 0 <= k <= n and n >= 1, got k={k}, n={n}")
    a = (1.0 - confidence) / 2
    lower = 0.0 if k == 0 else _solve(lambda p: 1.0 - _binom_cdf(k - 1, n, p), a, increasing=True)
    upper = 1.0 if k == n else _solve(lambda p: _binom_cdf(k, n, p), a, increasing=False)
    return lower, upper


def detectable(allowed: float, se: float, sd_between: float = 0.0, mean: float = 0.0, confidence: float = 0.95,
               power: float = POWER) -> float:
    """The smallest true regression called `regress` with probability `power` (see the module)."""
    z = NormalDist().inv_cdf((1.0 + confidence) / 2)
    zp = NormalDist().inv_cdf(power)
    return allowed - mean + z * se + zp * math.sqrt(sd_between ** 2 + se ** 2)


def metric_bounds(metric: str) -> tuple[float, float]:
    """The values a metric can take, from its name: accuracies in [0, 1], else unbounded."""
    name = metric.rsplit("/", 1)[-1].split(",")[0]
    if name in UNIT_INTERVAL_METRICS:
        return 0.0, 1.0
    return -math.inf, math.inf


def headroom(value: float, direction: str, bounds: tuple[float, float]) -> float:
    """How much worse than `value` the metric can still get (inf when unbounded that way)."""
    return value - bounds[0] if direction == HIGHER_IS_BETTER else bounds[1] - value
