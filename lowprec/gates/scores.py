"""What a gate compares: per metric, a value, its standard error and per-example scores.

`Scores` is a plain in-memory object, free of MLflow, so that the same gate code runs in the
training loop (the rollout controller's evaluator hands over dicts) and in CI (`lowprec.gates.runs`
reads a stored run into the same object):

    scores = Scores.from_eval(results, samples, prefix="eval")
    # results = {task: {metric: value, metric + "_stderr": se}}      (lm-eval's `acc,none` too)
    # samples = {task: {metric: {example key: score}}}               (optional)
    scores.get("eval/heldout_shakespeare/bits_per_byte")              # -> MetricScores

Metric names are `<prefix>/<task>/<metric>`, named exactly as `lowprec.tracking.tracker.Tracker.log_eval`
logs them (the naming rule lives in `lowprec.tracking.records`), so a gate file written against
MLflow runs works unchanged in the loop. `prefix` is `eval` for the model as it runs and
`eval_hp` for the same weights in high precision; to gate the model against its own
high-precision eval, build the baseline with `prefix="eval"` from the high-precision results.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from lowprec.base.parse import suggest
from lowprec.gates.errors import GateInputError
from lowprec.tracking.records import eval_metric_name, eval_metrics

__all__ = ["MetricScores", "Scores", "STDERR_SUFFIX"]

STDERR_SUFFIX = "_stderr"


def _finite_or_none(x: Any) -> float | None:
    if x is None or isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        return None
    return float(x)


@dataclass(frozen=True)
class MetricScores:
    """One metric of one model: `value` (the aggregate), `stderr` (None when not known) and
    `samples` ({example key: score}, None when the evaluation kept no per-example scores)."""

    value: float
    stderr: float | None = None
    samples: Mapping[str, float] | None = None

    def __post_init__(self):
        if isinstance(self.value, bool) or not isinstance(self.value, (int, float)):
            raise GateInputError(f"a metric value must be a number, got {self.value!r}")
        object.__setattr__(self, "value", float(self.value))
        if self.stderr is not None:
            se = _finite_or_none(self.stderr)
            if se is None or se < 0:
                raise GateInputError(f"a standard error must be a finite number >= 0 or None, got {self.stderr!r}")
            object.__setattr__(self, "stderr", se)
        if self.samples is not None:
            object.__setattr__(self, "samples", {str(k): float(v) for k, v in self.samples.items()})

    @property
    def n(self) -> int | None:
        """How many per-example scores there are (None without samples)."""
        return None if self.samples is None else len(self.samples)

    def stderr_estimate(self) -> float | None:
        """`stderr` when given, else the standard error of the mean of the finite samples
        (sample standard deviation / sqrt(n)), else None."""
        if self.stderr is not None:
            return self.stderr
        vals = [v for v in (self.samples or {}).values() if math.isfinite(v)]
        if len(vals) < 2:
            return None
        mean = sum(vals) / len(vals)
        var = sum((v - mean) ** 2 for v in vals) / (len(vals) - 1)
        return math.sqrt(var / len(vals))


@dataclass(frozen=True)
class Scores:
    """Metrics of one model at one evaluation, by full name (`eval/<task>/<metric>`).
    `source` says where they came from ("run 3f2a... step 300"), for messages."""

    metrics: Mapping[str, MetricScores]
    source: str = "scores"
    step: int | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)  # e.g. run id and name, for reports

    def __post_init__(self):
        for k, v in self.metrics.items():
            if not isinstance(v, MetricScores):
                raise GateInputError(f"{self.source}: metric {k!r} must be a MetricScores, got {type(v).__name__}")
        object.__setattr__(self, "metrics", dict(self.metrics))

    def names(self) -> list[str]:
        return sorted(self.metrics)

    def get(self, metric: str) -> MetricScores:
        """The metric, or a GateInputError naming the metrics there are (under the same prefix)."""
        try:
            return self.metrics[metric]
        except KeyError:
            raise GateInputError(missing_metric_message(metric, self.names(), self.source)) from None

    @classmethod
    def from_eval(cls, results: Mapping[str, Any], samples: Mapping[str, Any] | None = None, *,
                  prefix: str = "eval", source: str = "scores", step: int | None = None) -> "Scores":
        """From `{task: {metric: value, metric_stderr: se}}` and optional `{task: {metric: {key:
        score}}}` (the shapes `Tracker.log_eval` takes). A metric with samples but no value gets the
        mean of its samples; a stderr that is not a finite number (lm-eval's "N/A") counts as absent."""
        flat = eval_metrics(results, prefix)
        values = {k: v for k, v in flat.items() if not k.endswith(STDERR_SUFFIX)}
        per: dict[str, dict[str, float]] = {}
        for task, by_metric in (samples or {}).items():
            if not isinstance(by_metric, Mapping):
                raise GateInputError(f"{source}: samples[{task!r}] must be {{metric: {{example key: score}}}}, "
                                     f"got {type(by_metric).__name__}")
            for m, ex in by_metric.items():
                if not isinstance(ex, Mapping):
                    raise GateInputError(f"{source}: samples[{task!r}][{m!r}] must be {{example key: score}}, "
                                         f"got {type(ex).__name__}")
                per[f"{prefix}/{task}/{eval_metric_name(m)}"] = {str(k): float(v) for k, v in ex.items()}
        out = {}
        for name in sorted(set(values) | set(per)):
            ex = per.get(name)
            if name in values:
                value = values[name]
            else:
                finite = [v for v in ex.values() if math.isfinite(v)]
                value = sum(finite) / len(finite) if finite else math.nan
            out[name] = MetricScores(value, _finite_or_none(flat.get(name + STDERR_SUFFIX)), ex)
        return cls(out, source=source, step=step)


def missing_metric_message(metric: str, names: list[str], source: str) -> str:
    """'<source> has no metric X. Did you mean ...? Metrics under eval/: ...' (a few of them)."""
    head = metric.split("/", 1)[0] + "/"
    same = [n for n in names if n.startswith(head)]
    shown = same or names
    listed = ", ".join(shown[:12]) + (f" (and {len(shown) - 12} more)" if len(shown) > 12 else "")
    where = f"metrics under {head}" if same else "its metrics"
    there = f"{where}: {listed}" if shown else "it has no metrics at all"
    close = names if metric.endswith(STDERR_SUFFIX) else [n for n in names if not n.endswith(STDERR_SUFFIX)]
    return (f"{source} has no metric {metric!r}.{suggest(metric, close)} {there[0].upper()}{there[1:]}. "
            f"Fix the metric name in the gate file, or log that metric for this run.")
