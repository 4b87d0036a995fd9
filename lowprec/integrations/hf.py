"""lowprec in the Hugging Face `Trainer`: one callback built from a YAML file.

    from lowprec.integrations.hf import LowprecCallback
    callback = LowprecCallback.from_yaml("lowprec.yaml", model)        # prepares the model: do it first
    trainer = Trainer(model=model, args=args, train_dataset=train, callbacks=[callback])
    trainer.train()

What the callback does at the Trainer's events (the framework-neutral part is
`lowprec.integrations.core.HostedRollout`):

* `on_train_begin`: builds the session on the Trainer's optimizer and scheduler (unwrapped
  from accelerate's wrappers) and takes over gradient clipping: the Trainer's
  `max_grad_norm` is used by lowprec's clip, which must see the norm before clipping to
  find grad-norm spikes (the Trainer's own clip is turned off for the run and restored at
  the end). With the Trainer's MLflow reporting on (`report_to` includes "mlflow"), lowprec
  tracks into the run the Trainer opened: one run, not two, in the YAML's `tracking:` store
  and experiment (set at `on_init_end`, before the Trainer opens it; MLflow's own
  MLFLOW_EXPERIMENT_NAME, when set, wins, as the Trainer's reporting obeys it). Where the
  run really goes, read from the run, is said on stderr when training starts.
* every micro-batch's forward: a forward hook keeps the model's inputs and its `loss`
  (with the weight the Trainer's backward gave it, read by a gradient hook on the loss, so
  gradient accumulation and `num_items_in_batch` are replayed exactly).
* `on_pre_optimizer_step`: the step's loss and the closure that replays its micro-batches
  go to the session; a skipped step reaches `optimizer.step()` with no gradients (AdamW's
  moments and step count untouched).
* `on_step_end` (the Trainer stepped the optimizer and the scheduler): a rewind restores
  model, optimizer, scheduler and RNG; the Trainer's data goes on. Eval checkpoints of an
  `eval:` section run here.
* `on_evaluate` (the Trainer's own evaluation): the same eval set again with every layer in
  high precision; the relative gap of `eval_loss` to it is logged, and above
  `eval_gap_tolerance` it rolls the newest stage back, like the in-loop gate of a suite.
* `on_save` (the Trainer wrote `checkpoint-<step>`): lowprec's state goes into it,
  `lowprec/rank_<r>.pt` (`lowprec.integrations.state_files`). When the Trainer resumes from
  it, `on_train_begin` restores that state: each layer's format, the controller's stage
  and memory, lowprec's step and events, so a layer that fell back stays in BF16. A
  checkpoint without it is refused, saying how to go on (`restore=`).
* `on_train_end`: the final eval, the loss curve, the report pictures.

While the callback does lowprec's own work (the rollout's start, each step's decision, in-loop
gate, eval checkpoints and tracking, the end), what lm-eval, datasets and MLflow print goes to
`output_dir/lowprec/lowprec.log`, not the user's console (`lowprec.integrations.host_console`).

What the Trainer does not allow: its `global_step` never goes back, so a rewind of N steps
leaves the run N optimizer steps short of `max_steps` in lowprec's count (`callback.step`).
The loss is read from the model's output (`outputs.loss`): a `compute_loss` that computes
the loss outside the model (labels popped) cannot be replayed, and the callback says so.
FSDP and DeepSpeed under the Trainer are refused at `on_train_begin` (DDP is supported).
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lowprec.integrations.extras import require

transformers = require("transformers", "hf", "Hugging Face transformers (and accelerate)")

from lowprec.base.quiet import quiet_imports  # noqa: E402

with quiet_imports():   # transformers' model code loads torchao (its quantizers): without the chatter
    import transformers.modeling_utils  # noqa: E402,F401

from lowprec.config import LowprecConfig  # noqa: E402
from lowprec.integrations.host_console import HostConsole, host_log_path  # noqa: E402
from lowprec.integrations.core import Attach, HostedCallback, HostedRollout, allreduce_grads, framework_config  # noqa: E402
from lowprec.integrations.state_files import (MissingRolloutStateError, differing_weights, read_rollout_state,  # noqa: E402
                                              save_rollout_state, weights_fingerprint)
from lowprec.tracking.records import RunStatus  # noqa: E402

__all__ = ["LowprecCallback"]


def _loss_of(output: Any) -> torch.Tensor | None:
    loss = getattr(output, "loss", None)
    if loss is None and isinstance(output, dict):
        loss = output.get("loss")
    return loss if isinstance(loss, torch.Tensor) else None


def _unwrap(obj):
    """The torch optimizer / scheduler inside accelerate's wrappers."""
    for attr in ("optimizer", "scheduler"):
        inner = getattr(obj, attr, None)
        if inner is not None and type(obj).__module__.startswith("accelerate"):
            return inner
    return obj


def _routed(args):
    """A block of lowprec's work whose libraries' lines go to `output_dir/lowprec/lowprec.log`
    (`lowprec.integrations.host_console`)."""
    folder = Path(args.output_dir) / "lowprec"
    return HostConsole("hf", host_log_path(folder, getattr(args, "process_index", 0))).routed()


class _MicroBatch:
    __slots__ = ("args", "kwargs", "loss", "weight")

    def __init__(self, args, kwargs, loss):
        self.args, self.kwargs, self.loss, self.weight = args, kwargs, loss, 1.0


class LowprecCallback(HostedCallback, transformers.TrainerCallback):
    """Staged rollout, monitors, skips, rewinds, eval checkpoints and tracking in a `Trainer`."""

    def __init__(self, config: LowprecConfig | str | Path, model: nn.Module, *, seed: int = 0,
                 baseline: dict[int, float] | None = None, eval_tokenizer=None, max_length: int | None = None,
                 eval_gap_tolerance: float | None = 0.02, restore: bool | str | Path = True):
        """config: a LowprecConfig (role FRAMEWORK) or the path of its YAML file. model: the model the Trainer
        will train, prepared here (before the Trainer wraps it). eval_tokenizer / max_length:
        for an `eval:` suite (default: bytes, and the model's `max_position_embeddings`).
        eval_gap_tolerance: the Trainer's own evaluation is an eval checkpoint: its `eval_loss`
        against the same eval set in high precision; a relative gap above this rolls the newest
        stage back (None: the gap is logged only).
        restore: when the Trainer resumes from a checkpoint, where lowprec's state comes from:
        True, the checkpoint the Trainer resumes (`output_dir/checkpoint-<step>`, where it
        saves them); a folder, that checkpoint; False, none (lowprec starts again from the
        plan's formats and its first stage)."""
        if not isinstance(restore, (bool, str, Path)):
            raise TypeError(f"restore: expected True, False or a checkpoint folder, found {restore!r}")
        self.restore = restore
        if eval_gap_tolerance is not None and not eval_gap_tolerance >= 0:
            raise ValueError(f"eval_gap_tolerance: expected a relative gap >= 0 (e.g. 0.02) or None (log only), "
                             f"found {eval_gap_tolerance!r}")
        self.eval_gap_tolerance = eval_gap_tolerance
        config = framework_config(config)
        self.model = model
        self.hosted = HostedRollout(config, model, seed=seed, baseline=baseline)
        self.eval_tokenizer = eval_tokenizer
        self.max_length = max_length or getattr(getattr(model, "config", None), "max_position_embeddings", 256)
        self._micro: list[_MicroBatch] = []
        self._replaying = False
        self._saved_max_grad_norm: float | None = None
        self._hook = None

    # ------------------------------------------------------------------ capture
    def _keep_microbatch(self, module, args, kwargs, output) -> None:
        if self._replaying or not module.training or not torch.is_grad_enabled():
            return
        loss = _loss_of(output)
        mb = _MicroBatch(args, kwargs, loss)
        if loss is not None and loss.requires_grad:
            def weight(grad: torch.Tensor) -> None:
                mb.weight = grad.detach()
            loss.register_hook(weight)
        self._micro.append(mb)

    def _step_loss(self) -> torch.Tensor:
        if not self._micro or any(m.loss is None for m in self._micro):
            raise RuntimeError(
                "LowprecCallback reads each micro-batch's loss from the model's output (`outputs.loss`), and the "
                "model returned none: pass `labels` to the model (the Trainer's default compute_loss does), so "
                "that lowprec can measure and replay the step")
        return sum(m.weight * m.loss.detach() for m in self._micro)

    def _forward(self):
        """The step's forward alone (the loss as the Trainer weighted it): a window's first look."""
        micro, model = list(self._micro), self.model

        def forward() -> torch.Tensor:
            self._replaying = True
            try:
                return sum(m.weight * _loss_of(model(*m.args, **m.kwargs)).detach() for m in micro)
            finally:
                self._replaying = False
        return forward

    def _closure(self):
        micro, model = list(self._micro), self.model

        def replay() -> torch.Tensor:
            self._replaying = True
            try:
                total = 0.0
                for m in micro:
                    loss = _loss_of(model(*m.args, **m.kwargs))
                    (loss * m.weight).backward()
                    total = total + m.weight * loss.detach()
                allreduce_grads(model)   # the unwrapped model: DDP's reduction did not run
                return total
            finally:
                self._replaying = False
        return replay

    # ------------------------------------------------------------------ Trainer events
    def on_init_end(self, args, state, control, **kwargs):
        """The Trainer is built, its MLflow reporting not started: with `report_to` holding
        "mlflow", the run it opens goes to the YAML's `tracking:` store and experiment (a
        tracking URI already set, in MLflow or its environment variable, stays when the
        YAML names none; MLflow's MLFLOW_EXPERIMENT_NAME, which the Trainer's reporting sets
        when it starts, takes the run to its experiment instead, created here where it is new as
        the YAML's is, artifacts beside the store: `on_train_begin` reads the experiment from the
        run)."""
        tc = self.hosted.config.tracking
        if "mlflow" not in (args.report_to or []) or not tc.enabled:
            return
        import mlflow
        from mlflow.tracking._tracking_service.utils import is_tracking_uri_set
        from lowprec.tracking.cli import default_tracking_uri
        if tc.uri is not None or not is_tracking_uri_set():
            mlflow.set_tracking_uri(tc.uri or default_tracking_uri())
        from mlflow.environment_variables import MLFLOW_EXPERIMENT_NAME
        from mlflow.tracking import MlflowClient
        from lowprec.tracking.outbox import ensure_experiment
        with _routed(args):   # a new store's migration lines: the log's
            # created as `lowprec run` creates it: artifacts beside the store, not in ./mlruns;
            # so is MLflow's own MLFLOW_EXPERIMENT_NAME's, where the Trainer's run will go
            client = MlflowClient(mlflow.get_tracking_uri())
            for name in dict.fromkeys(filter(None, (tc.experiment, MLFLOW_EXPERIMENT_NAME.get()))):
                ensure_experiment(client, name)
            mlflow.set_experiment(tc.experiment)

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        for name in ("fsdp", "deepspeed"):
            if getattr(args, name, None):
                raise ValueError(
                    f"LowprecCallback does not support the Trainer's {name} yet (found {name}={getattr(args, name)!r}): "
                    f"lowprec's snapshots, replays and clipping are written for whole parameters on every rank; use "
                    f"DDP with the Trainer, or `lowprec run` (FSDP2) or lowprec's Session in your own loop")
        saved = self._saved_state(args, state)   # read (or refused) before anything changes
        # registered now, after any hook the user put on the model: it sees the output they see
        self._hook = self.model.register_forward_hook(self._keep_microbatch, with_kwargs=True)
        self._saved_max_grad_norm = args.max_grad_norm
        max_norm = args.max_grad_norm if args.max_grad_norm and args.max_grad_norm > 0 else None
        args.max_grad_norm = 0.0   # lowprec clips (and sees the norm before clipping)
        attach = None
        if "mlflow" in (args.report_to or []) and state.is_world_process_zero:
            import mlflow
            run = mlflow.active_run()
            if run is not None:   # its experiment may be MLFLOW_EXPERIMENT_NAME's, not the YAML's
                attach = Attach(run.info.run_id, mlflow.get_tracking_uri(),
                                mlflow.get_experiment(run.info.experiment_id).name)
        inner = self.model

        def forward(tokens: torch.Tensor) -> torch.Tensor:
            return inner(input_ids=tokens).logits
        with _routed(args):
            self.hosted.start(_unwrap(optimizer), _unwrap(lr_scheduler), max_grad_norm=max_norm,
                              eval_forward=forward, eval_tokenizer=self.eval_tokenizer, max_length=self.max_length,
                              run_name=args.run_name or Path(args.output_dir).name,
                              buffer_root=Path(args.output_dir) / "lowprec", attach=attach)
        tracker = self.hosted.tracker
        if tracker is not None and state.is_world_process_zero:
            whose = ", the Trainer's run" if attach is not None else ""
            print(f"lowprec: tracking into MLflow run {tracker.run_id} (experiment {tracker.experiment!r}{whose}) "
                  f"at {tracker.tracking_uri}", file=sys.stderr)
        if saved is not None:
            try:
                self.hosted.load_state_dict(saved)
            except Exception:
                self.hosted.end(RunStatus.FAILED)   # the run it opened is not left running
                raise

    def _saved_state(self, args, state) -> dict | None:
        """The rollout state to go on from when the Trainer resumes (`state.global_step` > 0 at
        `on_train_begin`: the Trainer loaded its state from the checkpoint), per `restore`."""
        if self.restore is False:
            return None
        if state.global_step == 0:
            if self.restore is not True:
                raise ValueError(f"restore={str(self.restore)!r} names a checkpoint, but the Trainer is not resuming "
                                 f"(global_step 0): pass resume_from_checkpoint= to trainer.train(), or drop restore=")
            return None
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}" if self.restore is True else Path(self.restore)
        how = ("Pass LowprecCallback(..., restore='<the checkpoint folder you resume from>') if it is elsewhere, "
               "or restore=False to start lowprec's rollout again from the plan's formats")
        try:
            saved = read_rollout_state(folder)
        except MissingRolloutStateError as e:
            raise MissingRolloutStateError(f"the Trainer resumes at step {state.global_step}, and lowprec cannot "
                                           f"go on where it was: {e}. {how}") from None
        # the Trainer resumed from a folder it does not name: the state must be that checkpoint's
        if saved.get("trainer_step") != state.global_step:
            raise ValueError(f"{folder} holds lowprec's state of Trainer step {saved.get('trainer_step')}, and the "
                             f"Trainer resumes at step {state.global_step}: it is another checkpoint's. {how}")
        differ = differing_weights(saved.pop("weights", {}), self.model)
        if differ:
            raise ValueError(f"{folder} holds lowprec's state saved with other weights than the ones the Trainer "
                             f"resumed ({len(differ)} parameter(s) differ, e.g. {differ[0]}): it belongs to another "
                             f"run or checkpoint. {how}")
        return saved

    def on_save(self, args, state, control, **kwargs):
        """The Trainer wrote `output_dir/checkpoint-<step>`: lowprec's state goes in with it."""
        if self.hosted.session is None:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if not folder.is_dir():   # a hyperparameter search's trial folders: not where resume looks
            warnings.warn(f"LowprecCallback: the Trainer saved a checkpoint that is not {folder}; lowprec's state is "
                          f"not in it, and resuming from it needs restore=False", stacklevel=2)
            return
        save_rollout_state({**self.hosted.state_dict(), "trainer_step": state.global_step,
                            "weights": weights_fingerprint(self.model)}, folder)

    def on_step_begin(self, args, state, control, **kwargs):
        self._micro.clear()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        loss, closure, forward = self._step_loss(), self._closure(), self._forward()
        with _routed(args):   # a check's in-loop gate evaluates here
            self.hosted.before_optimizer_step(loss, closure, forward=forward,
                                              framework_step=state.global_step + 1)   # the Trainer counts it after

    def on_step_end(self, args, state, control, **kwargs):
        self._micro.clear()
        with _routed(args):   # eval checkpoints and tracking: their libraries' lines go to the log
            self.hosted.after_optimizer_step()

    def on_evaluate(self, args, state, control, metrics=None, eval_dataloader=None, **kwargs):
        """The Trainer's evaluation as an eval checkpoint: the same eval set in high precision."""
        if self.hosted.session is None or not metrics or "eval_loss" not in metrics or eval_dataloader is None:
            return
        loss = float(metrics["eval_loss"])
        hp = self._eval_loss_high_precision(eval_dataloader) if self.hosted.below_high_precision else loss
        with _routed(args):
            self.hosted.precision_gap("trainer", loss, hp, self.eval_gap_tolerance)
        self.hosted.session.resume_statistics()

    def _eval_loss_high_precision(self, loader) -> float:
        """The mean eval loss over `loader` (batches weighted by their size, as the Trainer's
        evaluation loop weights them) with every layer in high precision."""
        model, total, count = self.model, 0.0, 0
        was_training = model.training
        self.state.collect_stats(False)
        model.eval()
        try:
            with torch.no_grad(), self.state.high_precision():
                device = next(model.parameters()).device
                for batch in loader:
                    batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
                    loss = _loss_of(model(**batch))
                    n = len(next(v for v in batch.values() if isinstance(v, torch.Tensor)))
                    total, count = total + float(loss) * n, count + n
        finally:
            model.train(was_training)
        return total / max(count, 1)

    def on_train_end(self, args, state, control, **kwargs):
        if self._saved_max_grad_norm is not None:
            args.max_grad_norm = self._saved_max_grad_norm
        with _routed(args):   # the final eval, the pictures, the run's end
            self.hosted.end()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
