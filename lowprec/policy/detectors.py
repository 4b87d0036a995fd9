"""What counts as an instability: the controller's thresholds and detectors.

`Thresholds` is the `rollout.thresholds` section: the per-site limits (saturated
fraction, underflow as a fraction of values or of energy, SQNR) and the presets of the global detectors. The detectors are
the published ones:

* `SpikeDetector`: a value above mean + 6 sigma of the last 128 values (OLMo-core's
  stability monitor), for loss and grad norm; in a run shorter than twice that, of the
  newer half of the values seen (early training's values do not widen the limit later);
* `LargeValueDetector`: at least 10x the max of the first 100 values (Megatron-LM's
  rerun state machine);
* `LossGapDetector`: the relative gap between the smoothed loss and a baseline loss
  curve (DeepSeek-V3 kept it under 0.25% for FP8); off unless `loss_gap` is set and a
  baseline curve is given;
* `lr_sensitivity_hold`: whether the newest learning-rate sensitivity of the LR probe
  (`lowprec.runtime.session.lrprobe`) is above its hold level, which holds the next promotion.

NaN/Inf in the loss or gradients is no detector's business (`lowprec.policy.anomaly` flags it);
the detectors ignore non-finite values. `test(value)` asks without remembering (for
replays), `update(value)` also lets a normal value into the history; `rewound(step)` forgets
what the steps a rewind discarded let in. The spike and
large-value detectors run on every step (`lowprec.policy.anomaly.StepDetectors`), the loss gap at
each check; the controller owns them all (their state rides in its `state_dict`).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass

from lowprec.base.parse import ConfigError

__all__ = ["Thresholds", "intrinsic", "SpikeDetector", "LargeValueDetector", "LossGapDetector", "LR_HISTORY", "lr_hold_level",
           "lr_sensitivity_hold"]


@dataclass(frozen=True)
class Thresholds:
    """The controller's thresholds and detector presets (the defaults are the published ones)."""

    max_saturated_frac: float = 1e-3            # a site above this saturated fraction is crossing
    max_underflow_frac: float | None = None     # the same for values flushed to zero; None: off
    # the share of an operand's energy (sum of squares) flushed to zero: the underflow that
    # does harm (flushing many tiny values costs little energy); None: off
    max_underflow_energy: float | None = None
    min_sqnr_db: float | None = None            # a site below this SQNR (dB) is crossing; None: off
    site_patience: int = 2                      # checks in a row crossing before a site falls back
    # an expert routed fewer tokens than this over a check window is not judged by the site thresholds
    # ("insufficient tokens": its statistics say little), nor are its strikes reset
    min_expert_tokens: int = 32
    # a MoE layer whose routing over a check window went this far from even towards every token's
    # top k the same experts (RouterSignals.collapse, 0..1) has a router fault; None: off
    router_collapse: float | None = 0.95
    spike_window: int = 128
    spike_sigmas: float = 6.0
    spike_min_history: int = 16                 # no spike verdicts before this many values
    large_factor: float = 10.0
    large_warmup: int = 100
    # blame by replay needs the replay's evidence to clear the detector's noise by this many
    # standard deviations of its window (lowprec.policy.anomaly.StepDetectors.clears)
    blame_margin: float = 2.0
    loss_gap: float | None = None               # relative gap to the baseline curve; None: off
    loss_gap_smoothing: float = 0.9             # EMA factor of the smoothed losses

    def __post_init__(self) -> None:
        def need(ok: bool, name: str, allowed: str) -> None:
            if not ok:
                raise ConfigError(name, f"must be {allowed}, got {getattr(self, name)!r}")

        need(0 <= self.max_saturated_frac <= 1, "max_saturated_frac", "a fraction in [0, 1] (1e-3: 0.1%)")
        need(self.max_underflow_frac is None or 0 <= self.max_underflow_frac <= 1, "max_underflow_frac",
             "a fraction in [0, 1], or null (off)")
        need(self.max_underflow_energy is None or 0 <= self.max_underflow_energy <= 1, "max_underflow_energy",
             "a fraction in [0, 1] of an operand's energy (0.01: 1%), or null (off)")
        need(self.site_patience >= 1, "site_patience", ">= 1")
        need(self.min_expert_tokens >= 0, "min_expert_tokens", ">= 0 (tokens routed to an expert in a check window)")
        need(self.router_collapse is None or 0 < self.router_collapse <= 1, "router_collapse",
             "a fraction in (0, 1] of the way from even routing to collapse (0.95), or null (off)")
        need(self.spike_window >= 2, "spike_window", ">= 2")
        need(self.spike_sigmas > 0, "spike_sigmas", "> 0")
        need(2 <= self.spike_min_history <= self.spike_window, "spike_min_history",
             f">= 2 (a standard deviation needs two values) and <= spike_window ({self.spike_window})")
        need(self.large_factor > 1, "large_factor", "> 1 (a multiple of the largest early value)")
        need(self.large_warmup >= 1, "large_warmup", ">= 1")
        need(self.blame_margin >= 0, "blame_margin", ">= 0 (standard deviations of a detector's window; 0: no margin)")
        need(self.loss_gap is None or self.loss_gap > 0, "loss_gap",
             "> 0 (a relative gap: 0.03 is 3%), or null (off)")
        need(0 <= self.loss_gap_smoothing < 1, "loss_gap_smoothing", "in [0, 1) (0: no smoothing)")


    def crossed(self, sig) -> dict[str, float]:
        """A site's `SiteSignals` (one check window) that cross these thresholds, as
        `role/stat` -> value (empty: none)."""
        out = {f"{r}/saturated_frac": v for r, v in sig.saturated_frac.items() if v > self.max_saturated_frac}
        if self.max_underflow_frac is not None:
            out.update({f"{r}/underflow_frac": v for r, v in sig.underflow_frac.items()
                        if v > self.max_underflow_frac})
        if self.max_underflow_energy is not None:
            out.update({f"{r}/underflow_energy_frac": v for r, v in sig.underflow_energy_frac.items()
                        if v > self.max_underflow_energy})
        if self.min_sqnr_db is not None:
            out.update({f"{r}/sqnr_db": v for r, v in sig.sqnr_db.items() if v < self.min_sqnr_db})
        # delayed scaling saturated past twice its max in a step between checks (statistics off)
        out.update({f"{r}/overflow_steps": v for r, v in sig.overflow_steps.items() if v > 0})
        return out


# per-site signals that measure a site's own operand against its format, whatever other
# sites do (a crossing of these is independent evidence; the controller's rule 2)
_INTRINSIC_STATS = ("sqnr_db", "underflow_energy_frac")


def intrinsic(key: str) -> bool:
    """Whether a crossed `role/stat` is independent evidence against its site: anything on
    the weight, SQNR or flushed energy on any operand."""
    role, _, stat = key.partition("/")
    return role == "weight" or stat in _INTRINSIC_STATS


def insufficient_tokens(sig, th: Thresholds) -> bool:
    """An expert's window (its `SiteSignals`) with too few tokens routed to it to be judged by
    the site thresholds (`min_expert_tokens`); never so for a site that is no expert."""
    return sig.tokens is not None and sig.tokens < th.min_expert_tokens


class SpikeDetector:
    """A value above mean + `sigmas` standard deviations of the reference: the newest of the
    last `window` values, at most half of the values seen (a short run's reference forgets
    its first half, early training's large and falling values, which would otherwise widen
    the limit past any later jump), and at least `min_history`."""

    def __init__(self, window: int = 128, sigmas: float = 6.0, min_history: int = 16):
        self.window, self.sigmas, self.min_history = window, sigmas, min_history
        self.values: deque[float] = deque(maxlen=window)
        self.steps: deque[int] = deque(maxlen=window)   # the step of each value (for `rewound`)
        self.seen = 0                                    # values let in since the start (or a reset)

    def reference(self) -> list[float]:
        n = min(len(self.values), max(self.min_history, self.seen // 2))
        return list(self.values)[len(self.values) - n:]

    def test(self, value: float) -> tuple[bool, dict]:
        """(is_spike, evidence) against the current reference, remembering nothing. Non-finite
        values are no spike (NaN is handled apart)."""
        ref = self.reference()
        if not math.isfinite(value) or len(ref) < self.min_history:
            return False, {}
        n = len(ref)
        mean = sum(ref) / n
        std = math.sqrt(sum((v - mean) ** 2 for v in ref) / max(n - 1, 1))
        limit = mean + self.sigmas * std
        return value > limit, {"value": value, "mean": mean, "std": std, "limit": limit, "window": n}

    def spread(self) -> float:
        """The standard deviation of the reference (0 with fewer than two values): the noise."""
        ref = self.reference()
        n = len(ref)
        if n < 2:
            return 0.0
        mean = sum(ref) / n
        return math.sqrt(sum((v - mean) ** 2 for v in ref) / (n - 1))

    def update(self, value: float, step: int = -1) -> tuple[bool, dict]:
        """`test`, then a finite value that is no spike joins the history."""
        spike, evidence = self.test(value)
        if not spike and math.isfinite(value):
            self.values.append(value)
            self.steps.append(step)
            self.seen += 1
        return spike, evidence

    def rebase(self, level: float) -> None:
        """A persistent change of level to `level` was accepted: the history is scaled so that
        its reference's mean is `level` (its spread scales alike), so a jump from the new level
        is seen at once instead of after `min_history` new values."""
        ref = self.reference()
        mean = sum(ref) / len(ref) if ref else 0.0
        if not (math.isfinite(level) and level > 0 and mean > 0):
            return
        ratio = level / mean
        self.values = deque((v * ratio for v in self.values), maxlen=self.window)

    def rewound(self, back: int) -> None:
        """Training went back to step `back`: the values of the steps from it on are gone."""
        while self.steps and self.steps[-1] >= back:
            self.steps.pop()
            self.values.pop()
            self.seen -= 1

    def state_dict(self) -> dict:
        return {"values": list(self.values), "steps": list(self.steps), "seen": self.seen}

    def load_state_dict(self, s: dict) -> None:
        self.values = deque(s["values"], maxlen=self.window)
        self.steps = deque(s.get("steps", [-1] * len(self.values)), maxlen=self.window)
        self.seen = int(s.get("seen", len(self.values)))


class LargeValueDetector:
    """At least `factor` x the max of the first `warmup` values (Megatron-LM)."""

    def __init__(self, factor: float = 10.0, warmup: int = 100):
        self.factor, self.warmup = factor, warmup
        self.early: list[tuple[int, float]] = []   # (step, value) of the warmup values

    @property
    def seen(self) -> int:
        return len(self.early)

    @property
    def reference(self) -> float:
        return max((v for _, v in self.early), default=0.0)

    def test(self, value: float) -> tuple[bool, dict]:
        """(is_large, evidence), remembering nothing; nothing is large during the warmup."""
        if not math.isfinite(value) or self.seen < self.warmup:
            return False, {}
        limit = self.factor * self.reference
        return value >= limit, {"value": value, "reference_max": self.reference, "limit": limit}

    def update(self, value: float, step: int = -1) -> tuple[bool, dict]:
        """`test`; during the warmup a finite value raises the reference instead."""
        if math.isfinite(value) and self.seen < self.warmup:
            self.early.append((step, value))
            return False, {}
        return self.test(value)

    def rebase(self, level: float) -> None:
        """A persistent level of `level` was accepted: it becomes the reference's max (the warmup
        values scaled alike), so only `factor` x the new level is large from now on."""
        ref = self.reference
        if math.isfinite(level) and level > ref > 0:
            self.early = [(k, v * level / ref) for k, v in self.early]

    def rewound(self, back: int) -> None:
        """Training went back to step `back`: warmup values of the steps from it on are gone."""
        self.early = [(k, v) for k, v in self.early if k < back]

    def state_dict(self) -> dict:
        return {"early": [list(x) for x in self.early]}

    def load_state_dict(self, s: dict) -> None:
        if "early" in s:
            self.early = [(int(k), float(v)) for k, v in s["early"]]
        else:   # a checkpoint that kept only the count and the max
            self.early = [(-1, float(s["reference"]))] * int(s["seen"])


class LossGapDetector:
    """Relative gap between the EMA-smoothed loss and a baseline curve {step: loss}."""

    def __init__(self, baseline: dict[int, float], threshold: float, smoothing: float = 0.9):
        self.baseline = dict(sorted(baseline.items()))
        self.threshold, self.smoothing = threshold, smoothing
        self.ema: float | None = None
        self.base_ema: float | None = None
        self.accepted = 0.0   # a gap judged not precision's: fires again only this far above it
        self.history: list[tuple[int, float, float]] = []   # (step, ema, base_ema) after each update

    def accept(self, gap: float) -> None:
        """A gap of `gap` was judged not to be precision's (`lowprec.policy.attribution.judge_window`):
        the detector fires again when the gap grows `threshold` above it, or, once it has
        fallen back under `threshold`, as before."""
        self.accepted = max(0.0, float(gap))

    def _baseline_at(self, step: int) -> float | None:
        if step in self.baseline:
            return self.baseline[step]
        before = [s for s in self.baseline if s <= step]
        return self.baseline[before[-1]] if before else None

    def update(self, step: int, loss: float) -> tuple[bool, dict]:
        base = self._baseline_at(step)
        if base is None or not math.isfinite(loss):
            return False, {}
        a = self.smoothing
        self.ema = loss if self.ema is None else a * self.ema + (1 - a) * loss
        self.base_ema = base if self.base_ema is None else a * self.base_ema + (1 - a) * base
        self.history = [*self.history[-(HISTORY - 1):], (step, self.ema, self.base_ema)]
        gap = (self.ema - self.base_ema) / abs(self.base_ema)
        if gap <= self.threshold:
            self.accepted = 0.0
        ev = {"smoothed_loss": self.ema, "baseline": self.base_ema, "gap": gap, "threshold": self.threshold}
        if self.accepted:
            ev["accepted"] = self.accepted
        return gap > self.threshold + self.accepted, ev

    def rewound(self, back: int) -> None:
        """Training went back to step `back`: the smoothed losses are those before it, as if
        the steps from `back` on had never been seen."""
        self.history = [h for h in self.history if h[0] < back]
        self.ema, self.base_ema = self.history[-1][1:] if self.history else (None, None)

    def state_dict(self) -> dict:
        return {"ema": self.ema, "base_ema": self.base_ema, "accepted": self.accepted,
                "history": [list(h) for h in self.history]}

    def load_state_dict(self, s: dict) -> None:
        self.ema, self.base_ema = s["ema"], s["base_ema"]
        self.accepted = float(s.get("accepted", 0.0))   # absent before window replays
        self.history = [(int(k), float(e), float(b)) for k, e, b in s.get("history", [])]


HISTORY = 4096   # smoothed losses a LossGapDetector keeps for rewinds (more than any rewind goes back)
LR_HISTORY = 4   # earlier LR-probe results a new one is compared with (lr_hold_level)


def lr_hold_level(history: list[tuple[int, float]], hold_rise: float | None,
                  hold_above: float | None) -> tuple[float | None, dict]:
    """The level above which the newest LR sensitivity in `history` ((step, sensitivity) of
    the probes so far, oldest first) holds a promotion, and how it was found.

    The lower of `hold_above` (a sensitivity above 0 means that even on the batch its
    gradient came from, the doubled step lowers the loss less than the halved one: the lr is
    past the locally best step size) and the median of the `LR_HISTORY` finite values before
    the newest plus `hold_rise` (the sensitivity rose); that second one only once
    `LR_HISTORY` earlier probes exist. None of them (both off, or too few probes): None."""
    levels, how = [], {}
    if hold_above is not None:
        levels.append(hold_above)
        how["hold_above"] = hold_above
    earlier = [v for _, v in history[-LR_HISTORY - 1:-1] if math.isfinite(v)]
    if hold_rise is not None and len(history) > LR_HISTORY and earlier:
        ref = statistics.median(earlier)
        levels.append(ref + hold_rise)
        how.update(median_before=ref, hold_rise=hold_rise)
    return (min(levels) if levels else None), how


def lr_sensitivity_hold(history: list[tuple[int, float]], hold_rise: float | None,
                        hold_above: float | None) -> tuple[bool, dict]:
    """Whether the newest LR sensitivity holds a promotion (it is above `lr_hold_level`; an
    infinite one, a virtual step that diverged, is above any level, a NaN above none), and
    the evidence."""
    if not history:
        return False, {}
    step, latest = history[-1]
    level, how = lr_hold_level(history, hold_rise, hold_above)
    if level is None or math.isnan(latest):
        return False, {}
    return latest > level, {"lr_sensitivity": latest, "probe_step": step, "hold_level": level, **how}
