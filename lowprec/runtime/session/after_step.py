"""What happens after each optimizer step, written once for every host.

`lowprec run`'s loop (`lowprec.runtime.trainer.loop`) and the framework integrations
(`lowprec.integrations.core.HostedRollout`, which the Hugging Face and Lightning callbacks
drive) both hand each concluded `StepResult` of their `Session` to an `AfterStep`:

* a rewind: the losses and grad norms after the step it went back to are dropped, and the
  loss that caused it is tracked once per step as `train/loss_rewound` / `train/rewound_to`;
* otherwise the step's loss and grad norm are kept, the precision map is kept at check
  steps (and the last step), the training metrics are tracked every `log_every` steps
  (their mean over the window, the last value, the baseline run's loss at those steps),
  with the signals at check steps and the precision map at check steps and on a change;
* eval checkpoints: when one is due after this step, it runs, the session hears its
  verdict (`Session.after_eval`: a regression rolls the newest stage back), a changed
  precision map is tracked, and the quantizer statistics resume.

A fix to any of these is made here, and all hosts decide and record alike. What stays with
a host is what only it has: the data, the checkpoints, injected faults, the time/energy
telemetry of `lowprec run` (the `on_precision_change` and `clock` hooks give it what it needs).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from lowprec.tracking.phases import Phase
from lowprec.policy.router_signals import router_balance

__all__ = ["AfterStep", "StepRecord"]


@dataclass
class StepRecord:
    """The run so far, as the hosts report it."""
    losses: list[float] = field(default_factory=list)          # per step, as finally trained
    grad_norms: list[float] = field(default_factory=list)
    formats: dict[int, dict[str, str]] = field(default_factory=dict)        # check step -> precision map
    flops_share: dict[int, dict[str, float]] = field(default_factory=dict)
    rewinds: int = 0
    rewinds_logged: set[int] = field(default_factory=set)      # steps whose rewind is tracked (once each)
    routers: dict[str, float] = field(default_factory=dict)    # the last logged step's router/<layer>/... metrics


class AfterStep:
    """See the module docstring. `total_steps`: the run's length when the host knows it (no
    periodic eval after the last step, whose final eval the host runs; the precision map
    kept at the last step); None under a framework's trainer."""

    def __init__(self, session, state, *, tracker=None, evals=None, log_every: int = 1,
                 baseline: dict[int, float] | None = None, total_steps: int | None = None,
                 clock=None,
                 on_precision_change: Callable[[], None] | None = None,
                 window_metrics: Callable[[int], dict[str, float]] | None = None):
        self.session, self.state, self.tracker, self.evals = session, state, tracker, evals
        self.log_every, self.baseline, self.total_steps = log_every, baseline, total_steps
        self.clock = clock
        self.on_precision_change = on_precision_change or (lambda: None)
        self.window_metrics = window_metrics or (lambda step: {})
        self.record = StepRecord()

    # ------------------------------------------------------------------ one concluded step
    def __call__(self, result, loss: float, lr: float) -> None:
        """`result`: the session's StepResult; `loss`: its loss on the host; `lr`: the
        learning rate the step used. `keep`, then `after_applied` if the step stands."""
        if self.keep(result, loss):
            self.after_applied(result, lr)

    def keep(self, result, loss: float) -> bool:
        """Keep a standing step's loss and grad norm, or undo the steps a rewind went back
        over; True if the step stands (a host with telemetry ends its pass between the two)."""
        rec, step = self.record, result.step
        if result.decision.changes:
            self.on_precision_change()
        if result.rewound_to is not None:
            back = result.rewound_to
            rec.losses, rec.grad_norms = rec.losses[:back], rec.grad_norms[:back]
            rec.rewinds += 1
            if self.tracker is not None and step not in rec.rewinds_logged:
                # under names of their own: the redone step logs train/loss again, and one metric
                # with two values at one step draws as a vertical stroke in MLflow
                self.tracker.log_metrics(step, {"train/loss_rewound": loss, "train/rewound_to": back})
                rec.rewinds_logged.add(step)
                self._lap(Phase.TRACKING)
            return False
        rec.losses.append(loss)
        rec.grad_norms.append(float(result.grad_norm))
        self._lap(Phase.OTHER)
        return True

    def after_applied(self, result, lr: float) -> None:
        """What follows a step that stands (applied or skipped): keep, track, evaluate."""
        rec, step, s = self.record, result.step, self.session
        checked = s.is_check_step(step)
        last = self.total_steps is not None and step == self.total_steps - 1
        if checked or last:
            rec.formats[step] = self.state.formats()
            rec.flops_share[step] = self.state.flops_share()
        if (step + 1) % self.log_every == 0 or checked or last:
            # every rank's tokens per expert where the session summed them (`StepResult.routed_tokens`)
            rec.routers = router_balance(getattr(self.state, "sites", {}), result.routed_tokens)
            window = self.window_metrics(step)
            if self.tracker is not None:
                self._track(step, lr, checked, result, window)
                self._lap(Phase.TRACKING)
        if self.evals is not None and self.evals.due(step + 1) and (self.total_steps is None
                                                                      or step + 1 < self.total_steps):
            self.evaluate(step + 1)

    def evaluate(self, step: int) -> None:
        """An eval checkpoint after `step` updates; the controller hears its verdict."""
        outcome = self.evals.evaluate(step)
        self._lap(Phase.EVAL)
        if outcome is not None and self.session.after_eval(step, outcome).changes:
            self.on_precision_change()
            if self.tracker is not None:
                self.tracker.log_precision(step, self.state.formats(), self.state.flops_share())
        self.session.resume_statistics()

    # ------------------------------------------------------------------ tracking
    def _track(self, step: int, lr: float, checked: bool, result, window_extra: dict[str, float]) -> None:
        rec, t = self.record, self.tracker
        window = rec.losses[-self.log_every:]
        # a skipped step's non-finite loss trained nothing: the mean is over the finite ones
        kept = [s for s, v in zip(range(step - len(window) + 1, step + 1), window) if math.isfinite(v)]
        mean = sum(v for v in window if math.isfinite(v)) / len(kept) if kept else math.nan
        metrics: dict[str, Any] = {"train/loss": mean, "train/loss_last": rec.losses[-1],
                                   "train/grad_norm": rec.grad_norms[-1], "train/lr": lr}
        if self.baseline and step in self.baseline and kept:
            metrics["train/baseline_loss"] = sum(self.baseline.get(s, self.baseline[step]) for s in kept) / len(kept)
        t.log_metrics(step, {**metrics, **window_extra, **rec.routers})
        if checked and self.session.last_signals is not None:
            t.log_signals(step, self.session.last_signals)
        if checked or result.decision.changes:
            t.log_precision(step, self.state.formats(), self.state.flops_share())

    def _lap(self, phase: Phase) -> None:
        if self.clock is not None:
            self.clock.lap(phase)

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        rec = self.record
        return {"losses": list(rec.losses), "grad_norms": list(rec.grad_norms), "rewinds": rec.rewinds,
                "rewinds_logged": sorted(rec.rewinds_logged),
                "evals": self.evals.state_dict() if self.evals is not None else None}

    def load_state_dict(self, saved: dict) -> None:
        self.record = replace(self.record, losses=[float(x) for x in saved["losses"]],
                              grad_norms=[float(x) for x in saved.get("grad_norms", ())],
                              rewinds=int(saved.get("rewinds", 0)),
                              rewinds_logged=set(saved.get("rewinds_logged", ())))
        if self.evals is not None and saved.get("evals") is not None:   # the gate's checks made (its error budget)
            self.evals.load_state_dict(saved["evals"])
