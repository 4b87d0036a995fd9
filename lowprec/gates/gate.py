"""One gate: is the candidate worse than the baseline on one metric by more than allowed?

    gate = Gate("eval/heldout_shakespeare/bits_per_byte", LOWER_IS_BETTER, Tolerance("relative", 0.02))
    result = gate.check(baseline, candidate)        # Scores -> GateResult
    result.verdict, result.reason                   # a Verdict (pass | regress | inconclusive), one sentence

The quantity tested is the *regression* r, in the metric's units, oriented so that positive
means worse: r = candidate - baseline for `lower_is_better`, baseline - candidate for
`higher_is_better`. The allowed regression is `max_regression`: an absolute amount, or a
fraction of |baseline value|. From a two-sided central interval [lo, hi] for r at level
`confidence` (paired bootstrap over per-example scores, or a normal interval from the two
stderrs; see lowprec.gates.stats):

* `regress`      when lo > allowed   (the whole interval lies above the allowed regression),
* `pass`         when hi <= allowed  (the whole interval lies at or below it),
* `inconclusive` otherwise           (the data cannot tell; evaluate on more examples).

Why a two-sided interval read one side at a time: each verdict is then a one-sided test at
level (1 + confidence) / 2. With confidence 0.95, a candidate whose true regression is exactly
the allowed one is called `regress` at most 2.5% of the time, and one that is truly worse than
allowed is called `pass` at most 2.5% of the time; the remaining mass is `inconclusive`, which
is the honest answer for an eval too small to decide. Identical runs never regress (r = 0 <=
allowed). A non-finite candidate value (NaN/Inf) is a regression; a non-finite baseline makes
the gate inconclusive.

With per-example scores, `delta` is the mean of the paired differences (the point the bootstrap
interval is built around), which equals the difference of the aggregates for mean metrics such
as accuracy; for ratio metrics (bits per byte over documents of different lengths) it is the
per-example mean and can differ slightly from the aggregate difference shown next to it.

`check_all(spec, baseline, candidate)` runs every gate of a file; `summarize(results)` gives the
overall verdict (any regress -> regress; else any inconclusive -> inconclusive; else pass), the
object the rollout controller's `gate(step)` callable returns (a `lowprec.policy.verdicts.GateOutcome`:
it reads `.verdict`, `.reason`). Verdicts are `lowprec.policy.verdicts.Verdict` members, str-valued.
"""

from __future__ import annotations

import math
from statistics import NormalDist
from dataclasses import asdict, dataclass
from typing import Callable, Iterable

from lowprec.gates.errors import GateInputError, spec_error
from lowprec.gates.scores import MetricScores, Scores
from lowprec.gates.tolerance import Noise, Tolerance, _choice, _integer, _number
from lowprec.gates.stats import (HIGHER_IS_BETTER, LOWER_IS_BETTER, normal_interval, paired_bootstrap_interval,
                                 paired_differences)
from lowprec.policy.verdicts import Verdict

__all__ = ["LOWER_IS_BETTER", "HIGHER_IS_BETTER", "DIRECTIONS",
           "PAIRED_BOOTSTRAP", "STDERR", "STATISTICS", "Tolerance", "Noise", "Gate", "GateResult", "GateSummary",
           "check_all", "check_spread", "summarize", "step_gate", "SEED_SPREAD"]

DIRECTIONS = (LOWER_IS_BETTER, HIGHER_IS_BETTER)
PAIRED_BOOTSTRAP, STDERR = "paired_bootstrap", "stderr"
SEED_SPREAD = "seed_spread"   # several baselines (check_spread), not a gate file value
STATISTICS = (PAIRED_BOOTSTRAP, STDERR)


@dataclass(frozen=True)
class GateResult:
    """One gate's answer. `delta` and `interval` are the regression (positive = worse), in metric
    units; `allowed` is the allowed regression in the same units; `n` the paired examples (None
    for the stderr statistic); `statistic` what was used (`paired_bootstrap` or `stderr`)."""

    verdict: Verdict
    metric: str
    delta: float | None
    interval: tuple[float, float] | None
    reason: str
    n: int | None
    baseline_value: float | None
    candidate_value: float | None
    statistic: str
    allowed: float | None = None
    tolerance: str = ""
    direction: str = ""
    confidence: float | None = None
    informational: bool = False       # reported, never fails the comparison
    detectable: float | None = None   # smallest regression caught with 80% probability (metric units)
    power_note: str = ""              # how `detectable` was formed

    def to_dict(self) -> dict:
        """Plain data (the verdict as its string value)."""
        return {**asdict(self), "verdict": self.verdict.value}


@dataclass(frozen=True)
class GateSummary:
    """All gates together: `verdict` (any regress -> regress; else any inconclusive ->
    inconclusive; else pass), a one-line `reason`, and every GateResult."""

    verdict: Verdict
    reason: str
    results: tuple[GateResult, ...]


@dataclass(frozen=True)
class Gate:
    """One metric's gate (a row of a gate file; `lowprec.gates.spec` builds these from YAML)."""

    metric: str
    direction: str
    max_regression: Tolerance
    statistic: str = PAIRED_BOOTSTRAP
    confidence: float = 0.95
    min_samples: int = 30
    bootstrap_samples: int = 2000
    seed: int = 0
    informational: bool = False        # checked and reported, but never makes the comparison regress
    noise: Noise | None = None         # calibrated run-to-run noise (for the gate's power)
    bounds: tuple[float | None, float | None] | None = None   # the values the metric can take (null: unbounded)

    def __post_init__(self):
        if not isinstance(self.metric, str) or not self.metric.strip() or self.metric != self.metric.strip():
            raise spec_error(f"must be a metric name such as 'eval/heldout_shakespeare/bits_per_byte' "
                                f"(no surrounding spaces), got {self.metric!r}", key="metric")
        _choice(self.direction, "direction", DIRECTIONS)
        if not isinstance(self.max_regression, Tolerance):
            raise spec_error(f"must be a Tolerance, got {self.max_regression!r}", key="max_regression")
        _choice(self.statistic, "statistic", STATISTICS)
        c = _number(self.confidence, "confidence")
        if not 0.5 < c < 1.0:
            raise spec_error(f"must lie strictly between 0.5 and 1 (e.g. 0.95), got {c}", key="confidence")
        object.__setattr__(self, "confidence", c)
        _integer(self.min_samples, "min_samples", 1, 10**9)
        _integer(self.bootstrap_samples, "bootstrap_samples", 100, 10**6)
        _integer(self.seed, "seed", 0, 2**63 - 1)
        if not isinstance(self.informational, bool):
            raise spec_error(f"must be true or false, got {self.informational!r}", key="informational")
        if self.noise is not None and not isinstance(self.noise, Noise):
            raise spec_error(f"must be a Noise, got {self.noise!r}", key="noise")
        if self.bounds is not None:
            b = self.bounds
            if isinstance(b, (str, bytes)) or not hasattr(b, "__len__") or len(b) != 2:
                raise spec_error(f"must be [lowest, highest] (e.g. [0, 1] for an accuracy), got {b!r}",
                                    key="bounds")
            lo, hi = (-math.inf if b[0] is None else b[0]), (math.inf if b[1] is None else b[1])
            for x in (lo, hi):
                if isinstance(x, bool) or not isinstance(x, (int, float)) or math.isnan(x):
                    raise spec_error(f"must be two numbers (null for unbounded), got {b!r}", key="bounds")
            if not lo < hi:
                raise spec_error(f"the lowest value must be below the highest, got {b!r}", key="bounds")
            object.__setattr__(self, "bounds", (float(lo), float(hi)))

    def value_bounds(self) -> tuple[float, float]:
        """The values the metric can take: `bounds`, else from its name (accuracies [0, 1])."""
        from lowprec.gates.power import metric_bounds
        return self.bounds if self.bounds is not None else metric_bounds(self.metric)

    def cannot_fire(self, baseline_value: float) -> str | None:
        """Why no candidate can regress on this gate against this baseline value, or None."""
        from lowprec.gates.power import headroom
        if not math.isfinite(baseline_value):
            return None
        lo, hi = self.value_bounds()
        room = headroom(baseline_value, self.direction, (lo, hi))
        allowed = self.max_regression.allowed(baseline_value)
        if room > allowed:
            return None
        bound, which = (lo, "floor") if self.direction == HIGHER_IS_BETTER else (hi, "ceiling")
        return (f"the baseline's value {baseline_value:.4g} is {room:.4g} from the metric's {which} {bound:g}, "
                f"no more than the allowed regression {self.max_regression.describe(baseline_value)}, so no "
                f"candidate can regress by more: the gate cannot fire")

    def with_power(self, r: "GateResult") -> "GateResult":
        """`r` with the smallest regression this gate detects with 80% probability (lowprec.gates.power):
        the allowed regression, the eval's sampling error (from r's interval) and the calibrated noise."""
        from dataclasses import replace as _replace
        from lowprec.gates.power import detectable
        from lowprec.gates.stats import z_value
        if r.statistic == SEED_SPREAD:
            return r   # check_spread has set it from the baselines' spread
        if r.interval is None or r.allowed is None or r.baseline_value is None:
            return _replace(r, detectable=None, power_note="no interval, so no power")
        se = (r.interval[1] - r.interval[0]) / (2 * z_value(self.confidence))
        scale = abs(r.baseline_value) if self.max_regression.kind == "relative" else 1.0
        sd = self.noise.sd * scale if self.noise else 0.0
        mean = self.noise.mean * scale if self.noise else 0.0
        mde = detectable(r.allowed, se, sd, mean, self.confidence)
        note = (f"eval se {se:.3g}" + (f", calibrated noise sd {sd:.3g}" if self.noise else
                                        ", no calibrated noise (`noise:`): eval sampling only"))
        return _replace(r, detectable=mde, power_note=note)

    def check(self, baseline: Scores, candidate: Scores) -> GateResult:
        """Compare the metric in both (a missing metric raises GateInputError, naming those there are)."""
        b, c = baseline.get(self.metric), candidate.get(self.metric)
        sign = 1.0 if self.direction == LOWER_IS_BETTER else -1.0
        allowed = self.max_regression.allowed(b.value) if math.isfinite(b.value) else None
        tol = self.max_regression.describe(b.value if math.isfinite(b.value) else None)
        base = dict(metric=self.metric, baseline_value=b.value, candidate_value=c.value, allowed=allowed,
                    tolerance=tol, direction=self.direction, confidence=self.confidence,
                    informational=self.informational)
        if not math.isfinite(c.value):
            return GateResult(Verdict.REGRESS, delta=None, interval=None, n=None, statistic="none", **base,
                              reason=f"{self.metric}: the candidate's value is {c.value} (baseline {b.value:.4g}), "
                                     f"which counts as a regression beyond any tolerance ({tol}).")
        if not math.isfinite(b.value):
            return GateResult(Verdict.INCONCLUSIVE, delta=None, interval=None, n=None, statistic="none", **base,
                              reason=f"{self.metric}: the baseline's value is {b.value}, so there is nothing "
                                     f"to compare against; re-evaluate the baseline.")
        if self.statistic == PAIRED_BOOTSTRAP and b.samples is not None and c.samples is not None:
            return self._paired(b, c, sign, base)
        note = ""
        if self.statistic == PAIRED_BOOTSTRAP:
            lacking = " and ".join(name for name, m in (("baseline", b), ("candidate", c)) if m.samples is None)
            note = f"; no per-example scores in the {lacking}"
        return self._stderr(b, c, sign, base, note)

    def _paired(self, b: MetricScores, c: MetricScores, sign: float, base: dict) -> GateResult:
        diffs, counts = paired_differences(b.samples, c.samples, sign)
        n = counts["shared"]
        left = [f"{counts[k]} {k.replace('_', ' ')}" for k in ("only_baseline", "only_candidate", "nonfinite")
                if counts[k]]
        left_out = f"; left out: {', '.join(left)}" if left else ""
        if n < self.min_samples:
            return GateResult(Verdict.INCONCLUSIVE, delta=None, interval=None, n=n, statistic=PAIRED_BOOTSTRAP, **base,
                              reason=f"{self.metric}: only {n} paired examples (keys in both runs{left_out}), "
                                     f"fewer than min_samples {self.min_samples}; evaluate both runs on the "
                                     f"same, larger example set.")
        delta = float(diffs.mean())
        lo, hi = paired_bootstrap_interval(diffs, self.confidence, self.bootstrap_samples, self.seed)
        return self._verdict(delta, (lo, hi), n, PAIRED_BOOTSTRAP, base,
                             f"paired bootstrap over {n} examples{left_out}")

    def _stderr(self, b: MetricScores, c: MetricScores, sign: float, base: dict, note: str) -> GateResult:
        se_b, se_c = b.stderr_estimate(), c.stderr_estimate()
        delta = sign * (c.value - b.value)
        if se_b is None or se_c is None:
            lacking = " and the ".join(name for name, se in (("baseline", se_b), ("candidate", se_c)) if se is None)
            verb = "have" if se_b is None and se_c is None else "has"
            return GateResult(Verdict.INCONCLUSIVE, delta=delta, interval=None, n=None, statistic=STDERR, **base,
                              reason=f"{self.metric}: regression {delta:+.4g} but the {lacking} {verb} neither a "
                                     f"stderr ({self.metric}_stderr) nor per-example scores, so no interval can "
                                     f"be formed; log them with the eval results.")
        interval = normal_interval(delta, se_b, se_c, self.confidence)
        return self._verdict(delta, interval, None, STDERR, base,
                             f"normal interval from stderrs {se_b:.3g} and {se_c:.3g}{note}")

    def _verdict(self, delta: float, interval: tuple[float, float], n: int | None, statistic: str,
                 base: dict, how: str) -> GateResult:
        lo, hi = interval
        allowed = base["allowed"]
        pct = f"{self.confidence * 100:.4g}%"
        what = (f"{self.metric}: regression {delta:+.4g} ({pct} interval [{lo:+.4g}, {hi:+.4g}], "
                f"{how}; + = worse, {self.direction.replace('_', ' ')})")
        verdict, says = interval_verdict(lo, hi, allowed, base["tolerance"], "", "examples")
        return GateResult(verdict, delta=delta, interval=(lo, hi), n=n, statistic=statistic, **base,
                          reason=f"{what} {says}.")


def interval_verdict(lo: float, hi: float, allowed: float, tolerance: str, beyond: str, more: str):
    """(verdict, words) for a regression interval [lo, hi] (+ = worse) against the allowed
    regression: wholly above regresses, wholly at or below passes, else inconclusive."""
    if lo > allowed:
        return Verdict.REGRESS, f"lies wholly above the allowed regression {tolerance}{beyond}"
    if hi <= allowed:
        return Verdict.PASS, f"lies wholly at or below the allowed regression {tolerance}"
    return Verdict.INCONCLUSIVE, f"straddles the allowed regression {tolerance}; more {more} would narrow it"


def check_spread(gate: Gate, baselines: list[Scores], candidate: Scores) -> GateResult:
    """Seed-aware: does the candidate lie outside the spread of several baselines (runs that
    differ in seed)? With k baseline values of mean m and sample sd s, the regression is
    r = candidate - m (oriented, + = worse) and its interval is the 95% (`confidence`) prediction
    interval of one more seed, r +- t(k-1) * s * sqrt(1 + 1/k): where a candidate whose numerics
    change nothing would lie. `regress` when its lower end exceeds the allowed regression (of
    the baselines' mean), `pass` when its upper end does not, else `inconclusive`."""
    from lowprec.gates.power import POWER
    from lowprec.gates.stats import t_quantile
    if len(baselines) < 2:
        raise GateInputError(f"a seed spread needs at least 2 baselines, got {len(baselines)}")
    values = [b.get(gate.metric).value for b in baselines]
    c = candidate.get(gate.metric).value
    sign = 1.0 if gate.direction == LOWER_IS_BETTER else -1.0
    k = len(values)
    base = dict(metric=gate.metric, candidate_value=c, direction=gate.direction, confidence=gate.confidence,
                informational=gate.informational, n=k, statistic=SEED_SPREAD)
    if not all(math.isfinite(v) for v in values):
        shown = ", ".join(f"{v:.4g}" for v in values)
        return GateResult(Verdict.INCONCLUSIVE, delta=None, interval=None, baseline_value=None, allowed=None,
                          tolerance=gate.max_regression.describe(), **base,
                          reason=f"{gate.metric}: a baseline's value is not finite ({shown}); re-evaluate it.")
    m = sum(values) / k
    allowed = gate.max_regression.allowed(m)
    tol = gate.max_regression.describe(m)
    base.update(baseline_value=m, allowed=allowed, tolerance=tol)
    if not math.isfinite(c):
        return GateResult(Verdict.REGRESS, delta=None, interval=None, **base,
                          reason=f"{gate.metric}: the candidate's value is {c}, a regression beyond any tolerance.")
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (k - 1))
    t = t_quantile(0.5 + gate.confidence / 2, k - 1)
    half = t * sd * math.sqrt(1 + 1 / k)
    r = sign * (c - m)
    lo, hi = r - half, r + half
    # 80% power: r ~ Normal(true, sd^2 (1 + 1/k)) must exceed allowed + half
    mde = allowed + half + NormalDist().inv_cdf(POWER) * sd * math.sqrt(1 + 1 / k)
    what = (f"{gate.metric}: the candidate ({c:.4g}) against {k} baselines (mean {m:.4g}, seed sd {sd:.3g}): "
            f"regression {r:+.4g}, {gate.confidence * 100:.4g}% prediction interval of one more seed "
            f"[{lo:+.4g}, {hi:+.4g}] (t = {t:.3g} with {k - 1} degrees of freedom; + = worse)")
    verdict, says = interval_verdict(lo, hi, allowed, tol, ": outside the seed spread", "baseline seeds")
    return GateResult(verdict, delta=r, interval=(lo, hi), **base, reason=f"{what} {says}.", detectable=mde,
                      power_note=f"seed spread of {k} baselines (sd {sd:.3g})")


def check_all(spec, baseline: Scores, candidate: Scores) -> list[GateResult]:
    """Every gate of `spec` (a GateSpec, or any iterable of Gate) against the two Scores."""
    gates: Iterable[Gate] = getattr(spec, "gates", spec)
    return [g.check(baseline, candidate) for g in gates]


def summarize(results: Iterable[GateResult]) -> GateSummary:
    """The overall verdict and a one-line reason naming the gates that did not pass."""
    results = tuple(results)
    if not results:
        return GateSummary(Verdict.INCONCLUSIVE, "no gates were checked", results)
    deciding = [r for r in results if not r.informational]
    if not deciding:
        return GateSummary(Verdict.PASS, f"all {len(results)} gates are informational (they never fail)", results)
    by = {v: [r for r in deciding if r.verdict == v] for v in Verdict}
    verdict = Verdict.REGRESS if by[Verdict.REGRESS] else Verdict.INCONCLUSIVE if by[Verdict.INCONCLUSIVE] \
        else Verdict.PASS
    counts = ", ".join(f"{len(by[v])} {v.value}" for v in (Verdict.REGRESS, Verdict.INCONCLUSIVE, Verdict.PASS)
                       if by[v])
    info = len(results) - len(deciding)
    also = f" ({info} informational not counted)" if info else ""
    if verdict is Verdict.PASS:
        return GateSummary(Verdict.PASS, f"all {len(deciding)} gates pass{also}", results)
    first = by[verdict][0]
    return GateSummary(verdict, f"{counts} of {len(deciding)} gates{also}; first {verdict.value}: {first.reason}",
                       results)


def step_gate(spec, baseline: Scores | Callable[[int], Scores], evaluate: Callable[[int], Scores]
              ) -> Callable[[int], GateSummary]:
    """The `gate(step)` callable the rollout controller takes: evaluate the candidate at `step`
    (and the baseline, when it is a callable too) and summarize every gate of `spec`."""
    def gate(step: int) -> GateSummary:
        base = baseline(step) if callable(baseline) else baseline
        return summarize(check_all(spec, base, evaluate(step)))
    return gate
