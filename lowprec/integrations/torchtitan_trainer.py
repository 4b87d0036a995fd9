"""`LowprecTrainer`: torchtitan's `Trainer` with lowprec's whole rollout (`HostedRollout`) hosted in it.

A job's config function returns `lowprec_trainer(config)` (`lowprec.integrations.torchtitan`);
`torchtitan.train` then builds this class instead of `Trainer`. Everything torchtitan does
stays as it is (its train loop, data loader, parallelisms, checkpointer, metrics logging);
lowprec joins at the points torchtitan has:

* the loss: torchtitan's `forward_backward_step` is extended to keep what it returns (per
  micro-batch, or per pipeline step: the rank's token sum over the global token count) with
  the step's global token count; the step's loss is their sum, from the last pipeline stage
  (one broadcast over the pp mesh: the other stages hold -1) and summed over the
  data-parallel ranks (one all-reduce over torchtitan's `loss` mesh): the mean loss
  torchtitan logs, the same on every rank.
* the grad norm: torchtitan's `clip_grad_norm_` (its sharding-aware global norm, reduced
  over the pipeline stages through its `pp_mesh`). lowprec
  must see the norm before clipping (a grad-norm spike is invisible after it), so torchtitan's
  own clip runs with `max_norm` inf (it measures; its logged `grad_norm` is the same
  unclipped norm) and lowprec clips at `training.max_norm` with that same function in the
  optimizers' step pre-hook.
* the decision: the step pre-hook of torchtitan's optimizers (after backward and torchtitan's
  norm, before any optimizer steps) hands loss, norm and a replay closure to the session. A
  skip or a rewind withholds the step: every gradient is set to None, so torchtitan's
  `optimizers.step()` changes nothing (AdamW's moments and step count included); torchtitan
  still steps its LR schedulers, as lowprec's own loop does on a skip.
* replay attribution: the closure runs torchtitan's own `forward_backward_step` again on the
  step's micro-batches (recorded as torchtitan draws them, grouped as its train step groups
  them) with the same global token count; under pipeline parallelism that is one
  `pp_schedule.step` per group on every stage (every rank replays alike: each measured the
  same loss and norm), the sites of each stage in high precision on the rank that holds them.
* after the step (torchtitan's `train_step` returned: optimizers and schedulers stepped):
  `HostedRollout.after_optimizer_step`: a rewind puts model, optimizers, schedulers and RNG
  back from an in-memory snapshot (each rank its own shards: `MemorySnapshots` over the
  sharded state dicts), the data goes on; tracking; eval checkpoints of an `eval:` section.
* evals (`eval:`): every rank runs every eval's forwards (the sharded model's forward is
  collective), in the same order; lm-eval returns results in the process of local rank 0 only,
  so rank 0 logs them, reaches the gate's verdict and hands the outcome to every rank
  (`lowprec.state.ranks.from_rank_0`, as `lowprec run` does under torchrun): every rank's
  controller decides alike.
* torchtitan stops a job whose logged loss is not finite ("Loss is not finite" in
  `Trainer.train_step`, raised after the optimizers and schedulers stepped). When lowprec
  withheld that step, the weights never saw it: the trainer goes on (that step's metrics
  line is not written). A non-finite loss lowprec applied still stops the job.
* the LR probe (`rollout.lr_probe`): on the held batch of torchtitan's validator (its first
  batch; `validator.enable` must be on), through torchtitan's forward and loss
  (`lowprec.integrations.torchtitan_probe`).
* MLflow: rank 0 tracks into one run per job (`dump_folder/lowprec` buffers it); a job torchtitan
  resumes after a kill or a failure continues that same run, logging nothing twice
  (`lowprec.integrations.torchtitan_tracking`); torchtitan's own metrics logging is left as it is.
  Rank 0 times each step's phases as `lowprec run` does (`time/*`, `throughput/*`, `telemetry/*`,
  MLflow's `system/*`; where it laps: `lowprec.integrations.torchtitan_timing`).
* resume: the rollout's state (formats, scaling histories, generators, controller, monitors,
  events, lowprec's step) is a `Stateful` in torchtitan's checkpoint states, under the key
  `lowprec`, one entry per rank (each rank's histories and generators are its own, and rank 0's
  names the MLflow run), so a job torchtitan resumes resumes its rollout. A checkpoint without it is refused unless
  `lowprec_restore` is false.

* pipeline parallelism: each rank hosts the sites of its own stages, the controller decides
  over every site of the model (`lowprec.integrations.torchtitan_stages`); skips, rewinds
  (each rank snapshots its own stages' parameters and optimizer state) and replays as above;
  an eval suite's forwards and the LR probe's held-batch loss are evaluation steps of
  torchtitan's pipeline schedule on every stage, the last stage's logits or loss broadcast to
  every rank (`lowprec.integrations.torchtitan_forward`); the probe's virtual step steps every
  optimizer of the rank.
"""

# no `from __future__ import annotations`: torchtitan (tyro) resolves the config dataclasses' field types

import contextlib
import dataclasses
import io
import math
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lowprec.integrations.extras import require

require("torchtitan", "torchtitan", "torchtitan")

from torchtitan.distributed import utils as dist_utils  # noqa: E402
from torchtitan.tools.logging import logger  # noqa: E402
from torchtitan.trainer import Trainer  # noqa: E402

from lowprec.integrations.core import HostedRollout  # noqa: E402
from lowprec.integrations.state_files import MissingRolloutStateError  # noqa: E402
from lowprec.integrations.torchtitan_forward import logits  # noqa: E402
from lowprec.integrations.torchtitan_stages import last_stage_loss, stages_of  # noqa: E402
from lowprec.integrations.torchtitan_timing import StepClock, rank_telemetry  # noqa: E402
from lowprec.integrations.torchtitan_tracking import (JobRun, check_resumed_run, job_run,  # noqa: E402
                                                      torchtitan_resumes)
from lowprec.policy.decisions import Action  # noqa: E402
from lowprec.runtime.session.host import read_baseline  # noqa: E402
from lowprec.state.ranks import from_rank_0, process_rank, world_size  # noqa: E402

__all__ = ["LowprecTrainer", "Prepared", "lowprec_trainer", "prepared_of"]

STATE_KEY = "lowprec"   # the rollout's entry in torchtitan's checkpoint states
PREPARED_ATTR = "_lowprec_prepared"   # a built model's attribute holding its Prepared


@dataclass
class Prepared:
    """A built model's lowprec part (`LowprecConverter` sets it): the converter's `setup`
    (the checked config, seed, event log), the PrecisionState of its layers and `info`, the
    whole model's ModelInfo (both taken when it was built); `hosted`, the
    LowprecTrainer's HostedRollout once a trainer hosts it."""

    setup: object
    state: object
    hosted: object = None
    info: object = None   # the whole model's ModelInfo, taken when it was built (before a pipeline split)


def prepared_of(model) -> Prepared:
    """The lowprec part of a model built with LowprecConverter."""
    p = getattr(model, PREPARED_ATTR, None)
    if p is None:
        raise ValueError(f"{type(model).__name__} was not built with LowprecConverter; add "
                         "LowprecConverter.Config(config=...) to model_registry(..., converters=[...])")
    return p


class _Drawn:
    """The trainer's data iterator, keeping what one step draws (for its replay), its wait lapped."""

    def __init__(self, it, timing: StepClock):
        self.it, self.items, self.timing = it, [], timing

    def __iter__(self):
        return self

    def __next__(self):
        self.timing.drawing()
        item = next(self.it)
        self.timing.drawn()
        self.items.append(item)
        return item


class _Optimizers:
    """torchtitan's OptimizersContainer as lowprec's session and rewind snapshots use it. Before
    the first step there is no optimizer state yet, and the container's `state_dict()` would
    create it with a zero-lr step, which AdamW counts as a step: a snapshot then keeps "no state"
    and restoring it clears the state, as it was."""

    def __init__(self, container):
        self.container = container

    def __getattr__(self, name):
        return getattr(self.__dict__["container"], name)

    def state_dict(self) -> dict:
        return self.container.state_dict() if any(o.state for o in self.container.optimizers) else {}

    def load_state_dict(self, saved: dict) -> None:
        if saved:
            self.container.load_state_dict(saved)
            return
        for o in self.container.optimizers:
            o.state.clear()


class _RolloutState:
    """The rollout as a torch `Stateful` in torchtitan's checkpoint: one bytes entry per rank,
    {"rollout": HostedRollout's state, "tracking": the MLflow run rank 0 tracks into, or None}."""

    def __init__(self, trainer: "LowprecTrainer"):
        self.trainer = trainer
        self.key = f"rank{process_rank()}_of_{world_size()}"

    def state_dict(self) -> dict:
        t, run = self.trainer, self.trainer.job_run
        buf = io.BytesIO()
        torch.save({"rollout": t.hosted.state_dict(),
                    "tracking": run.record(t.hosted.tracker.run_id) if run is not None else None}, buf)
        return {self.key: buf.getvalue()}

    def load_state_dict(self, saved: dict) -> None:
        raw = saved.get(self.key)
        if not isinstance(raw, (bytes, bytearray)):
            raise ValueError(f"the checkpoint's lowprec state has no entry {self.key!r} (found {sorted(saved)}); "
                             f"it was saved by another number of ranks: resume with that number")
        t, saved = self.trainer, torch.load(io.BytesIO(raw), weights_only=True)
        t.hosted.load_state_dict(saved["rollout"])
        t.restored = True
        if process_rank() == 0:
            tracker = t.hosted.tracker
            logger.info(f"lowprec: rollout restored from torchtitan's checkpoint at lowprec step {t.hosted.step}"
                        + (f"; MLflow run {tracker.run_id} continues" if tracker is not None else ""))
        if t.job_run is not None:
            warning = check_resumed_run(saved.get("tracking"), t.job_run, t.hosted.tracker.run_id)
            if warning:
                logger.warning(warning)


def lowprec_trainer(config: Trainer.Config, *, restore: bool = True) -> "LowprecTrainer.Config":
    """`config` (a job's Trainer.Config, its model built with LowprecConverter) as a
    LowprecTrainer.Config: the same fields; `restore` False starts lowprec's rollout again from
    the plan when torchtitan resumes from a checkpoint without lowprec's state."""
    values = {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}
    return LowprecTrainer.Config(**values, lowprec_restore=restore)


class LowprecTrainer(Trainer):
    """torchtitan's Trainer hosting lowprec's rollout; see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(Trainer.Config):
        lowprec_restore: bool = True
        """When torchtitan resumes from a checkpoint, go on from lowprec's rollout state in it
        (false: start the rollout again from the plan's formats)."""

    def __init__(self, config: Config):
        started = time.perf_counter()   # start-up: from here to the first step (telemetry's)
        super().__init__(config)
        dims = self.parallel_dims
        parts = [prepared_of(m) for m in self.model_parts]
        prepared = parts[0]
        stages = stages_of(self.model_parts, parts, dims.pp_enabled)
        self.max_norm = config.training.max_norm
        config.training.max_norm = math.inf   # torchtitan measures; lowprec clips (before the optimizers)
        self._loss_mesh = dims.get_optional_mesh("loss")
        self.pp_mesh = dims.get_optional_mesh("pp") if dims.pp_enabled else None   # None: no pipeline stages
        self._losses: list[torch.Tensor] = []
        self._tokens = None
        self._recording = True
        self._drawn: _Drawn | None = None
        self._withheld = False
        self.restored = False
        params = [p for m in self.model_parts for p in m.parameters()]
        self.hosted = HostedRollout(prepared.setup.config, stages.model, seed=prepared.setup.seed, state=stages.state,
                                    baseline=read_baseline(prepared.setup.config), whole=stages.whole)
        for model, p in zip(self.model_parts, parts):
            p.hosted = self.hosted
            model._lowprec_guard.remove()

        def clip() -> torch.Tensor:
            return dist_utils.clip_grad_norm_(params, self.max_norm, foreach=True, pp_mesh=self.pp_mesh,
                                              ep_enabled=dims.ep_enabled)

        telemetry = rank_telemetry(prepared.setup.config, device=self.device, model=stages.model, state=stages.state,
                                   started=started)
        from lowprec.integrations.torchtitan_probe import lr_probe_for
        probe = lr_probe_for(self, prepared.setup.config.rollout, clip)
        run_name = f"{config.model_spec.name}-{config.model_spec.flavor}"
        self.job_run = self._job_run(config, run_name)
        self.hosted.start(_Optimizers(self.optimizers), self.lr_schedulers, clip=clip, eval_forward=lambda tokens: logits(self, tokens),
                          run_name=run_name, lr_probe=probe, max_length=config.training.seq_len,
                          buffer=self.job_run.folder if self.job_run else None,
                          resume_tracking=self.job_run is not None and self.job_run.resume,
                          event_log=prepared.setup.event_log if prepared.setup.event_log and process_rank() == 0
                          else None, eval_share=from_rank_0,   # every rank evaluates; rank 0's outcome to every rank
                          telemetry=telemetry)
        self.timing = StepClock(telemetry, self.model_parts, self.checkpointer, pipelined=dims.pp_enabled)
        tracker = self.hosted.tracker
        if tracker is not None and self.job_run is not None:   # rank 0: name the run, as the HF callback does
            how = "continuing" if self.job_run.resume else "tracking into"
            logger.info(f"lowprec: {how} MLflow run {tracker.run_id or '(being created)'} named "
                        f"{tracker.run_name!r} (experiment {tracker.experiment!r}) at {tracker.tracking_uri}")
        if self.job_run is not None and self.job_run.continues:
            self.hosted.tracker.log_tags({"lowprec.continues_run": self.job_run.continues})
            logger.info(f"lowprec: MLflow run {self.job_run.continues} finished; this resumed job tracks into a "
                        f"new run (tag lowprec.continues_run)")
        self.optimizers.register_step_pre_hook(self._before_optimizer_step)
        if getattr(self.checkpointer, "enable", False):
            self._checkpoint_rollout(config.lowprec_restore)

    def _job_run(self, config, run_name: str) -> JobRun | None:
        """Rank 0's MLflow run: the resumed job's own when torchtitan resumes (`torchtitan_tracking`)."""
        cfg = prepared_of(self.model_parts[0]).setup.config
        if process_rank() != 0 or not cfg.tracking.enabled:
            return None
        resumes = torchtitan_resumes(self.checkpointer, config.checkpoint.load_step)
        return job_run(Path(config.dump_folder) / "lowprec", cfg.tracking.run_name or run_name, resumes)

    def _checkpoint_rollout(self, restore: bool) -> None:
        """The rollout's state in torchtitan's checkpoint states (see the module docstring)."""
        self.checkpointer.states[STATE_KEY] = _RolloutState(self)
        if not restore:
            self.checkpointer.exclude_from_loading = [*self.checkpointer.exclude_from_loading, STATE_KEY]
        load = self.checkpointer.load
        self.checkpointer.load = lambda *a, **k: self._load_checkpoint(load, *a, **k)

    # ------------------------------------------------------------------ each step
    def train_step(self, data_iterator) -> None:
        self.timing.step_begins()
        self._drawn = _Drawn(data_iterator, self.timing)
        self._losses.clear()
        self._withheld = False
        self.hosted.begin_step()   # the RNG and scaling state a replay starts from
        try:
            super().train_step(self._drawn)
        except RuntimeError as e:
            if not (self._withheld and str(e).startswith("Loss is not finite")):
                raise
            logger.warning(f"lowprec: step {self.step} had a non-finite loss and was withheld from the "
                           f"optimizers; training goes on")
        self.timing.stepped()
        lr = self.optimizers.optimizers[0].param_groups[0]["lr"]
        result = self.hosted.after_optimizer_step(lr=lr, tokens=self.timing.tokens(self._tokens))
        if result is not None and result.decision.events:
            for e in result.decision.events:
                logger.info(f"lowprec: {e.summary()}")

    def _before_optimizer_step(self, optimizer, args, kwargs) -> None:
        """The optimizers' step pre-hook: decide; a skip or rewind withholds the gradients."""
        if not self._losses or self._drawn is None:
            return None   # not a training step lowprec saw
        loss = self.global_loss(torch.stack([x.reshape(-1).sum() for x in self._losses]).sum())
        result = self.hosted.before_optimizer_step(loss, self._closure(list(self._drawn.items)),
                                                   framework_step=self.step)   # torchtitan counts it before
        self._withheld = result.decision.action is not Action.CONTINUE
        return None

    def forward_backward_step(self, *, input_dict, labels, global_valid_tokens) -> torch.Tensor:
        """torchtitan's, keeping the loss it returns and the global token count (see the module docstring)."""
        with self.timing.forward_backward(self._recording):
            loss = super().forward_backward_step(input_dict=input_dict, labels=labels,
                                                 global_valid_tokens=global_valid_tokens)
        if self._recording:
            self._losses.append(loss.detach())
            self._tokens = global_valid_tokens
        return loss

    @contextlib.contextmanager
    def not_recorded(self):
        """Forwards that are not the step's (a replay, the LR probe): their losses are not kept
        and torchtitan's count of tokens seen stays as it was, and so do its MoE layers' counts of
        tokens per expert (`tokens_per_expert_E`, which its load-balancing hook turns into the
        expert biases at the next optimizer step: a replayed batch is no trained batch, and the
        counts are in no checkpoint, so a resumed job would update the biases otherwise)."""
        seen, self._recording = self.ntokens_seen, False
        counts = [m.tokens_per_expert_E for part in self.model_parts for m in part.modules()
                  if isinstance(getattr(m, "tokens_per_expert_E", None), torch.Tensor)]
        kept = [c.detach().clone() for c in counts]
        try:
            yield
        finally:
            self.ntokens_seen, self._recording = seen, True
            with torch.no_grad():
                for c, k in zip(counts, kept):
                    c.copy_(k)

    def global_loss(self, local: torch.Tensor) -> torch.Tensor:
        """The rank's loss (its forward_backward_step's) as the step's mean loss torchtitan logs,
        the same on every rank: the last pipeline stage's, summed over the data-parallel ranks."""
        local = local.full_tensor() if hasattr(local, "full_tensor") else local
        local = last_stage_loss(local, self.pp_mesh)
        if self._loss_mesh is None:
            return local
        return dist_utils.dist_sum_tensor(local, self._loss_mesh)

    def _closure(self, drawn: list):
        """The step's forward and backward again, on the micro-batches it drew, through torchtitan
        (under pipeline parallelism: its schedule, one step per group of micro-batches)."""
        tokens, n = self._tokens, self.num_pipeline_parallel_microbatches
        groups = [drawn[i:i + n] for i in range(0, len(drawn), n)]

        def replay() -> torch.Tensor:
            total = None
            with self.not_recorded(), torch.enable_grad():
                for group in groups:
                    inputs = [{k: v.to(self.device) if isinstance(v, torch.Tensor) else v for k, v in d.items()}
                              for d, _ in group]
                    labels = [y.to(self.device) for _, y in group]
                    if self.pp_mesh is None:
                        inputs, labels = inputs[0], labels[0]
                    loss = self.forward_backward_step(input_dict=inputs, labels=labels,
                                                      global_valid_tokens=tokens).detach().reshape(-1).sum()
                    total = loss if total is None else total + loss
            return self.global_loss(total)
        return replay

    # ------------------------------------------------------------------ start, resume and end
    def train(self) -> None:
        with self.hosted.life.running(lambda: self.hosted.losses):   # FAILED if it raises, else FINISHED
            super().train()

    def _load_checkpoint(self, load, *args, **kwargs):
        """torchtitan's checkpointer.load, saying so when the checkpoint holds no lowprec state."""
        try:
            return load(*args, **kwargs)
        except (RuntimeError, KeyError, ValueError) as e:
            if STATE_KEY not in str(e) or self.restored:
                raise
            raise MissingRolloutStateError(
                "torchtitan resumes from a checkpoint that holds no lowprec rollout state (written without "
                "LowprecTrainer), so lowprec cannot go on where it was; return lowprec_trainer(config, "
                "restore=False) to start the rollout again from the plan's formats") from e

