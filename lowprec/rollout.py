"""The `rollout:` section of a training config, and the few lines a training loop needs.

    rollout:
      check_every: 10            # read signals on the host every N steps
      min_steps: 100             # stable steps before the next stage
      cooldown_steps: 200        # before a fallen-back site retries
      quarantine_after: 2        # failures before a site stays where it is
      rewind: {enabled: true, skip_batches: 20}
      thresholds: {max_saturated_frac: 1.0e-3, site_patience: 2, loss_gap: 0.0025}
      stages:
        - {name: mlp_fp8,  select: {glob: "blocks.*.mlp.*"},  format: fp8_tensorwise}
        - {name: attn_fp8, select: {glob: "blocks.*.attn.*"}, format: fp8_tensorwise}

`RolloutSession` ties a PrecisionState, a Monitor, a RolloutController and an event log
together; a training loop calls `before_step` and `after_backward` and obeys the
returned Decision (see README.md). Selectors are the plan's typed selectors.
"""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Callable

import torch

from lowprec.controller import ControllerConfig, Decision, RolloutController, Stage, apply_decision
from lowprec.detectors import Thresholds
from lowprec.events import Event, EventLog
from lowprec.formats import format_names, get_format
from lowprec.monitor import Monitor, MonitorConfig
from lowprec.plan import ModelInfo, PlanError, selection_from_dict

__all__ = ["RolloutSpec", "parse_rollout", "build_controller", "RolloutSession"]

_KEYS = ("check_every", "min_steps", "cooldown_steps", "quarantine_after", "rewind", "thresholds", "stages",
         "stats_every_step")
_THRESHOLDS = tuple(f.name for f in fields(Thresholds))


class RolloutSpec:
    """The parsed `rollout:` section: a ControllerConfig and stages with typed selectors."""

    def __init__(self, config: ControllerConfig, stages: list[tuple[str, object, str]], monitor: MonitorConfig):
        self.config = config
        self.monitor = monitor
        self.stages = stages  # (name, Selector, format name)


def _unknown(d: dict, allowed, path: str) -> None:
    from lowprec.formats import suggest
    for k in d:
        if k not in allowed:
            raise PlanError(path, f"unknown key {k!r}.{suggest(str(k), list(allowed))} Allowed: {', '.join(allowed)}")


def parse_rollout(d: dict, path: str = "rollout") -> RolloutSpec:
    if not isinstance(d, dict):
        raise PlanError(path, f"expected a mapping, found {type(d).__name__}")
    _unknown(d, _KEYS, path)
    thr = d.get("thresholds") or {}
    _unknown(thr, _THRESHOLDS, f"{path}.thresholds")
    rewind = d.get("rewind") or {}
    if isinstance(rewind, bool):
        rewind = {"enabled": rewind}
    _unknown(rewind, ("enabled", "skip_batches"), f"{path}.rewind")
    try:
        mon = MonitorConfig(check_every=int(d.get("check_every", 10)),
                            stats_every_step=bool(d.get("stats_every_step", False)))
        cfg = ControllerConfig(min_steps=int(d.get("min_steps", 100)), cooldown_steps=int(d.get("cooldown_steps", 200)),
                               quarantine_after=int(d.get("quarantine_after", 2)),
                               rewind=bool(rewind.get("enabled", False)),
                               rewind_skip_batches=int(rewind.get("skip_batches", 0)), thresholds=Thresholds(**thr))
    except (TypeError, ValueError) as e:
        raise PlanError(path, str(e)) from None
    stages = []
    for i, s in enumerate(d.get("stages") or []):
        p = f"{path}.stages[{i}]"
        if not isinstance(s, dict):
            raise PlanError(p, f"expected a mapping with name, select, format; found {s!r}")
        _unknown(s, ("name", "select", "format"), p)
        if "select" not in s or "format" not in s:
            raise PlanError(p, "a stage needs `select:` and `format:`")
        try:
            fmt = get_format(s["format"]).name
        except ValueError as e:
            raise PlanError(f"{p}.format", str(e)) from None
        stages.append((str(s.get("name", f"stage{i}")), selection_from_dict(s["select"], f"{p}.select"), fmt))
    if not stages:
        raise PlanError(f"{path}.stages", f"a rollout needs at least one stage; formats: {', '.join(format_names())}")
    return RolloutSpec(cfg, stages, mon)


def build_controller(spec: RolloutSpec, state, model: torch.nn.Module, *, baseline: dict[int, float] | None = None,
                     gate: Callable[[int], object] | None = None) -> RolloutController:
    """Resolve the stages' selectors against the prepared model's sites."""
    info = ModelInfo.of(model)
    stages = []
    for i, (name, sel, fmt) in enumerate(spec.stages):
        sites = tuple(f for f, s in state.sites.items() if sel.matches(f, s.module, info))
        if not sites:
            raise PlanError(f"rollout.stages[{i}].select", f"stage {name!r} ({sel.describe()}) selects no "
                            f"precision site; sites: {', '.join(list(state.sites)[:6])} ...")
        stages.append(Stage(name, sites, fmt))
    ladders = {f: tuple(x.name for x in s.ladder) for f, s in state.sites.items()}
    return RolloutController(ladders, state.formats(), stages, spec.config, baseline=baseline, gate=gate)


class RolloutSession:
    """Monitor + controller + event log around one training loop (see README.md)."""

    def __init__(self, state, controller: RolloutController, *, monitor: MonitorConfig = MonitorConfig(),
                 event_log: str | Path | None = None,
                 group=None, on_events: Callable[[list[Event]], None] | None = None,
                 sites: list[str] | None = None):
        """sites: every site of the model in forward order, when `state` holds only this
        rank's (a pipeline stage): the monitor then combines all sites' statistics across
        ranks, and decisions about the other ranks' sites change nothing here."""
        self.state = state
        self.controller = controller
        self.monitor = Monitor(state, monitor, group=group, sites=sites)
        self._remote = set(sites or ()) - set(state.sites)   # sites that live on other ranks
        self.log = EventLog(event_log) if event_log is not None else None
        self.on_events = on_events
        self.events: list[Event] = []
        self.last_signals = None

    def before_step(self, step: int) -> None:
        self.monitor.before_step(step)

    def after_backward(self, step: int, loss: torch.Tensor, grad_norm: torch.Tensor) -> Decision:
        """Call after backward (and gradient clipping), before optimizer.step().

        Returns a Decision: SKIP_STEP (zero the grads, do not step), REWIND (restore the
        last good state, skip `skip_batches` batches) or CONTINUE. Reads one bool per step
        on the host (is the grad norm finite, as GradScaler does) and hands it to the
        controller, which decides; everything else is read once per check. The bool comes
        from the grad norm: after gradient reduction it is the same on every rank (a NaN
        loss makes the gradients NaN too), so every rank takes the same branch and calls
        the same collectives.
        """
        self.monitor.record(step, loss, grad_norm)
        finite = bool(torch.isfinite(grad_norm.detach()).all())
        if not finite and not self.monitor.is_check_step(step):
            # no statistics were collected this step: check on the next one, with statistics,
            # so that a persistent fault is blamed on the site it comes from
            self.monitor.force_check(step + 1)
        signals = None
        if self.monitor.is_check_step(step):
            signals = self.last_signals = self.monitor.check(step)
        return self._carry_out(self.controller.observe_step(step, finite, signals))

    def after_eval(self, step: int, result) -> Decision:
        """Report a periodic evaluation checkpoint's gate result (`.verdict`, `.reason`);
        a regression rolls the newest stage back. Same on every rank if `result` is."""
        return self._carry_out(self.controller.observe_gate(step, result))

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

    def state_dict(self) -> dict:
        return {"controller": self.controller.state_dict()}

    def load_state_dict(self, s: dict) -> None:
        self.controller.load_state_dict(s["controller"])
