"""The pieces a `lowprec.runtime.session.session.Session` is made of besides its step logic: what it
returns per step (`StepResult`), its one host read per step (`measure_on_host`), the
replays that blame an anomalous step's sites (`attribute_by_replay`), its default gradient
clip, the LR probe built from the config, and the gate wrapper that books a promotion's
evaluation as `eval` time on the session's clock."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn

from lowprec.policy.anomaly import Anomaly
from lowprec.policy.attribution import Attribution, Replay, attribute
from lowprec.policy.controller import Decision
from lowprec.policy.events import Event
from lowprec.runtime.session.lrprobe import LRProbe
from lowprec.tracking.phases import Phase, counted_as

__all__ = ["StepResult", "measure_on_host", "attribute_by_replay"]


@dataclass
class StepResult:
    """What `Session.step` did with one step."""

    step: int                          # the step this call concluded
    decision: Decision
    loss: torch.Tensor
    grad_norm: torch.Tensor
    applied: bool = False              # the optimizer stepped
    rewound_to: int | None = None      # training goes on from this step (a rewind)
    anomaly: Anomaly | None = None     # this step's global anomaly, if any
    attribution: Attribution | None = None   # the replays that explained it, if any
    routed_tokens: dict[str, float] | None = None   # tokens per expert site of its forward, every rank's

    @property
    def action(self):
        return self.decision.action

    @property
    def events(self) -> list[Event]:
        return self.decision.events


def _default_clip(model: nn.Module, max_norm: float | None) -> Callable[[], torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]

    def clip() -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, math.inf if max_norm is None else max_norm)
    return clip


def _probe_from_config(cfg, model: nn.Module, optimizer: torch.optim.Optimizer, state, clip,
                       held_batch) -> LRProbe:
    from lowprec.base.parse import ConfigError
    if held_batch is None:
        raise ConfigError("rollout.lr_probe", (
            "is enabled, and the probe needs a held batch: pass held_batch=(x, y), a batch training never "
            "draws, to Session (or Session.from_yaml / build), or lr_probe=LRProbe(...); or set "
            "lr_probe.enabled: false"))
    return LRProbe.for_model(model, optimizer, held_batch, state=state, clip=clip, factors=cfg.factors,
                             every_checks=cfg.every_checks)


class _EvalTimedGate:
    """The controller's `gate(step)` (an evaluation before a promotion, called inside the
    check), its time booked as `eval` on the session's clock, not as the check's `monitor`."""

    def __init__(self, gate: Callable[[int], Any], clock):
        self.gate, self.clock = gate, clock

    def __call__(self, step: int):
        clock = self.clock
        clock.lap(Phase.MONITOR)     # the check up to here
        with counted_as(clock, Phase.EVAL):
            return self.gate(step)


def measure_on_host(loss: torch.Tensor, grad_norm: torch.Tensor, group=None, result: StepResult | None = None,
                    state=None, remote=()) -> tuple[float, float]:
    """(loss, grad norm) on the host, the same on every rank: the one host read of a step.
    Under data parallelism the loss is each rank's: the mean over ranks (one small
    all-gather; the grad norm is global already, its max guards against drift). With a step's
    `result` (its own forward, not a replay's) and the `state`, each expert site's tokens ride in
    the same all-gather, summed over the ranks into `result.routed_tokens` (under expert
    parallelism an expert runs on one rank, which alone counts its tokens); not where this rank
    holds only some of the sites (`remote`, pipeline stages: the ranks' sites differ)."""
    experts = {} if result is None or state is None or remote else {
        f: s.module.tokens for f, s in state.sites.items() if getattr(s.module, "expert_index", None) is not None}
    v = torch.tensor([0.0, 0.0, *map(float, experts.values())], dtype=torch.float64, device=loss.device)
    v[0], v[1] = loss.detach().reshape(()).double(), grad_norm.detach().reshape(()).double().to(loss.device)
    if group is not None or (dist.is_available() and dist.is_initialized()):
        parts = [torch.empty_like(v) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, v, group=group)
        every = torch.stack(parts)
        v = torch.cat([every[:, 0].mean().reshape(1), every[:, 1].amax().reshape(1), every[:, 2:].sum(0)])
    loss_h, norm_h, *summed = v.tolist()
    if experts:
        result.routed_tokens = dict(zip(experts, summed))
    return loss_h, norm_h


def attribute_by_replay(ctl, replayer, closure: Callable[[], torch.Tensor], max_replays: int,
                        anomaly=None) -> Attribution:
    """Replay an anomalous step with sites in high precision to find the ones to blame
    (`lowprec.policy.attribution.attribute`); a replay is clean only by the blame rule's
    margin against `anomaly` (the step as trained; `lowprec.policy.anomaly`). The replayer
    is finished either way."""
    low, groups = ctl.replay_candidates()
    k = ctl.config.thresholds.blame_margin

    def run(sites: tuple[str, ...]) -> Replay:
        loss, norm = replayer.replay(closure, sites)
        if anomaly is None:
            return Replay(sites, loss, norm, ctl.detectors.anomalous(loss, norm))
        clears, margins = ctl.detectors.clears(anomaly, loss, norm, k)
        return Replay(sites, loss, norm, ctl.detectors.anomalous(loss, norm), clears, margins)
    try:
        return attribute(low, groups, run, max_replays) if low else Attribution(False, (), ())
    finally:
        replayer.finish()
