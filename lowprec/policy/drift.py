"""Slow signals: the loss gap to a baseline and an eval checkpoint's regression, judged by their window.

The controller's rule 3 (`lowprec.policy.controller`), the global signals a check acts on:
the anomalies no replay explained (handed over by `observe_step`), NaN/Inf in the check's
losses, and the loss gap (`LossGapDetector`: the smoothed loss against the baseline
curve, relative). While some site's own thresholds are crossed (before its patience ran
out), a global signal blames that site. With no site to blame:

* a slow signal (the loss gap alone, or an eval checkpoint's regression through
  `observe_gate`) is first judged by its window when the call is handed a `judge` (the session
  hands its window's: `lowprec.runtime.session.window`, over the window since the last snapshot, by
  `lowprec.policy.attribution.judge_window`). A window never starts before the check that
  last changed a format (its steps would have trained in other formats): until a snapshot
  after that change exists the judgment waits (a WINDOW event says so) and the signal, still
  firing, is judged at a later check. If high precision closes the gap, the sites
  it blames fall back (their stage rolls back when it is the newest stage, whole), with a
  rewind when `rewind` is on (not after an eval: the state stays where it is). If not,
  nothing is demoted: a NOT_PRECISION event holds the evidence (the window's losses as
  trained, with every site in high precision, and the baseline's), the loss-gap detector
  accepts that gap (it fires again when the gap grows `loss_gap` above it), and training
  goes on (or, with `not_precision_rewind` and `rewind`, goes back to the window's start).
  A verdict of not precision does not hold the schedule up: the promotion that was due
  comes at the first check after the judgment;
* otherwise (a fast signal handed over, or nothing to judge a slow one by) the newest
  stage rolls back, and with `rewind` on the loop is asked to restore the last good state
  and skip batches.

`SlowSignalRules` is that half of `RolloutController`, a base class it inherits: it uses
the controller's `config`, `promoted`, `stable_since`, `pending`, `replay_candidates()`,
`_fallback()` and `_rollback_newest()`. Like the controller it never touches a model, and
its tests feed it numbers.
"""

from __future__ import annotations

from typing import Callable

from lowprec.policy.attribution import WindowAttribution, WindowDecision, WindowDeferred
from lowprec.policy.decisions import Action, Decision
from lowprec.policy.detectors import LossGapDetector, Thresholds
from lowprec.policy.events import Event, EventKind
from lowprec.policy.monitor import Signals
from lowprec.policy.verdicts import GateOutcome, Verdict

__all__ = ["SlowSignalRules"]

# judge(step, candidates, groups) -> WindowAttribution; WindowDeferred when no window can be
# judged yet (no snapshot since the formats last changed); None when none can be replayed
Judge = Callable[[int, list[str], list[list[str]]], "WindowAttribution | WindowDeferred | None"]


class SlowSignalRules:
    """Rule 3 of the controller: global signals, the loss gap and gate regressions (module docstring)."""

    def _init_slow_signals(self, th: Thresholds, baseline: dict[int, float] | None) -> None:
        if th.loss_gap is not None and not baseline:
            raise ValueError(f"thresholds.loss_gap is {th.loss_gap} but no baseline loss curve was given: "
                             "pass baseline={step: loss} (rollout.baseline in a config) or set loss_gap to None")
        self.loss_gap = LossGapDetector(baseline, th.loss_gap, th.loss_gap_smoothing) \
            if baseline and th.loss_gap is not None else None

    def _global_rule(self, step: int, signals: Signals, blamed: list[str],
                     suspects: list[tuple[str, dict]], d: Decision, judge: Judge | None = None) -> None:
        """Rule 3 at a check, after the per-site rules blamed `blamed`; `suspects`: the sites
        whose thresholds are crossed, first to blame first."""
        fired = self._global_signals(step, signals)
        if signals.nonfinite and not blamed:
            fired.insert(0, ("nan_inf", {"losses": signals.losses, "grad_norms": signals.grad_norms}))
        if fired and not blamed and suspects:
            # a global signal while a site's own thresholds are crossed: that site is to blame
            site, crossed = suspects[0]
            blamed.append(site)
            names = ", ".join(name for name, _ in fired)
            self._fallback(site, step, f"{names} while this site's thresholds are crossed",
                           {**crossed, **{name: ev for name, ev in fired}}, d)
        # the loss gap alone is a slow signal: judged by its window first, where there is one
        judged = (fired and not blamed and [name for name, _ in fired] == ["loss_gap"]
                  and self._judge_slow(step, "loss_gap", dict(fired), d, judge, rewind=True))
        if fired and not blamed and not judged:
            reason = ", ".join(name for name, _ in fired)
            evidence = {name: ev for name, ev in fired}
            rolled = self._rollback_newest(step, f"global signal: {reason}", evidence, d)
            if self.config.rewind and (rolled or signals.nonfinite):
                d.action = Action.REWIND
                d.skip_batches = self.config.rewind_skip_batches
                d.events.append(Event(step, EventKind.REWIND, (), {}, {}, f"rewind after {reason}",
                                      {"skip_batches": d.skip_batches}))

    def _global_signals(self, step: int, signals: Signals) -> list[tuple[str, dict]]:
        """The anomalies left for this check (no replay explained them), then the loss gap
        over the window's losses."""
        fired, self.pending = list(self.pending), []
        if self.loss_gap is not None:
            first = signals.step - len(signals.losses) + 1
            for i, loss in enumerate(signals.losses):
                hit, ev = self.loss_gap.update(first + i, loss)
                if hit and "loss_gap" not in dict(fired):
                    fired.append(("loss_gap", {**ev, "step": first + i}))
        return fired

    def _judge_slow(self, step: int, reason: str, evidence: dict, d: Decision, judge: Judge | None, *,
                    rewind: bool) -> bool:
        """A slow signal judged by its window; False when there is no judge or no window to
        judge by (the caller then rolls the newest stage back as before)."""
        if judge is None:
            return False
        low, groups = self.replay_candidates()
        att = judge(step, low, groups) if low else None
        if att is None:
            return False
        if isinstance(att, WindowDeferred):   # asked again at the next check the signal still fires
            d.events.append(Event(step, EventKind.WINDOW, (), {}, {}, (
                f"{reason}: judged later: the newest snapshot (step {att.snapshot}) is older than the "
                f"format change at step {att.changed_at}"), {"snapshot": att.snapshot, "changed_at": att.changed_at}))
            return True
        for look in att.looks[1:]:
            how = "window trained again" if look.retrained else "current weights"
            with_ = (f"with {len(look.high_precision)} site(s) in high precision" if look.high_precision
                     else "as configured (the control)")
            d.events.append(Event(step, EventKind.WINDOW, look.high_precision, {}, {}, (
                f"{reason}: {how} {with_} closes {look.closed:.0%} of the gap"), look.to_evidence()))
        ev = {**evidence, **att.evidence}
        if not att.precision_to_blame:
            why = ("high precision closes less than the margin more of the gap than the window trained "
                   "again as configured (the control): what the control closes did not recur in a retrain"
                   if att.decided_by is WindowDecision.CONTROL
                   else "every site in high precision does not close the window's gap")
            d.events.append(Event(step, EventKind.NOT_PRECISION, (), {}, {}, (
                f"{reason}: not precision ({why}); nothing demoted"), ev))
            gap = evidence.get("loss_gap", {}).get("gap")
            if self.loss_gap is not None and gap is not None:
                # the smoothed gap still rises towards the tail's level: accept the higher
                base = sum(att.baseline) / max(len(att.baseline), 1)
                level = (sum(att.configured) / max(len(att.configured), 1) - base) / abs(base) if base else 0.0
                self.loss_gap.accept(max(gap, level))
            if rewind and self.config.rewind and self.config.not_precision_rewind:
                d.action, d.skip_batches = Action.REWIND, self.config.rewind_skip_batches
                d.rewind_before = att.steps[0]
                d.events.append(Event(step, EventKind.REWIND, (), {}, {}, f"rewind after {reason} (not precision)",
                                      {"skip_batches": d.skip_batches, "to_step": att.steps[0]}))
            return True   # the schedule goes on: a suspicion cleared holds nothing up past its window
        why = f"{reason}: closed by {att.decided_by.value.replace('_', ' ')} with these sites in high precision"
        if self.promoted and set(att.blamed) == set(groups[0]):
            self._rollback_newest(step, why, ev, d)
        else:
            for site in att.blamed:
                self._fallback(site, step, why, ev, d)
        if rewind and self.config.rewind:
            d.action, d.skip_batches = Action.REWIND, self.config.rewind_skip_batches
            d.events.append(Event(step, EventKind.REWIND, (), {}, {}, f"rewind after {reason}",
                                  {"skip_batches": d.skip_batches}))
        self.stable_since = step
        return True

    def _gate_event(self, step: int, result: GateOutcome, what: str, stage: str | None, d: Decision) -> Verdict:
        try:
            verdict = Verdict(result.verdict)
        except ValueError:
            raise ValueError(f"the gate answered verdict {result.verdict!r}; a gate answers one of "
                             f"{', '.join(v.value for v in Verdict)}") from None
        d.events.append(Event(step, EventKind.GATE, (), {}, {}, f"gate {what}: {verdict.value}",
                              {"verdict": verdict.value, "detail": str(result.reason)}, stage))
        return verdict

    def observe_gate(self, step: int, result: GateOutcome, *, judge: Judge | None = None) -> Decision:
        """An evaluation checkpoint's gate outcome (`.verdict`, `.reason`), from a periodic
        eval outside a promotion. A regression is judged by its window when a judge is set,
        else rolls the newest promoted stage back; the verdict is recorded as a GATE event.
        No rewind here: the state stays where it is."""
        d = Decision()
        verdict = self._gate_event(step, result, "at eval checkpoint", None, d)
        if verdict is Verdict.REGRESS and not self._judge_slow(step, "evaluation gate regressed",
                                                               {"verdict": verdict.value}, d, judge, rewind=False):
            self._rollback_newest(step, "evaluation gate regressed", {"verdict": verdict.value}, d)
            self.stable_since = step
        return d
