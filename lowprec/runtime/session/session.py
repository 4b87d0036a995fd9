"""`Session`: what a training loop holds to get the staged rollout, the monitors, skips and rewinds.

    session = Session.from_yaml("rollout.yaml", model, optimizer, scheduler=scheduler)
    for x, y in batches:
        def closure():
            loss = model(x, y)
            loss.backward()
            return loss
        loss = closure()
        session.step(loss, closure)   # clip, decide, then step / skip / rewind, schedule, zero grads

`step(loss, closure)` does what the decision says, itself: it clips the gradients (or
takes the caller's grad norm), reads the loss and the global grad norm on the host (one
read per step) and looks for a global anomaly (NaN/Inf, loss or grad-norm spike,
`lowprec.policy.anomaly`). An anomalous step is never applied; with a `closure` (the step's
forward and backward again, as `torch.optim.Optimizer.step(closure)` takes it) it is
first replayed with sites in high precision (`lowprec.policy.attribution`, at most
`max_replays` times): the sites whose precision caused it fall back, and a fault that
precision did not cause demotes nothing. Everything else (the quantizer statistics and
their rules) is read once per check. Then format changes are applied, and the optimizer
steps, or the step is skipped (the optimizer never sees the gradients: AdamW's moments
and step count stay as they were), or the run rewinds: model, optimizer, scheduler and
RNG go back to a snapshot (`lowprec.runtime.session.snapshots`), the data simply goes on (the
batches in between are skipped, and `skip_batches` more when the data source can skip).
The loop has no rewind code: it reads `session.step_index` if it counts steps.

A loop that steps the optimizer itself (a framework's: `lowprec.integrations`) uses the
two halves of `step`: `decide(loss, closure)` before its optimizer step (then
`withhold_gradients()` unless the decision is CONTINUE) and `finish(result)` after its
optimizer and scheduler stepped.

With `rollout.lr_probe` on (or an `lr_probe=` given), every `every_checks`-th check step
starts with the learning-rate probe (`lowprec.runtime.session.lrprobe`: a virtual step at lr x2
and x0.5 on a held batch, everything restored), before the step's batch; its sensitivity
reaches the controller in that check's `Signals.lr_sensitivity`.

The same object drives `lowprec run`'s loop (`lowprec.runtime.trainer.loop`) under one process,
DP x TP and pipeline stages: `clip` is then the engine's global-norm clip, `sites` every
site of the model (a pipeline rank holds some), and every rank decides alike.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from lowprec.policy.attribution import Attribution
from lowprec.policy.controller import Action, Decision, RolloutController, apply_decision
from lowprec.policy.events import Event, EventLog
from lowprec.policy.monitor import Monitor
from lowprec.runtime.session.lrprobe import LRProbe, ProbeResult
from lowprec.runtime.session.replay import StepReplayer
from lowprec.runtime.session.session_parts import (StepResult, _default_clip, _EvalTimedGate, _probe_from_config,
                                           attribute_by_replay, measure_on_host)
from lowprec.runtime.session.session_settings import SessionSettings
from lowprec.runtime.session.snapshots import MemorySnapshots, Snapshots
from lowprec.runtime.session.window import WindowReplayer
from lowprec.tracking.phases import NULL_CLOCK, LapClock, Phase, counted_as

__all__ = ["Session", "SessionSettings", "StepResult"]


class Session:
    """Monitor + controller + snapshots around one training loop (see the module docstring)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer, state,
                 controller: RolloutController | None = None, *, settings: SessionSettings | None = None,
                 scheduler=None, data=None, snapshots: Snapshots | None = None,
                 clip: Callable[[], torch.Tensor] | None = None, lr_probe: LRProbe | None = None,
                 held_batch: tuple[torch.Tensor, torch.Tensor] | None = None, sites: list[str] | None = None,
                 group=None, event_log: str | Path | None = None,
                 on_events: Callable[[list[Event]], None] | None = None, start_step: int = 0,
                 clock: LapClock = NULL_CLOCK, gate: Callable[[int], Any] | None = None):
        """The config section: `settings` (`SessionSettings.from_rollout(rollout)`; default, the
        defaults). The objects it drives: `model`, `optimizer`, `scheduler`, `data` (skipped
        on a rewind), `state` (the PrecisionState of `lowprec.prepare(model, plan)`, this rank's
        sites) and `controller` (`lowprec.policy.rollout.build_controller`; None runs the plan
        as it is: no statistics, no decisions, every step applied).
        snapshots: where rewinds go back to; default, when the controller may rewind or judge a
            window, in-memory snapshots as `settings` say.
        clip: returns the (global) grad norm after clipping; default clip_grad_norm_ over the
            model's parameters with `settings.max_grad_norm`.
        lr_probe: the learning-rate probe run at the start of its check steps (needs a
            controller); default, when `settings.lr_probe` is enabled, `LRProbe.for_model` on
            `held_batch` (x, y), a batch training never draws, the same on every rank.
        sites: every site of the model in forward order, when `state` holds only this rank's (a
            pipeline stage); group: the process group the monitor combines over.
        clock: laps the step's phases (the run's telemetry's, counting from its `begin()`).
        gate: gate(step), an evaluation before each promotion (`EvalCheckpoints.gate`), handed to
            the controller at every check with the window's judge.
        """
        cfg = settings or SessionSettings()
        self.model, self.optimizer, self.state = model, optimizer, state
        self.controller, self.scheduler, self.data = controller, scheduler, data
        self.clip = clip or _default_clip(model, cfg.max_grad_norm)
        self.clock = clock
        self.gate = _EvalTimedGate(gate, clock) if gate is not None else None   # booked as `eval` time
        self.step_index = start_step
        self.events: list[Event] = []
        self.last_signals = None
        self.rewinds = 0
        self.skipped = 0
        # the event log's one writer until close() (WriterBusyError: a live process writes it)
        self.log = EventLog(event_log, exclusive=True) if event_log is not None else None
        self.on_events = on_events
        self.monitor = None
        self.group = group
        self.max_replays = cfg.max_replays
        self.replayer: StepReplayer | None = None
        self.window: WindowReplayer | None = None
        self._remote: set[str] = set()
        self.monitor_config = cfg.monitor
        if controller is not None and cfg.max_replays > 0:
            self.replayer = StepReplayer(state, optimizer, self._measure)
            self.replayer.attach(model)
        if controller is not None:
            self.monitor = Monitor(state, self.monitor_config, group=group, sites=sites)
            self._remote = set(sites or ()) - set(state.sites)
            judged = cfg.window_close is not None and controller.loss_gap is not None
            if snapshots is None and (controller.config.rewind or judged):
                snapshots = self._default_snapshots(cfg.snapshot_every, cfg.snapshot_keep)
            if judged:
                self.window = WindowReplayer(model, optimizer, state, controller, snapshots, clip=self.clip,
                                             measure=self._measure, close=cfg.window_close,
                                             max_windows=cfg.window_replays, max_looks=cfg.max_replays,
                                             min_length=self.monitor_config.check_every)
        else:
            state.collect_stats(False)   # no monitor reads them: quantize without statistics
        self.snapshots = snapshots
        self._window_judge = self.window.judge if self.window is not None else None   # handed over at each check
        if self.snapshots is not None:
            self.snapshots.after_step(start_step)
        self.lr_probe = lr_probe
        self.lr_probe_result: ProbeResult | None = None   # the newest probe
        self._probed: tuple[int, int] | None = None         # (step, rewinds) it ran at
        if lr_probe is None and controller is not None and cfg.lr_probe is not None and cfg.lr_probe.enabled:
            self.lr_probe = _probe_from_config(cfg.lr_probe, model, optimizer, state, self.clip, held_batch)
        self._prepare(start_step)

    def _default_snapshots(self, every: int, keep: int) -> MemorySnapshots:
        """In-memory snapshots for rewinds, or for a window replay to start from (never rewound to)."""
        if self.controller.config.rewind and every * (keep - 1) < self.rewind_margin:
            raise ValueError(f"rollout.rewind: {keep} snapshots every {every} steps never reach "
                             f"{self.rewind_margin} steps back (two checks, where a rewind goes); keep at least "
                             f"{-(-self.rewind_margin // every) + 1} snapshots or take them more often")
        return MemorySnapshots(self.model, self.optimizer, every=every, keep=keep, margin=self.rewind_margin,
                               scheduler=self.scheduler, data=self.data)

    @property
    def rewind_margin(self) -> int:
        """How far before the step that noticed a fault a rewind must go: two checks."""
        return 0 if self.controller is None else 2 * self.monitor_config.check_every

    # ------------------------------------------------------------------ building
    @classmethod
    def build(cls, model: nn.Module, optimizer: torch.optim.Optimizer, plan, rollout=None, *, seed: int = 0,
              baseline: dict[int, float] | None = None, **kwargs) -> "Session":
        """prepare(model, plan) and a controller from the parsed `rollout:` section (`gate=` and the
        other keywords go to the constructor)."""
        from lowprec.policy.rollout import build_controller
        from lowprec.sites.precision_state import prepare
        state = prepare(model, plan, seed=seed)
        controller = None if rollout is None else build_controller(rollout, state, model, baseline=baseline)
        kwargs.setdefault("settings", SessionSettings.from_rollout(rollout))
        return cls(model, optimizer, state, controller, **kwargs)

    @classmethod
    def from_yaml(cls, path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer, **kwargs) -> "Session":
        """Build from a YAML file's `precision:` and (optional) `rollout:` sections."""
        from lowprec.config import ConfigRole, LowprecConfig
        from lowprec.runtime.session.host import read_baseline
        cfg = LowprecConfig.from_yaml(path, role=ConfigRole.SESSION)
        baseline = kwargs.pop("baseline", None) or read_baseline(cfg)   # a losses file beside the YAML, as every host
        return cls.build(model, optimizer, cfg.precision, cfg.rollout, baseline=baseline, **kwargs)

    # ------------------------------------------------------------------ the step
    def _prepare(self, step: int) -> None:
        with counted_as(self.clock, Phase.LR_PROBE):
            self._probe_lr(step)   # before arm(): the probe's forwards must not take the step-start hook
        if self.replayer is not None:
            self.replayer.arm()
        if self.monitor is not None:
            self.monitor.before_step(step)   # statistics on check steps only
        else:
            self.state.collect_stats(False)
        self.clock.lap(Phase.MONITOR)

    # ---- the LR probe (lowprec.runtime.session.lrprobe): at the start of its check steps, no gradients yet
    def _probe_lr(self, step: int) -> None:
        """Run the LR probe if `step` is one of its check steps (every `every_checks`-th
        regular check, forced checks not counted) and it has not run for this step yet."""
        probe, mon = self.lr_probe, self.monitor
        if probe is None or mon is None or (step + 1) % mon.config.check_every != 0:
            return
        if not probe.is_due((step + 1) // mon.config.check_every):
            return
        if self._probed == (step, self.rewinds):
            return   # _prepare again at the same step (after an evaluation): same weights, same answer
        self.lr_probe_result, self._probed = probe(step), (step, self.rewinds)   # a rewind back here probes again

    def _lr_sensitivity(self, step: int) -> float | None:
        """The sensitivity the probe measured at the start of `step`, None if it did not run there."""
        r = self.lr_probe_result
        return r.sensitivity if r is not None and r.step == step else None

    def resume_at(self, step: int) -> None:
        """Go on from `step` (a checkpoint's, after `load_state_dict`): the next step concluded is
        `step`, and in-memory snapshots start there."""
        self.step_index = step
        if isinstance(self.snapshots, MemorySnapshots):
            self.snapshots.take(step)

    def resume_statistics(self) -> None:
        """After something switched quantizer statistics off (an evaluation), set them as the
        current step wants them (on for check steps only)."""
        self._prepare(self.step_index)

    def step(self, loss: torch.Tensor, closure: Callable[[], torch.Tensor] | None = None, *,
             grad_norm: torch.Tensor | None = None, forward: Callable[[], torch.Tensor] | None = None) -> StepResult:
        """Conclude the current step after backward: see the module docstring.

        closure: runs this step's forward and backward again on the same batch and returns
        the loss (for replays; without it an anomaly waits for the next check).
        grad_norm: the global grad norm when the caller clipped already.
        forward: the step's forward alone on the same batch, returning the loss (optional: the
        first look of a window judgment then costs a forward instead of a forward and backward)."""
        result = self.decide(loss, closure, grad_norm=grad_norm, forward=forward)
        if result.decision.action is Action.REWIND and self._rewind(result):
            self.optimizer.zero_grad(set_to_none=True)
            return result
        if result.decision.action is Action.CONTINUE:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()
        self.clock.lap(Phase.OPTIMIZER)
        self._next(result)
        return result

    # ---- the same step in two halves, for a loop that steps the optimizer itself (a framework's)
    def decide(self, loss: torch.Tensor, closure: Callable[[], torch.Tensor] | None = None, *,
               grad_norm: torch.Tensor | None = None, forward: Callable[[], torch.Tensor] | None = None) -> StepResult:
        """The first half of `step`: clip, measure, replay, decide and apply format changes;
        nothing is stepped. `result.decision.action` is CONTINUE when the optimizer may step;
        otherwise the caller must keep the gradients from it (`withhold_gradients`). Then the
        caller's loop steps the optimizer and the scheduler, and calls `finish(result)`."""
        s = self.step_index
        if self.monitor is not None:
            # with a closure an anomalous step is replayed, which finds a NaN's origin: the
            # monitor need not count non-finite outputs on the next check steps
            self.monitor.origins_by_replay(closure is not None and self.replayer is not None)
        if grad_norm is None:
            grad_norm = self.clip()
        self.clock.lap(Phase.OPTIMIZER)
        result = StepResult(s, Decision(), loss.detach(), grad_norm)
        result.decision = self._decide(s, loss, grad_norm, closure, result, forward)
        return result

    def withhold_gradients(self) -> None:
        """Set every gradient of the model to None, so that the optimizer step that follows
        changes nothing: every torch.optim optimizer leaves a parameter without a gradient
        untouched (its moments and step count too)."""
        for p in self.model.parameters():
            p.grad = None

    def finish(self, result: StepResult) -> StepResult:
        """The second half of `step`, after the caller's loop stepped the optimizer (with the
        gradients withheld unless `decide` said CONTINUE) and the scheduler: rewinds (model,
        optimizer, scheduler and RNG from the snapshot, undoing that scheduler step) or goes
        on to the next step."""
        if result.decision.action is Action.REWIND and self._rewind(result):
            return result
        self._next(result)
        return result

    def _rewind(self, result: StepResult) -> bool:
        """Go back to a snapshot as `result.decision` says; False when there is none to go to."""
        if self.snapshots is None:
            return False
        d = result.decision
        back = self.snapshots.restore(result.step, d.skip_batches, before=d.rewind_before)
        self.clock.lap(Phase.RECOVERY)
        if back is None:
            return False
        self.rewinds += 1
        self.step_index = result.rewound_to = back
        if self.controller is not None:
            self.controller.rewound(back)
        if self.window is not None:
            self.window.rewound(back)
        self._prepare(back)
        return True

    def _next(self, result: StepResult) -> None:
        if result.decision.action is Action.CONTINUE:
            result.applied = True
        else:   # skip_step, or a rewind with nothing to go back to: the weights never saw it
            self.skipped += 1
        s = result.step
        if self.window is not None:
            self.window.concluded(s, result.applied)
        self.step_index = s + 1
        if self.snapshots is not None:
            self.snapshots.after_step(s + 1)
            self.clock.lap(Phase.CHECKPOINT)
        self._prepare(s + 1)

    def is_check_step(self, step: int) -> bool:
        return self.monitor is not None and self.monitor.is_check_step(step)

    def _measure(self, loss: torch.Tensor, grad_norm: torch.Tensor | None = None, result=None) -> tuple[float, float]:
        """(loss, grad norm) on the host, the same on every rank (`session_parts.measure_on_host`)."""
        return measure_on_host(loss, self.clip() if grad_norm is None else grad_norm, self.group, result,
                               self.state, self._remote)

    def _decide(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor, closure, result: StepResult,
                forward=None) -> Decision:
        if self.controller is None:
            return Decision()
        mon, ctl = self.monitor, self.controller
        # every rank reads the same two numbers, so every rank branches (and replays) alike
        measured = self._measure(loss, grad_norm, result)
        self.clock.lap(Phase.COLLECTIVE)
        if self.window is not None:
            self.window.record(step, closure, forward, measured[0])
        anomaly = result.anomaly = ctl.detect(step, *measured)
        attribution = None
        if anomaly is not None and closure is not None and self.replayer is not None:
            with counted_as(self.clock, Phase.RECOVERY):
                attribution = result.attribution = self._attribute(closure, anomaly)
        if attribution is None:
            mon.record(step, loss, grad_norm)
            if anomaly is not None and not mon.is_check_step(step):
                mon.force_check(step + 1)   # the next step collects statistics: blame by them
        else:
            mon.discard(step)   # a replayed step is decided: its statistics and loss stay out of the window
        signals = None
        if mon.is_check_step(step):
            signals = self.last_signals = mon.check(step)
            signals.lr_sensitivity = self._lr_sensitivity(step)
        decision = self._carry_out(ctl.observe_step(step, anomaly, signals, attribution, gate=self.gate,
                                                    judge=self._window_judge))
        self.clock.lap(Phase.MONITOR)
        return decision

    def _attribute(self, closure: Callable[[], torch.Tensor], anomaly=None) -> Attribution:
        return attribute_by_replay(self.controller, self.replayer, closure, self.max_replays, anomaly)

    def after_eval(self, step: int, result: Any) -> Decision:
        """Report a periodic evaluation's gate outcome (`.verdict`, `.reason`); a regression
        rolls the newest stage back. Same on every rank if `result` is."""
        if self.controller is None:
            return Decision()
        decision = self._carry_out(self.controller.observe_gate(step, result, judge=self._window_judge))
        self.resume_statistics()   # evals switch statistics off
        return decision

    def _carry_out(self, decision: Decision) -> Decision:
        if decision.changes:
            local = {s: f for s, f in decision.changes.items() if s not in self._remote}
            apply_decision(self.state, decision if len(local) == len(decision.changes) else Decision(changes=local))
        if decision.events:
            self.events += decision.events
            if self.log is not None:
                self.log.append(decision.events)
            if self.on_events is not None:
                self.on_events(decision.events)
        return decision

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict:
        return {"controller": None if self.controller is None else self.controller.state_dict(),
                "step": self.step_index, "rewinds": self.rewinds, "skipped": self.skipped,
                "events": [e.to_json() for e in self.events]}

    def load_state_dict(self, s: dict) -> None:
        if self.controller is not None and s.get("controller") is not None:
            self.controller.load_state_dict(s["controller"])
        self.step_index = int(s.get("step", self.step_index))
        self.rewinds, self.skipped = int(s.get("rewinds", 0)), int(s.get("skipped", 0))
        if "events" in s:   # resumed: the events up to the checkpoint; the event log says the same
            self.events = [Event.from_dict(json.loads(x)) for x in s["events"]]
            if self.log is not None:
                self.log.rewrite(self.events)   # a killed run's later events are redone, not kept twice
        self._probed = None   # other weights now: a due probe runs again
        if self.window is not None:
            self.window.clear()   # the steps before the checkpoint cannot be replayed
        self._prepare(self.step_index)

    def close(self) -> None:
        if self.monitor is not None:
            self.monitor.close()
        if self.replayer is not None:
            self.replayer.close()
        if self.log is not None:
            self.log.close()
