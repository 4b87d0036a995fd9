"""The rollout inside a loop that another framework steps: what every integration shares.

    hosted = HostedRollout.from_yaml("lowprec.yaml", model)     # prepares the model now
    hosted.start(optimizer, scheduler, eval_forward=..., attach=Attach(run_id, uri, experiment))   # training begins
    hosted.begin_step()                           # optional, each step: where a replay starts
    # each optimizer step, after backward and before the framework's optimizer.step():
    hosted.before_optimizer_step(loss, closure)   # decide; a skip or rewind withholds the gradients
    # after the framework stepped the optimizer and the scheduler:
    hosted.after_optimizer_step()                 # rewind or go on; track; eval checkpoints
    hosted.end()                                  # final eval, tracking finished

A framework owns the optimizer step, so lowprec's `Session` is used in its two halves
(`Session.decide` / `Session.finish`). A skipped step reaches the framework's optimizer
with every gradient set to None: torch.optim optimizers then change nothing (AdamW's moments
and step count stay as they were); the framework still steps its scheduler, as lowprec's own
loop does on a skip. A rewind is a skip whose `finish` then puts model, optimizer, scheduler
and RNG back as the snapshot has them; the framework's data simply goes on.

The config file is a `lowprec run` config without `model:`, `data:` and `train:` (the
framework owns those): `precision:` (required), `rollout:`, `eval:` and `tracking:`.
"""

from __future__ import annotations

import math
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from lowprec.config import ConfigRole, LowprecConfig
from lowprec.policy.decisions import Action
from lowprec.state.ranks import process_rank, world_size
from lowprec.integrations.framework_steps import FrameworkSteps
from lowprec.runtime.session.after_step import AfterStep
from lowprec.runtime.session.run_life import RunLife
from lowprec.runtime.session.session import Session, SessionSettings, StepResult
from lowprec.runtime.session.tracked_map import regather, tracked_map
from lowprec.tracking.phases import NULL_CLOCK, PassOutcome, Phase
from lowprec.tracking.records import RunStatus
from lowprec.policy.verdicts import Verdict

__all__ = ["framework_config", "HostedRollout", "HostedCallback", "Attach", "GapOutcome", "WholeModel",
           "allreduce_grads"]

STATE_FORMAT, STATE_VERSION = "lowprec.hosted_rollout", 1


def framework_config(config: "LowprecConfig | str | Path") -> LowprecConfig:
    """A framework integration's config: a LowprecConfig of role FRAMEWORK, or the path of its YAML."""
    if isinstance(config, LowprecConfig):
        if config.role is not ConfigRole.FRAMEWORK:
            return LowprecConfig.from_dict(config.to_dict(), source=config.source, role=ConfigRole.FRAMEWORK)
        return config
    return LowprecConfig.from_yaml(config, role=ConfigRole.FRAMEWORK)


@dataclass(frozen=True)
class Attach:
    """Track into a run the framework's own MLflow reporting already opened (one run, not two).
    `experiment`: the name of the experiment that run is in, read from the run itself: the
    framework may have put it elsewhere than the YAML's `tracking.experiment` (MLflow's own
    MLFLOW_EXPERIMENT_NAME, which the Trainer's reporting obeys; a Lightning MLFlowLogger's
    `experiment_name`)."""
    run_id: str
    tracking_uri: str
    experiment: str


def allreduce_grads(model: nn.Module, group=None) -> None:
    """Average the gradients over the data-parallel ranks, as DDP does after backward: a
    replay runs the unwrapped module, so DDP's own reduction does not happen."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size(group) == 1:
        return
    world = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad.div_(world)


@dataclass(frozen=True)
class WholeModel:
    """A model split into pipeline stages, as a rank that holds some of them sees the whole:
    `state`, a PrecisionState naming every site of the model in forward order (the controller
    decides over all of them, alike on every rank), and `info`, the whole model's modules and
    block lists (`lowprec.sites.plan.ModelInfo`, taken before the split: the stages'
    selectors resolve against it)."""
    state: object
    info: object


@dataclass(frozen=True)
class GapOutcome:
    """The verdict of a framework's own evaluation against the same weights in high precision."""
    verdict: Verdict
    reason: str
    gap: float


class HostedRollout:
    """lowprec's plan, session, evals and tracking inside a framework's training loop."""

    def __init__(self, config: LowprecConfig | str | Path, model: nn.Module, *, seed: int = 0,
                 baseline: dict[int, float] | None = None, state=None, whole: WholeModel | None = None):
        """Prepares `model` now (its planned Linear layers become PrecisionLinear holding the same
        Parameters), so do this before the framework wraps the model or builds the optimizer.
        baseline: the BF16 run's loss per step, for `rollout.thresholds.loss_gap`.
        state: the PrecisionState of a model prepared already (a framework that prepares its
        layers when it builds the model: torchtitan's converter); `model` is then not prepared again.
        whole: `model` and `state` are this rank's pipeline stages of the model `whole` names:
        the controller decides over every site, the session over this rank's (as `lowprec run`'s
        pipeline engine: `Session(sites=...)`)."""
        from lowprec.sites.precision_state import prepare
        config = framework_config(config)
        self.config, self.model, self.baseline, self.whole = config, model, baseline, whole
        self.state = prepare(model, config.precision, seed=seed) if state is None else state
        self._validate()
        self.session: Session | None = None
        self.after: AfterStep | None = None
        self.tracker = None
        self.life: RunLife | None = None   # the run's tracker and end (`start`)
        self.evals = None
        self.map = self.state   # what tracking logs as the precision map (`start`: the whole model's under stages,
                                # `lowprec.runtime.session.tracked_map`)
        self._pending: StepResult | None = None
        self.telemetry = None   # the host's Telemetry (`start`)
        self._ended = False
        self._framework_step: int | None = None   # the framework's global step now (FrameworkSteps)

    def _validate(self) -> None:
        """Everything the config names, checked now rather than when training starts
        (`lowprec.runtime.session.framework_check`); the baseline curve it names is read here."""
        from lowprec.runtime.session.framework_check import check_framework_config
        self.baseline, _ = check_framework_config(self.config, *self._decided_over(), self.baseline)

    def _decided_over(self):
        """(PrecisionState, model or ModelInfo) the config is checked and the controller decides
        over: this rank's, or under pipeline stages the whole model's (`whole`)."""
        return (self.state, self.model) if self.whole is None else (self.whole.state, self.whole.info)

    @classmethod
    def from_yaml(cls, path: str | Path, model: nn.Module, **kwargs) -> "HostedRollout":
        return cls(framework_config(path), model, **kwargs)

    @property
    def losses(self) -> list[float]:
        """The loss of every step so far, as finally trained (a rewind drops the steps it undid)."""
        return self.after.record.losses if self.after is not None else []

    @property
    def step(self) -> int:
        """lowprec's step: optimizer steps that count (a rewind takes it back; the framework's may not)."""
        return self.session.step_index if self.session is not None else 0

    # ------------------------------------------------------------------ start
    def start(self, optimizer: torch.optim.Optimizer, scheduler=None, *, max_grad_norm: float | None = 1.0,
              eval_forward: Callable[[torch.Tensor], torch.Tensor] | None = None, eval_tokenizer=None,
              max_length: int = 256, run_name: str = "lowprec", buffer_root: str | Path = "lowprec-runs",
              attach: Attach | None = None, group=None, clip: Callable[[], torch.Tensor] | None = None,
              lr_probe=None, buffer: str | Path | None = None, resume_tracking: bool = False,
              event_log: str | Path | None = None, eval_share=None, telemetry=None) -> Session:
        """Build the controller, the session, the eval checkpoints and the tracker, when the
        framework has built its optimizer and scheduler (the unwrapped torch objects).
        eval_forward(tokens) -> logits: how `eval:` suites run the model (default: the model).
        attach: the framework's open MLflow run to track into; None opens one (if `tracking.enabled`).
        clip: the framework's own global-norm clip (returns the norm before clipping), for
        sharded parameters; default clip_grad_norm_ over the model at `max_grad_norm`.
        lr_probe: the LR probe (`lowprec.runtime.session.lrprobe.LRProbe`) when `rollout.lr_probe` is on.
        buffer: the tracker's buffer folder (default: a new one under `buffer_root`);
        resume_tracking: continue the unfinished MLflow run that folder holds (a resumed job's,
        `lowprec.tracking.resume`: what its journal holds is not logged again).
        event_log: a JSONL file the session appends the rollout's events to (one writer).
        eval_share: under torchrun, hands rank 0's eval outcome to every rank (`lowprec.state.ranks.from_rank_0`).
        telemetry: the host's `lowprec.tracking.telemetry.Telemetry` (its clock laps the session's
        phases; the host laps its own, calls `begin()` when training begins and hands each pass's
        tokens to `after_optimizer_step`): `time/*` and `throughput/*` with the training metrics,
        `telemetry/*` at the end, MLflow's `system/*` on the run (`telemetry.system_metrics_s`).
        Built in dependency order: tracker, controller, precision map, evals, session."""
        cfg = self.config
        self.telemetry = telemetry
        clock = telemetry.clock if telemetry is not None else NULL_CLOCK
        self.life = self._life(run_name, buffer_root, attach, buffer, resume_tracking)
        # everything is recorded at the framework's step (lowprec.integrations.framework_steps)
        tracker = self.life.tracker
        self.tracker = None if tracker is None else FrameworkSteps(tracker, lambda: self._framework_step,
                                                                   lambda: self.step)
        controller = None
        if cfg.rollout is not None:
            from lowprec.policy.rollout import build_controller
            state, model = self._decided_over()
            controller = build_controller(cfg.rollout, state, model, baseline=self.baseline)
        self.map = tracked_map(self.state, self.whole.state if self.whole is not None else None, controller)
        # every rank runs the same eval passes: decided on the whole model's formats
        self.evals = self.life.evals(tracker=self.tracker, model=self.model, state=self.state,
                                     max_length=max_length, share=eval_share,
                                     formats=self.map.formats, forward=eval_forward, tokenizer=eval_tokenizer)
        sites = list(self.whole.state.sites) if self.whole is not None and controller is not None else None
        self.session = Session(self.model, optimizer, self.state, controller, scheduler=scheduler,
                               group=group, clip=clip, lr_probe=lr_probe, sites=sites, event_log=event_log, clock=clock,
                               on_events=self.tracker.log_events if self.tracker is not None else None,
                               settings=SessionSettings.from_rollout(cfg.rollout, max_grad_norm=max_grad_norm),
                               gate=self.evals.gate if self.evals is not None else None)
        timed = {} if telemetry is None else {"clock": clock, "on_precision_change": telemetry.formats_changed,
                                              "window_metrics": telemetry.window}
        self.after = AfterStep(self.session, self.map, tracker=self.tracker, evals=self.evals, baseline=self.baseline,
                               **timed)
        if self.tracker is not None:
            self.tracker.log_precision(0, self.map.formats(), self.map.flops_share())
        return self.session

    def _life(self, run_name: str, buffer_root: str | Path, attach: Attach | None,
              buffer: str | Path | None = None, resume: bool = False) -> RunLife:
        """The run's `RunLife`: its tracker (the framework's MLflow run with `attach`) and its end."""
        name = self.config.tracking.run_name or run_name
        folder = Path(buffer) if buffer is not None else \
            Path(buffer_root) / (attach.run_id if attach is not None else f"{name}-{uuid.uuid4().hex[:8]}")
        return RunLife(self.config, name, folder, rank=process_rank(), resume=resume, attach=attach,
                       on_end=self._final, system_metrics=self.telemetry is not None)

    # ------------------------------------------------------------------ each step
    def begin_step(self) -> None:
        """The framework's step begins here: its batch is drawn, none of its step code has run.
        A replay then starts from the RNG and scaling state of this moment instead of the
        model's first forward (the default). For replays that re-run more than the model's
        forward (Lightning's `training_step`, which may draw random numbers before calling
        the model) or a model whose forward the step never calls (a wrapper's submodule)."""
        replayer = self.session.replayer if self.session is not None else None
        if replayer is not None:
            replayer.begin_step()   # disarms the first-forward hook

    def before_optimizer_step(self, loss: torch.Tensor, closure: Callable[[], torch.Tensor] | None = None, *,
                              grad_norm: torch.Tensor | None = None,
                              forward: Callable[[], torch.Tensor] | None = None,
                              framework_step: int | None = None) -> StepResult:
        """After backward, before the framework's optimizer step: clip, decide (replaying an
        anomalous step through `closure`, and a window of them on a loss gap; `forward`, the
        step's forward alone, makes a window's first look cheaper), and withhold the gradients
        unless the step is applied. framework_step: the framework's global step this optimizer
        step will have (1-based, as its own metrics carry it): what this step records is logged there."""
        if framework_step is not None:
            self._framework_step = int(framework_step)
        result = self._pending = self.session.decide(loss, closure, grad_norm=grad_norm, forward=forward)
        if result.decision.action is not Action.CONTINUE:
            self.session.withhold_gradients()
        return result

    def after_optimizer_step(self, lr: float | None = None, tokens: int = 0) -> StepResult | None:
        """After the framework's optimizer and scheduler step: rewind or go on, then what every
        host does after a step (`lowprec.runtime.session.after_step`: keep, track, evaluate).
        lr: the learning rate to log (default: the optimizer's first param group's); tokens: the
        step's tokens over every data-parallel rank (the telemetry's throughput)."""
        result, self._pending = self._pending, None
        if result is None:
            return None   # the framework stepped without a backward lowprec saw
        self.session.finish(result)
        tel = self.telemetry
        if not self.after.keep(result, float(result.loss)):
            if tel is not None:
                tel.end_pass(result.step, PassOutcome.REWOUND, tokens, rewound_to=result.rewound_to)
            return result
        if tel is not None:   # the pass ends between keeping the step and tracking it, as in `lowprec run`'s loop
            tel.end_pass(result.step, PassOutcome.APPLIED if result.applied else PassOutcome.SKIPPED, tokens)
        self.after.after_applied(result, self.session.optimizer.param_groups[0]["lr"] if lr is None else lr)
        return result

    def formats(self) -> dict[str, str]:
        """Every site's format now (fqn -> format name), the same on every rank: under pipeline
        stages (`whole`) every stage's sites (`lowprec.runtime.session.tracked_map`), once `start` ran."""
        return self.map.formats()

    @property
    def below_high_precision(self) -> bool:
        """Some layer runs below high precision now (a high-precision eval would differ)."""
        return any(not s.format.is_high_precision for s in self.state.sites.values())

    def precision_gap(self, name: str, loss: float, loss_hp: float, tolerance: float | None) -> GapOutcome:
        """A framework's own evaluation as an eval checkpoint: its loss as trained against the
        same weights' loss in high precision. Logged as `eval/<name>/loss`, `eval_hp/<name>/loss`
        and `eval/<name>/precision_gap` (relative); a gap above `tolerance` is a regression, which
        rolls the newest stage back (as the in-loop gate of an `eval:` suite does); None: logged only."""
        step = self.step
        gap = (loss - loss_hp) / abs(loss_hp) if loss_hp else 0.0
        if not math.isfinite(loss) and math.isfinite(loss_hp):
            outcome = GapOutcome(Verdict.REGRESS, f"{name} eval: loss {loss} as trained, {loss_hp:.5g} in high "
                                                  f"precision", math.inf)
            gap = math.inf
        elif tolerance is None:
            outcome = GapOutcome(Verdict.INCONCLUSIVE, f"{name} eval: precision gap {gap:+.4%} (no tolerance)", gap)
        elif gap > tolerance:
            outcome = GapOutcome(Verdict.REGRESS, f"{name} eval: loss {loss:.5g} as trained against {loss_hp:.5g} in "
                                                  f"high precision: {gap:+.3%} > {tolerance:.3%}", gap)
        else:
            outcome = GapOutcome(Verdict.PASS, f"{name} eval: precision gap {gap:+.3%} <= {tolerance:.3%}", gap)
        if self.tracker is not None:
            self.tracker.log_metrics(step, {f"eval/{name}/loss": loss, f"eval_hp/{name}/loss": loss_hp,
                                            f"eval/{name}/precision_gap": gap})
        if tolerance is not None and self.session is not None:
            if self.session.after_eval(step, outcome).changes and self.tracker is not None:
                self.tracker.log_precision(step, self.map.formats(), self.map.flops_share())
        return outcome

    # ------------------------------------------------------------------ resume
    def state_dict(self) -> dict:
        """What lowprec needs to go on when the framework resumes from its checkpoint: each
        layer's format, delayed-scaling histories and rounding generators, the session (the
        controller's stage and memory, lowprec's step, rewinds, skips, events) and the losses
        so far. Plain data (loads with torch.load(weights_only=True)). After `start`."""
        if self.session is None:
            raise RuntimeError("HostedRollout.state_dict() before start(): there is no session to save yet")
        return {"format": STATE_FORMAT, "version": STATE_VERSION, "world_size": world_size(),
                "precision": self.state.state_dict(), "session": self.session.state_dict(),
                "losses": list(self.losses), "grad_norms": list(self.after.record.grad_norms),
                "framework_step": self._framework_step,
                "evals": self.evals.state_dict() if self.evals is not None else None}   # the gate's checks made

    def load_state_dict(self, saved: dict) -> None:
        """Go on from `saved` (a `state_dict()`), after `start`: the layers' formats and the
        controller's stage are the saved ones, not the plan's. Refused, with nothing changed,
        when it is not lowprec's, was written by another number of ranks, or names other layers."""
        if self.session is None:
            raise RuntimeError("HostedRollout.load_state_dict() before start(): call it once the session exists")
        if not isinstance(saved, dict) or saved.get("format") != STATE_FORMAT:
            raise ValueError(f"not a lowprec rollout state (no format={STATE_FORMAT!r} entry); it is written by "
                             f"HostedRollout.state_dict()")
        if saved.get("version") != STATE_VERSION:
            raise ValueError(f"rollout state version {saved.get('version')!r}; this lowprec reads {STATE_VERSION}")
        if saved["world_size"] != world_size():
            raise ValueError(f"the rollout state was saved by {saved['world_size']} rank(s) and {world_size()} run now; "
                             f"each rank's delayed-scaling histories and generators are its own: resume with "
                             f"{saved['world_size']} rank(s)")
        self.state.load_state_dict(saved["precision"])   # checks sites and formats before switching any
        self.session.load_state_dict(saved["session"])
        regather(self.map)   # every rank loads its own sites' formats
        self.after.load_state_dict({"losses": saved["losses"], "grad_norms": saved.get("grad_norms", ()),
                                    "evals": saved.get("evals")})   # grad norms absent from states before them
        self._framework_step = saved.get("framework_step", self._framework_step)   # absent before one step
        if self.tracker is not None:
            self.tracker.log_metrics(self.step, {"train/resumed_at": self.step})
            self.tracker.log_precision(self.step, self.map.formats(), self.map.flops_share())

    # ------------------------------------------------------------------ the end
    def end(self, status: RunStatus = RunStatus.FINISHED, reason: str | None = None) -> None:
        """Final eval, the loss curve (for a later run's `rollout.baseline`), tracking finished
        (`RunLife.end`, once); reason: why a KILLED run was stopped (the `lowprec.stopped` tag)."""
        if self.life is not None:
            self.life.end(status, losses=self.losses, reason=reason)
        elif not self._ended:   # never started: nothing was tracked
            self._final(status)

    def _final(self, status: RunStatus) -> None:
        """What the run's end does first here: the final eval of a finished run, the session closed."""
        self._ended = True
        clock = self.telemetry.clock if self.telemetry is not None else NULL_CLOCK
        if self.evals is not None and status is RunStatus.FINISHED:
            clock.lap(Phase.OTHER)
            self.evals.final(self.step)
            clock.lap(Phase.EVAL)
        if self.session is not None:
            self.session.close()
        numbers = self.telemetry.finish() if self.telemetry is not None else {}
        if self.tracker is not None and numbers:   # the run's telemetry/* numbers, once, at its last step
            self.tracker.log_metrics(self.step, numbers)
            self.tracker.log_tags(self.telemetry.sources())


class HostedCallback:
    """What every framework callback shows of its `HostedRollout` (`self.hosted`): built from a
    YAML file, the precision state, the session and lowprec's step."""

    hosted: HostedRollout

    @classmethod
    def from_yaml(cls, path: str | Path, model: nn.Module, **kwargs):
        return cls(framework_config(path), model, **kwargs)

    @property
    def state(self):
        """The PrecisionState: `callback.state.formats()` is each layer's format now."""
        return self.hosted.state

    @property
    def session(self) -> Session | None:
        return self.hosted.session

    @property
    def step(self) -> int:
        """lowprec's step count: optimizer steps that count (a rewind takes it back)."""
        return self.hosted.step
