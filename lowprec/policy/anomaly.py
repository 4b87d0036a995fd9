"""Per-step detection of global anomalies: NaN/Inf, loss and grad-norm spikes, large values.

Every training step the loop has two numbers on the host anyway (the loss and the
global grad norm: one host read, as the NaN guard always needed). `StepDetectors`
looks at them at every step, not once per check, so that a fault is acted on at the
step it occurs:

* `NONFINITE`: the loss or the grad norm is NaN/Inf;
* `LOSS_SPIKE` / `GRAD_NORM_SPIKE`: above mean + `spike_sigmas` standard deviations of
  the last `spike_window` values (OLMo-core's stability monitor);
* `LOSS_LARGE` / `GRAD_NORM_LARGE`: at least `large_factor` x the max of the first
  `large_warmup` values (Megatron-LM's rerun state machine).

`observe(step, loss, grad_norm)` updates the detectors and returns an `Anomaly` or None;
`kinds(loss, grad_norm)` asks the same question without remembering anything, for the
replays of `lowprec.policy.attribution` (is the anomaly still there with these sites in high
precision?), and `clears(anomaly, loss, grad_norm)` says whether a clean replay clears the
as-trained step by a margin the detectors' own noise sets (the blame rule, below). Anomalous
values never enter the detectors' histories.

The blame rule. A replay with sites in high precision that is merely under the limit is no
proof: a step that crossed a spike limit by 1% may cross it or not on any rerun (a rewind
took values out of the window, a weight state has a naturally high grad norm). So precision
is blamed only when, for every detector that fired on the step as trained, the signal with
the sites in high precision is under its limit by at least `blame_margin` x sigma, or the
signal as trained is over the limit by at least as much; sigma is the standard deviation of
that signal's spike window (its step-to-step noise; the large-value detector, which keeps no
spread, borrows its signal's). A non-finite step against a finite replay needs no margin.
A clean replay inside the margin is an inconclusive suspicion: recorded, not acted on. The loss gap to a
baseline is a trend, not a one-step anomaly: it stays with the controller's checks.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from lowprec.policy.detectors import LargeValueDetector, SpikeDetector, Thresholds

__all__ = ["AnomalyKind", "Anomaly", "StepDetectors"]


class AnomalyKind(str, enum.Enum):
    """What made a step anomalous (str-valued: the names appear in events and reasons)."""

    NONFINITE = "nan_inf"
    LOSS_SPIKE = "loss_spike"
    GRAD_NORM_SPIKE = "grad_norm_spike"
    LOSS_LARGE = "loss_large"
    GRAD_NORM_LARGE = "grad_norm_large"

    def __str__(self) -> str:
        return self.value

    @property
    def about_loss(self) -> bool:
        """The loss itself is off (the weights or the batch are bad), not only the gradients."""
        return self in (AnomalyKind.LOSS_SPIKE, AnomalyKind.LOSS_LARGE)


@dataclass(frozen=True)
class Anomaly:
    """An anomalous step: which detectors fired, on which values, with their evidence."""

    step: int
    kinds: tuple[AnomalyKind, ...]
    loss: float
    grad_norm: float
    evidence: dict = field(default_factory=dict)   # kind value -> the detector's evidence

    @property
    def nonfinite(self) -> bool:
        return AnomalyKind.NONFINITE in self.kinds

    @property
    def loss_is_off(self) -> bool:
        """The loss is non-finite, spiking or large: the current weights (or this batch) are bad."""
        return not math.isfinite(self.loss) or any(k.about_loss for k in self.kinds)

    @property
    def names(self) -> str:
        return ", ".join(k.value for k in self.kinds)

    def to_evidence(self) -> dict:
        return {"loss": self.loss, "grad_norm": self.grad_norm, **self.evidence}


class StepDetectors:
    """The global detectors, fed one (loss, grad norm) pair per step."""

    def __init__(self, thresholds: Thresholds = Thresholds()):
        th = thresholds
        self.loss_spike = SpikeDetector(th.spike_window, th.spike_sigmas, th.spike_min_history)
        self.grad_spike = SpikeDetector(th.spike_window, th.spike_sigmas, th.spike_min_history)
        self.loss_large = LargeValueDetector(th.large_factor, th.large_warmup)
        self.grad_large = LargeValueDetector(th.large_factor, th.large_warmup)

    def _checks(self, loss: float, grad_norm: float):
        return ((AnomalyKind.LOSS_SPIKE, self.loss_spike, loss), (AnomalyKind.GRAD_NORM_SPIKE, self.grad_spike,
                grad_norm), (AnomalyKind.LOSS_LARGE, self.loss_large, loss),
                (AnomalyKind.GRAD_NORM_LARGE, self.grad_large, grad_norm))

    def kinds(self, loss: float, grad_norm: float) -> tuple[tuple[AnomalyKind, ...], dict]:
        """(the kinds that fire on these values, their evidence), remembering nothing."""
        kinds, evidence = [], {}
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            kinds.append(AnomalyKind.NONFINITE)
        for kind, det, value in self._checks(loss, grad_norm):
            hit, ev = det.test(value)
            if hit:
                kinds.append(kind)
                evidence[kind.value] = ev
        return tuple(kinds), evidence

    def anomalous(self, loss: float, grad_norm: float) -> bool:
        return bool(self.kinds(loss, grad_norm)[0])

    def observe(self, step: int, loss: float, grad_norm: float) -> Anomaly | None:
        """This step's verdict; normal values join the detectors' histories."""
        kinds, evidence = self.kinds(loss, grad_norm)
        if kinds:
            return Anomaly(step, kinds, loss, grad_norm, evidence)
        for _, det, value in self._checks(loss, grad_norm):
            det.update(value, step)
        return None

    def rewound(self, back: int) -> None:
        """Training went back to step `back`: forget the values of the steps from it on."""
        for _, det, _ in self._checks(0.0, 0.0):
            det.rewound(back)

    def clears(self, anomaly: Anomaly, loss: float, grad_norm: float, k: float) -> tuple[bool, dict]:
        """(whether a replay's (loss, grad_norm), clean of anomalies, clears the as-trained
        `anomaly` by `k` standard deviations of each fired detector's signal (the module's
        blame rule), the margins it was measured by). Remembers nothing."""
        if self.anomalous(loss, grad_norm):
            return False, {}
        if anomaly.nonfinite:
            return True, {}
        spread = {AnomalyKind.LOSS_SPIKE: self.loss_spike, AnomalyKind.LOSS_LARGE: self.loss_spike,
                  AnomalyKind.GRAD_NORM_SPIKE: self.grad_spike, AnomalyKind.GRAD_NORM_LARGE: self.grad_spike}
        trained = {"loss": anomaly.loss, "grad_norm": anomaly.grad_norm}
        replayed = {"loss": loss, "grad_norm": grad_norm}
        margins, ok = {}, True
        for kind in anomaly.kinds:
            ev = anomaly.evidence.get(kind.value, {})
            limit = ev.get("limit")
            if limit is None:
                continue
            signal = "loss" if kind.about_loss else "grad_norm"
            margin = k * spread[kind].spread()
            over, under = trained[signal] - limit, limit - replayed[signal]
            clear = over >= margin or under >= margin
            margins[kind.value] = {"limit": limit, "margin": margin, "over_as_trained": over,
                                   "under_in_high_precision": under, "clear": clear}
            ok = ok and clear
        return ok, margins

    def accept_level(self, anomaly: Anomaly, loss: float | None = None, grad_norm: float | None = None) -> None:
        """A persistent change of level that nothing could undo: the level (`loss`, `grad_norm`;
        default the anomaly's own values) is the normal one from now on. Each detector that
        fired on `anomaly` is rebased on its signal's level (a spike detector's history scaled
        to it, a large-value detector's reference raised to it), so that it stays armed; the
        detectors that did not fire keep their histories. The controller calls it only for an
        anomaly that outlasted a burst (`ControllerConfig.accept_after`)."""
        loss = anomaly.loss if loss is None else loss
        grad_norm = anomaly.grad_norm if grad_norm is None else grad_norm
        level = {AnomalyKind.LOSS_SPIKE: loss, AnomalyKind.LOSS_LARGE: loss,
                 AnomalyKind.GRAD_NORM_SPIKE: grad_norm, AnomalyKind.GRAD_NORM_LARGE: grad_norm}
        for kind, det, _ in self._checks(0.0, 0.0):
            if kind in anomaly.kinds:
                det.rebase(level[kind])

    def state_dict(self) -> dict:
        return {"loss_spike": self.loss_spike.state_dict(), "grad_spike": self.grad_spike.state_dict(),
                "loss_large": self.loss_large.state_dict(), "grad_large": self.grad_large.state_dict()}

    def load_state_dict(self, s: dict) -> None:
        self.loss_spike.load_state_dict(s["loss_spike"])
        self.grad_spike.load_state_dict(s["grad_spike"])
        self.loss_large.load_state_dict(s["loss_large"])
        self.grad_large.load_state_dict(s["grad_large"])
