"""The staged-rollout controller: promote stages, fall back on instability, never flap.

`RolloutController` is a state machine over *sites* (layer FQNs), each with a ladder of
formats from low to high precision (`nvfp4 -> fp8_tensorwise -> bf16`). It never touches
a model. Every step, `detect(step, loss, grad_norm)` looks at the two numbers the loop
reads on the host for a global anomaly (`lowprec.policy.anomaly`: NaN/Inf, loss or grad-norm
spike, large value), and `observe_step(step, anomaly, signals, attribution)` returns a
`Decision` (continue / skip the step / rewind) with the format changes and the `Event`s
that explain them; `apply_decision(state, decision)` carries the changes out on a
`PrecisionState`. Its tests feed it numbers and need no model.

An anomalous step is never applied, and it is decided at its own step. With the replays
of `lowprec.policy.attribution` (the session replays the step with sites in high precision):
the sites whose precision caused it fall back one rung each, nothing else moves (only on
evidence that clears the detectors' noise margin, `Thresholds.blame_margin`: a replay just
under the limit is an INCONCLUSIVE event and demotes nothing); when
the anomaly persists with every site in high precision, precision is not to blame and
nothing is demoted (the step is skipped; an anomaly on `persist_steps` steps in a row
rewinds when the loss is off and rewind is on). Anomalies on consecutive steps that do not
rewind are a burst: each of its steps is skipped and the detectors keep their histories.
Only an anomaly on `accept_after` steps in a row (a finite one) outlasts a burst: its level
(the median of those steps' values) is accepted as the new normal, the detectors that fired
rebased on it, so that a grad norm that stays higher is not skipped forever. Without replays (no
closure), the anomaly is handed to the next check's rules.

The rules below, applied at each check (`observe`) in this order, decide what to change
from the check window's statistics:

0. A MoE layer whose router is collapsed over the window (`Signals.routers`, all ranks'
   tokens: `collapse` at or above `router_collapse`): its experts' statistics say how the
   router sent tokens, not how their formats did, so rules 1 and 2 do not judge them. The
   check at which a layer's router collapses (the first, or one after a check below the level)
   is a router fault: a ROUTER_FAULT event names the layer and the window's anomalies are put
   down to the router (rule 3 does not roll a stage back for them). Nothing is demoted for it,
   and it is no precision instability (the promotion schedule goes on).

1. NaN/Inf in the loss or gradients during the window: the sites whose own statistics
   saw NaN/Inf fall back one rung; if none did, the newest stage rolls back.
2. A site whose own signals cross their thresholds (saturated fraction, underflow as a
   fraction of values or of the operand's energy, SQNR) for `site_patience` checks in a
   row falls back one rung up its ladder. Every site whose evidence is its own (any
   crossing on its weight; SQNR or flushed energy on any operand) falls back in the same
   check; of the sites with only saturation or flushed-value counts on an input or
   grad_output, which may be inherited from another site's overflow, one per check and
   only when no site fell back on its own evidence.
3. A global signal (an anomaly no replay explained, NaN/Inf, the loss gap to the
   baseline) while some site's thresholds are crossed blames that site; with none, a slow
   signal (the loss gap alone, or an eval checkpoint's regression: `observe_gate`) is
   first judged by its window, and otherwise the newest stage rolls back (with a rewind
   when `rewind` is on). That half of the controller is `lowprec.policy.drift`.
4. A site that failed `quarantine_after` times is quarantined: it never goes below its
   current format again in this run. Other fallen-back sites retry their stage's format
   after `cooldown_steps`.
5. The next stage is promoted once everything has been stable for `min_steps` and the
   evaluation gate (a callable the check is handed, `observe(..., gate=)`) passes, and the newest learning-rate
   sensitivity (`Signals.lr_sensitivity`, from `lowprec.runtime.session.lrprobe`, when the probe
   runs) is not above its hold level (`lr_hold_level`: above 0, or risen above its recent
   median); otherwise the promotion is held (a HOLD event) and asked again after another
   `min_steps`.

Decisions are deterministic functions of the inputs (sites are visited in a fixed
order), so every rank that sees the same numbers (and replays alike) decides the same.
"""

from __future__ import annotations

import statistics
from typing import Callable

from lowprec.base.parse import ConfigError
from lowprec.numerics.formats import Format, get_format
from lowprec.policy.anomaly import Anomaly, StepDetectors
from lowprec.policy.attribution import Attribution
from lowprec.policy.decisions import Action, ControllerConfig, Decision, Stage, apply_decision
from lowprec.policy.detectors import (LR_HISTORY, Thresholds, insufficient_tokens, intrinsic, lr_hold_level,
                                     lr_sensitivity_hold)
from lowprec.policy.drift import Judge, SlowSignalRules
from lowprec.policy.ladder_moves import LadderMoves, _high
from lowprec.policy.events import Event, EventKind
from lowprec.policy.monitor import Signals
from lowprec.policy.verdicts import GateOutcome

Gate = Callable[[int], GateOutcome]   # gate(step): an evaluation before a promotion

__all__ = ["Action", "Stage", "Thresholds", "ControllerConfig", "Decision", "RolloutController", "apply_decision",
           "lr_hold_level", "lr_sensitivity_hold", "LR_HISTORY"]

_FORWARD_ROLES = ("input", "weight", "output")


# events of a window judgment that are no instability: its looks, a verdict of not precision, a router's fault
_JUDGING = (EventKind.WINDOW, EventKind.NOT_PRECISION, EventKind.ROUTER_FAULT)


def _cleared(d: Decision) -> bool:
    """Whether a check's events are a window judgment that cleared precision, and nothing else
    (no rewind): the check goes on to retries and promotion."""
    return (d.action is not Action.REWIND and all(e.kind in _JUDGING for e in d.events)
            and any(e.kind in (EventKind.NOT_PRECISION, EventKind.ROUTER_FAULT) for e in d.events))


class RolloutController(SlowSignalRules, LadderMoves):
    """Stages, fallbacks, rollbacks, cooldowns and quarantine over a set of sites."""

    def __init__(self, ladders: dict[str, tuple[Format | str, ...]], initial: dict[str, str],
                 stages: list[Stage], config: ControllerConfig = ControllerConfig(), *,
                 baseline: dict[int, float] | None = None):
        self.ladders: dict[str, tuple[Format, ...]] = {k: tuple(map(get_format, v)) for k, v in ladders.items()}
        for i, s in enumerate(stages):
            for site in s.sites:
                if site not in self.ladders:
                    raise ConfigError(f"rollout.stages[{i}]", f"stage {s.name!r} names site {site!r}, which is "
                                                              f"not a site")
                if get_format(s.format) not in self.ladders[site]:
                    raise ConfigError(f"rollout.stages[{i}].format", (
                        f"stage {s.name!r} puts {site!r} in {s.format}, which is not on its ladder "
                        f"{self._ladder_text(site)}: give the precision.rules entry that selects {site!r} a "
                        f"`ladder:` with {s.format} on it (a rule without one keeps its sites at their format)"))
        self.order = list(self.ladders)   # forward order: the order the caller lists sites in
        for site, fmt in initial.items():
            if site in self.ladders and get_format(fmt) not in self.ladders[site]:
                raise ConfigError("precision.rules", f"site {site!r} starts in {fmt}, which is not on its ladder "
                                                     f"{self._ladder_text(site)}; put {fmt} on the rule's `ladder:`")
        self.initial = dict(initial)
        self.current = dict(initial)
        self.stages = list(stages)
        self.config = config
        self.detectors = StepDetectors(config.thresholds)
        self._init_slow_signals(config.thresholds, baseline)   # the loss gap and the judge
        self.promoted = 0                     # stages promoted so far
        self.stable_since = 0                 # step of the last change or instability
        self.formats_changed_at = -1          # the check that last changed a format (-1: none)
        self.stage_of: dict[str, str] = {}    # site -> name of the stage that promoted it
        self.target: dict[str, str] = {}      # site -> format its stage wants
        self.failures: dict[str, int] = {}
        self.strikes: dict[str, int] = {}
        self.floor: dict[str, str] = {}       # quarantined site -> lowest format allowed
        self.retry_at: dict[str, int] = {}    # fallen-back site -> step it may retry
        self.before_stage: dict[str, str] = {}  # site -> format before its stage promoted it
        self.stage_failures: dict[str, int] = {}
        self.pending: list[tuple[str, dict]] = []   # anomalies no replay explained: for the next check
        self.streak = 0                       # consecutive anomalous steps that were not precision's
        self.burst: list[tuple[float, float]] = []   # their (loss, grad norm)
        self.last_anomaly = -2                # step of the last such anomaly
        self.lr_history: list[tuple[int, float]] = []   # (step, LR sensitivity) of the last probes
        self.collapsed: set[str] = set()      # experts modules whose router was collapsed at the last check

    # ------------------------------------------------------------------ the decision
    def detect(self, step: int, loss: float, grad_norm: float) -> Anomaly | None:
        """This step's global anomaly, if any (see `lowprec.policy.anomaly`); call once per step with
        the host values of the loss and the global grad norm, before `observe_step`."""
        return self.detectors.observe(step, loss, grad_norm)

    def rewound(self, back: int) -> None:
        """Training went back to step `back`: the detectors forget what the steps from it on
        let in (their losses and grad norms are not the run's any more), and anomalies of
        those steps that wait for a check are dropped."""
        self.detectors.rewound(back)
        if self.loss_gap is not None:
            self.loss_gap.rewound(back)
        self.pending = [(names, ev) for names, ev in self.pending if ev.get("step", -1) < back]

    def replay_candidates(self) -> tuple[list[str], list[list[str]]]:
        """What a replay may put in high precision: the low-precision sites in forward
        order, and the groups to try first (the promoted stages, newest first, then the
        sites that were low precision before any stage)."""
        low = [s for s in self.order if not _high(self.current[s])]
        groups = [[s for s in self.stages[i].sites if self.stage_of.get(s) == self.stages[i].name]
                  for i in reversed(range(self.promoted))]
        groups.append([s for s in low if s not in self.stage_of])
        return low, [g for g in groups if g]

    def observe_step(self, step: int, anomaly: Anomaly | None = None, signals: Signals | None = None,
                     attribution: Attribution | None = None, *, gate: Gate | None = None,
                     judge: Judge | None = None) -> Decision:
        """The decision for one training step, after backward and before optimizer.step().

        anomaly: `detect`'s verdict for this step. An anomalous step is never applied.
        With `attribution` (the replays of `lowprec.policy.attribution`), it is decided now: the
        sites blamed fall back, or, when precision is not to blame, nothing is demoted and
        a loss anomaly that persists for `persist_steps` steps rewinds. Without one (no
        replay was possible), the anomaly waits for the next check's rules.
        signals: the check's Signals on a check step (None between checks).
        gate, judge: the callables a check may call back (see `observe`)."""
        d = Decision()
        if anomaly is not None:
            self._on_anomaly(step, anomaly, attribution, d)
        if signals is not None:
            checked = self.observe(step, signals, gate=gate, judge=judge)
            d.changes.update(checked.changes)
            d.events += checked.events
            if checked.action is Action.REWIND and d.action is not Action.REWIND:
                d.action, d.skip_batches = Action.REWIND, checked.skip_batches
        return d

    def _on_anomaly(self, step: int, a: Anomaly, attribution: Attribution | None, d: Decision) -> None:
        d.action = Action.SKIP_STEP
        if attribution is None:
            if not a.nonfinite:   # NaN reaches the check through the window's losses
                self.pending.append((a.names, {**a.to_evidence(), "step": step}))
            d.events.append(Event(step, EventKind.SKIP_STEP, (), {}, {}, f"{a.names}: step skipped",
                                  {"finite": not a.nonfinite, **a.to_evidence()}))
            return
        for r in attribution.replays:
            said = ("still " + a.names if r.anomalous else "clean" if r.clears
                    else "under the limit, but inside the noise margin")
            d.events.append(Event(step, EventKind.REPLAY, r.high_precision, {}, {}, (
                f"replayed with {len(r.high_precision)} site(s) in high precision: {said}"), r.to_evidence()))
        evidence = {**a.to_evidence(), **attribution.evidence}
        if attribution.inconclusive:   # a suspicion the noise cannot tell from chance: recorded, not acted on
            d.events.append(Event(step, EventKind.INCONCLUSIVE, (), {}, {}, (
                f"{a.names}: gone in high precision, but by less than {self.config.thresholds.blame_margin:g} "
                f"standard deviations of the detector's window either side of its limit: precision not blamed"),
                {**evidence, "margins": attribution.replays[0].margins or {}}))
        if attribution.precision_to_blame:
            for site in attribution.blamed:
                self._fallback(site, step, f"{a.names} gone when replayed with this site in high precision",
                               evidence, d)
            d.events.append(Event(step, EventKind.SKIP_STEP, (), {}, {}, (
                f"{a.names}: precision to blame ({len(attribution.blamed)} site(s))"), evidence))
            self.streak, self.burst = 0, []
            self.stable_since = step
            return
        if step - self.last_anomaly != 1:
            self.streak, self.burst = 0, []
        self.streak += 1
        if not a.nonfinite:
            self.burst = [*self.burst, (a.loss, a.grad_norm)][-self.config.accept_after:]
        self.last_anomaly = step
        cfg = self.config
        rewind = self.streak >= cfg.persist_steps and a.loss_is_off and cfg.rewind
        accept = not rewind and not a.nonfinite and self.streak >= cfg.accept_after
        if not accept:   # an accepted step is applied: no skip to record
            d.events.append(Event(step, EventKind.SKIP_STEP, (), {}, {}, (
                f"{a.names} persists with every site in high precision: not precision, nothing demoted"),
                {**evidence, "streak": self.streak}))
        if rewind:
            # the first anomalous step of the streak saw weights the step before it wrote
            d.action, d.skip_batches = Action.REWIND, cfg.rewind_skip_batches
            d.rewind_before = step - cfg.persist_steps
            d.events.append(Event(step, EventKind.REWIND, (), {}, {}, (
                f"rewind: {a.names} for {cfg.persist_steps} steps in a row, not precision's"),
                {"skip_batches": d.skip_batches, **a.to_evidence()}))
        elif accept:
            # the gradients alone (the loss is fine), or nothing to go back to, beyond a burst:
            # skipping more steps would stop training; the new level becomes the normal one
            d.action = Action.CONTINUE
            loss, grad_norm = (statistics.median(v) for v in zip(*self.burst))
            self.detectors.accept_level(a, loss, grad_norm)
            why = "rewind is off" if a.loss_is_off else "the loss is not off"
            d.events.append(Event(step, EventKind.ACCEPT, (), {}, {}, (
                f"{a.names} for {self.streak} steps in a row (a burst is shorter than {cfg.accept_after}) "
                f"and {why}: the step is applied and the detectors that fired are rebased on the level "
                "of those steps (their median)"), {**a.to_evidence(), "level_loss": loss, "level_grad_norm": grad_norm}))
        else:
            return
        self.streak, self.burst = 0, []

    def observe(self, step: int, signals: Signals, *, gate: Gate | None = None,
                judge: Judge | None = None) -> Decision:
        """One check: the rules (see the module docstring) over the window's Signals. The
        action is CONTINUE or REWIND; skipping a non-finite step is `observe_step`'s.
        gate(step): an evaluation before a promotion (None: promote without one); judge: a slow
        signal's window judgment (`lowprec.policy.drift`; None: roll the newest stage back).
        The caller that owns them (the session) hands them to every call, so the controller is
        built before them and keeps neither."""
        d = Decision()
        th = self.config.thresholds
        self.record_lr_sensitivity(step, signals.lr_sensitivity)
        routed = self._router_faults(step, signals, d)   # 0. experts of collapsed routers: not judged
        # 1. non-finite: observe_step skipped those steps; here the blame. Forward operands
        # only: in the backward every gradient is NaN once the loss is. The first site in
        # forward order whose input, weight or output is non-finite is the origin; its
        # consumers inherit the NaN.
        blamed: list[str] = []
        nan_sites = [s for s in self.order if s in signals.sites and s not in routed and not _high(self.current[s]) and
                     any(signals.sites[s].nonfinite.get(r, 0) > 0 for r in _FORWARD_ROLES)]
        if nan_sites:
            site = nan_sites[0]
            blamed.append(site)
            sig = signals.sites[site]
            self._fallback(site, step, "NaN/Inf in this site's forward operands",
                           {f"{r}/nonfinite": v for r, v in sig.nonfinite.items() if v > 0}, d)
        # 2. per-site thresholds. Evidence intrinsic to a site's own operand against its
        # format is independent of the other sites: any crossing on its weight, and an SQNR
        # or flushed-energy crossing on any operand (the format is too coarse for the values
        # the site gets). Every site with such evidence whose patience ran out falls back in
        # this check. Saturation (or the count of flushed values) on an input or grad_output
        # may be inherited: an overflow entering a layer saturates its consumers too, and a
        # gradient overflow flows backwards. Of the sites with only such evidence, one falls
        # back per check, and only when no site fell back on independent evidence (it may be
        # the cause): the first in forward order with input crossing, else the last in
        # forward order (first in backward order) with grad_output crossing. The others are
        # looked at again at the next check.
        suspects: list[tuple[tuple[int, int], str, dict]] = []
        for i, site in enumerate(self.order if not blamed else ()):
            sig = signals.sites.get(site)
            if sig is None or site in routed or _high(self.current[site]) or insufficient_tokens(sig, th):
                continue
            crossed = th.crossed(sig)
            if not crossed:
                self.strikes[site] = 0
                continue
            self.strikes[site] = self.strikes.get(site, 0) + 1
            forward = any(k.split("/")[0] in _FORWARD_ROLES for k in crossed)
            suspects.append(((0, i) if forward else (1, -i), site, crossed))
        suspects.sort(key=lambda t: t[0])
        due = [(site, crossed) for _, site, crossed in suspects if self.strikes[site] >= th.site_patience]
        independent = sorted(((site, crossed) for site, crossed in due if any(map(intrinsic, crossed))),
                             key=lambda t: self.order.index(t[0]))   # in forward order
        for site, crossed in independent or due[:1]:
            blamed.append(site)
            self._fallback(site, step, f"site thresholds crossed for {self.strikes[site]} checks"
                           f"{' (its own operand against its format)' if independent else ''}", crossed, d)
        suspects = [(site, crossed) for _, site, crossed in suspects]
        # 3. global signals (lowprec.policy.drift); a window with a router fault: the router's
        if any(e.kind == EventKind.ROUTER_FAULT for e in d.events):
            self.pending = []
        else:
            self._global_rule(step, signals, blamed, suspects, d, judge)
        if d.events and not _cleared(d):
            if any(e.kind not in _JUDGING for e in d.events):
                self.stable_since = step   # an instability: the schedule starts over
            return d
        # 4. retries after cooldown
        due = [s for s in self.order if s in self.retry_at and step >= self.retry_at[s]]
        if due:
            to = {s: self.target[s] for s in due if s in self.target}
            for s in due:
                self.retry_at.pop(s)
            self._move(due, to, EventKind.RETRY, step, "cooldown over", {}, d)
        # 5. promotion
        if step - self.stable_since >= self.config.min_steps and self.promoted < len(self.stages):
            self._promote(step, d, gate)
        if any(e.kind not in _JUDGING for e in d.events):
            self.stable_since = step
        return d

    def _router_faults(self, step: int, signals: Signals, d: Decision) -> set[str]:
        """Rule 0: the expert sites of collapsed routers; a ROUTER_FAULT event per router that collapsed now."""
        limit = self.config.thresholds.router_collapse
        out: set[str] = set()
        was, self.collapsed = self.collapsed, set()
        for layer, r in sorted(signals.routers.items()):
            if limit is None or r.collapse < limit:
                continue
            self.collapsed.add(layer)
            out |= {s for s in self.order if s.rpartition(".")[0] == layer}
            if layer in was:
                continue
            d.events.append(Event(step, EventKind.ROUTER_FAULT, (), {}, {}, (
                f"router fault: {layer} sent its tokens to few experts ({r.collapse:.0%} of the way from even to "
                f"every token's top k the same; {r.busiest} {r.max_over_mean:.2f}x the mean): routing, not "
                f"precision; its experts are not judged and nothing is demoted"), {"layer": layer, **r.to_evidence()}))
        return out

    def record_lr_sensitivity(self, step: int, value: float | None) -> None:
        """Keep an LR probe's sensitivity (None: no probe at this check) for the promotion hold."""
        if value is not None:
            self.lr_history = [*self.lr_history, (int(step), float(value))][-(LR_HISTORY + 1):]

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict:
        return {"version": 1, "current": dict(self.current), "promoted": self.promoted,
                "stable_since": self.stable_since, "formats_changed_at": self.formats_changed_at,
                "stage_of": dict(self.stage_of),
                "target": dict(self.target), "failures": dict(self.failures), "strikes": dict(self.strikes),
                "floor": dict(self.floor), "retry_at": dict(self.retry_at),
                "before_stage": dict(self.before_stage), "stage_failures": dict(self.stage_failures),
                "pending": [[name, ev] for name, ev in self.pending], "streak": self.streak,
                "burst": [list(v) for v in self.burst],
                "last_anomaly": self.last_anomaly, "lr_history": [[s, v] for s, v in self.lr_history],
                "collapsed": sorted(self.collapsed),
                "detectors": {**self.detectors.state_dict(),
                              "loss_gap": self.loss_gap.state_dict() if self.loss_gap else None}}

    def load_state_dict(self, s: dict) -> None:
        if s.get("version") != 1:
            raise ValueError(f"unknown controller state version {s.get('version')!r}; expected 1")
        unknown = set(s["current"]) - set(self.ladders)
        if unknown:
            raise ValueError(f"controller state names sites this model lacks: {sorted(unknown)[:5]}")
        self.current = dict(s["current"])
        self.promoted, self.stable_since = int(s["promoted"]), int(s["stable_since"])
        self.formats_changed_at = int(s.get("formats_changed_at", -1))   # absent before deferred windows
        for name in ("stage_of", "target", "failures", "strikes", "floor", "retry_at", "before_stage",
                     "stage_failures"):
            setattr(self, name, dict(s[name]))
        self.pending = [(name, ev) for name, ev in s.get("pending", [])]   # absent before per-step detection
        self.streak, self.last_anomaly = int(s.get("streak", 0)), int(s.get("last_anomaly", -2))
        self.burst = [(float(x), float(g)) for x, g in s.get("burst", ())]   # absent before burst-aware acceptance
        self.lr_history = [(int(st), float(v)) for st, v in s.get("lr_history", ())]   # absent before the probe
        self.collapsed = set(s.get("collapsed", ()))   # absent before router signals
        det = s["detectors"]
        self.detectors.load_state_dict(det)
        if self.loss_gap is not None and det["loss_gap"] is not None:
            self.loss_gap.load_state_dict(det["loss_gap"])
