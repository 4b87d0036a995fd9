"""One step for everyone: what a framework's run records, at the framework's global step.

A framework's step counter never goes back (the HF Trainer's `global_step`, Lightning's
`trainer.global_step`, torchtitan's `step`), and it counts from 1: the step the Trainer's own
MLflow metrics carry. lowprec's step (`Session.step_index`) counts from 0 and goes back on a
rewind. In one MLflow run both would disagree by one, and after a rewind by the steps rewound
too, so `lowprec gate` would find the run's final evals at a step its control never reached.

`FrameworkSteps` is the `Tracker` a hosted rollout logs through: every metric, signal,
precision map, eval and event is recorded at the framework's current step, as the host last
reported it (`HostedRollout.before_optimizer_step(..., framework_step=)`), whatever step
lowprec's code passes. Where lowprec's own count differs (after a rewind), it is kept beside:
the metric `train/lowprec_step` (the session's step count, once per framework step) and, on an event, `lowprec_step` in its
evidence (lowprec's 0-based step, which is the framework's minus one until a rewind). A host
that reports no framework step is logged at lowprec's steps, as before. Everything else
(the run id, the run folder, finishing) is the wrapped tracker's.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterable

__all__ = ["FrameworkSteps", "LOWPREC_STEP"]

LOWPREC_STEP = "train/lowprec_step"


class FrameworkSteps:
    """The tracker `tracker`, logging at `framework()` (the framework's step now; None: lowprec's own).
    `count()`: lowprec's step count now (the session's `step_index`)."""

    def __init__(self, tracker, framework: Callable[[], int | None], count: Callable[[], int]):
        self.tracker, self.framework, self.count = tracker, framework, count
        self._own_at: int | None = None   # the framework step LOWPREC_STEP was last logged at

    def __getattr__(self, name: str) -> Any:   # run_id, run_dir, enabled, finish, log_artifact, ...
        return getattr(self.tracker, name)

    def _at(self, step: int) -> int:
        g = self.framework()
        return step if g is None else g

    def _own(self) -> dict[str, float]:
        """LOWPREC_STEP, once per framework step: a step that logs metrics more than once (the
        step's training metrics, then an eval's) records lowprec's count at it once."""
        g = self.framework()
        n = self.count()
        if g is None or n == g or g == self._own_at:
            return {}
        self._own_at = g
        return {LOWPREC_STEP: float(n)}

    def log_metrics(self, step: int, metrics) -> None:
        self.tracker.log_metrics(self._at(step), {**metrics, **self._own()})

    def log_signals(self, step: int, signals) -> None:
        self.tracker.log_signals(self._at(step), signals)

    def log_precision(self, step: int, formats, flops_share=None) -> None:
        self.tracker.log_precision(self._at(step), formats, flops_share)

    def log_eval(self, step: int, results, samples=None, **kind) -> None:
        self.tracker.log_eval(self._at(step), results, samples=samples, **kind)

    def log_events(self, events: Iterable) -> None:
        g = self.framework()
        if g is None:
            self.tracker.log_events(events)
            return
        self.tracker.log_events([replace(e, step=g) if e.step + 1 == g else
                                 replace(e, step=g, evidence={**e.evidence, "lowprec_step": e.step}) for e in events])
