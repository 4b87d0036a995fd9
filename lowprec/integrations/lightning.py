"""lowprec in Lightning's `Trainer`: one callback built from a YAML file.

    from lowprec.integrations.lightning import LowprecCallback
    callback = LowprecCallback.from_yaml("lowprec.yaml", module)   # prepares the layers: do it first
    trainer = lightning.Trainer(max_steps=1000, callbacks=[callback])
    trainer.fit(module, train_loader)

`module` is the LightningModule or the model inside it; the FQNs and globs of the config are
relative to what you pass, and it must hold every parameter the optimizer updates. The
framework-neutral part is `lowprec.integrations.core.HostedRollout`. Where Lightning's
automatic optimization calls the callback (one optimizer; `accumulate_grad_batches`
micro-batches per step):

* `setup`: refuses what lowprec cannot run correctly (below).
* `on_train_start`: builds the session on the Trainer's optimizer and LR scheduler and
  takes over gradient clipping. lowprec's clip must see the norm before clipping (a
  grad-norm spike is invisible after it), and Lightning clips right after
  `on_before_optimizer_step`, so with `gradient_clip_val` set (algorithm "norm") lowprec
  clips at that value itself and the Trainer's `gradient_clip_val` is None for the run
  (restored at the end). With `gradient_clip_algorithm="value"`, or a LightningModule that
  overrides `configure_gradient_clipping`, lowprec only measures the norm and Lightning's
  clipping runs after it, as configured. With a Lightning `MLFlowLogger`, lowprec tracks
  into that logger's run (one run, not two); otherwise into its own run per `tracking:`.
* `on_train_batch_start`: keeps the micro-batch (and, on a step's first, the RNG and
  scaling state a replay starts from); `on_before_backward` keeps its loss, already
  divided by `accumulate_grad_batches`.
* `on_before_optimizer_step` (after the last micro-batch's backward, before Lightning's
  clip and `optimizer.step()`): the step's loss and a replay closure (the captured
  micro-batches through `training_step` again, with the same division and backward; the
  module's `self.log` calls are dropped during a replay) go to the session. A skipped
  step reaches `optimizer.step()` with every gradient None: AdamW's moments and step count
  stay as they were; Lightning still steps the scheduler, as lowprec's own loop does.
* `on_train_batch_end` (Lightning stepped the optimizer and the "step" scheduler): a rewind
  restores model, optimizer, scheduler and RNG; Lightning's data goes on. Eval
  checkpoints of an `eval:` section run here.
* `state_dict` / `load_state_dict`: Lightning saves lowprec's state in its checkpoints and,
  when `trainer.fit(ckpt_path=...)` resumes, `on_train_start` goes on from it: each layer's
  format, the controller's stage and memory, lowprec's step and events. A checkpoint
  without it is refused, saying how to go on (`restore=False`).
* `on_train_end`: the final eval, the loss curve, the report pictures.

While the callback does lowprec's own work (the rollout's start, each step's decision, in-loop
gate, eval checkpoints and tracking, the end), what lm-eval, datasets and MLflow print goes to
`default_root_dir/lowprec/lowprec.log`, not the user's console (`lowprec.integrations.host_console`).

Under DDP a replay runs the LightningModule itself (not the DDP wrapper) and averages the
gradients with `allreduce_grads`. Ctrl-C and SIGTERM (which Lightning turns into an exception at
the next batch's end) end the MLflow run KILLED with the reason in the tag `lowprec.stopped`, never
FAILED: the run continues from Lightning's last checkpoint.

What Lightning does not allow, said plainly: `trainer.global_step` never goes back, so a
rewind of N steps leaves the run N optimizer steps short of `max_steps` in lowprec's count
(`callback.step`). Manual optimization (`automatic_optimization = False`), more than one LR
scheduler, 16-bit precision with a GradScaler (`precision="16-mixed"`: the loss Lightning
hands over is scaled) and strategies other than single-device and DDP are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from lowprec.integrations.extras import require

lightning = require("lightning", "lightning", "Lightning")

from lightning.pytorch.loggers import MLFlowLogger  # noqa: E402
from lightning.pytorch.strategies import DDPStrategy, SingleDeviceStrategy  # noqa: E402
from lightning.pytorch.utilities import GradClipAlgorithmType  # noqa: E402
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException  # noqa: E402
from lightning.pytorch.utilities.model_helpers import is_overridden  # noqa: E402
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature  # noqa: E402

from lowprec.config import LowprecConfig  # noqa: E402
from lowprec.integrations.core import Attach, HostedCallback, HostedRollout, allreduce_grads, framework_config  # noqa: E402
from lowprec.integrations.host_console import HostConsole, host_log_path  # noqa: E402
from lowprec.integrations.state_files import MissingRolloutStateError  # noqa: E402
from lowprec.tracking.records import RunStatus  # noqa: E402

__all__ = ["LowprecCallback"]


def _loss_of(output: Any) -> torch.Tensor | None:
    """The loss of a `training_step` output, as Lightning reads it: a tensor or a dict's "loss"."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict) and isinstance(output.get("loss"), torch.Tensor):
        return output["loss"]
    return None


def _logits_of(output: Any) -> torch.Tensor:
    logits = getattr(output, "logits", None)
    if logits is None and isinstance(output, dict):
        logits = output.get("logits")
    if logits is None and isinstance(output, torch.Tensor):
        logits = output
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"the model returned a {type(output).__name__} without logits on token ids: give "
                        f"LowprecCallback an eval_forward(tokens) -> logits")
    return logits


def _max_length(model: nn.Module) -> int:
    for m in model.modules():
        n = getattr(getattr(m, "config", None), "max_position_embeddings", None)
        if isinstance(n, int):
            return n
    return 256


def _routed(trainer):
    """A block of lowprec's work whose libraries' lines (lm-eval, datasets, MLflow) go to
    `default_root_dir/lowprec/lowprec.log` (`lowprec.integrations.host_console`)."""
    folder = Path(trainer.default_root_dir) / "lowprec"
    return HostConsole("lightning", host_log_path(folder, trainer.global_rank)).routed()


def _no_log(*args, **kwargs) -> None:
    """`self.log` during a replay: the step was logged when it ran."""


class LowprecCallback(HostedCallback, lightning.pytorch.Callback):
    """Staged rollout, monitors, skips, rewinds, eval checkpoints and tracking in a Lightning `Trainer`."""

    def __init__(self, config: LowprecConfig | str | Path, model: nn.Module, *, seed: int = 0,
                 baseline: dict[int, float] | None = None,
                 eval_forward: Callable[[torch.Tensor], torch.Tensor] | None = None, eval_tokenizer=None,
                 max_length: int | None = None, restore: bool = True):
        """config: a LowprecConfig (role FRAMEWORK) or the path of its YAML file. model: the LightningModule or the
        model inside it, prepared here (before `trainer.fit`). eval_forward(tokens) -> logits:
        how an `eval:` suite runs the model (default: `model(tokens)` and its logits);
        eval_tokenizer / max_length: for the suite (default: bytes, `max_position_embeddings`).
        restore: when `trainer.fit(ckpt_path=...)` resumes, go on from the rollout state in that
        checkpoint (False: start again from the plan's formats and the first stage)."""
        config = framework_config(config)
        if (config.eval is not None and eval_forward is None and isinstance(model, lightning.pytorch.LightningModule)
                and not is_overridden("forward", model, parent=lightning.pytorch.LightningModule)):
            raise MisconfigurationException(
                f"{config.source} has an `eval:` section and {type(model).__name__} has no forward(): give "
                f"LowprecCallback an eval_forward(tokens) -> logits (e.g. lambda t: module.model(t).logits)")
        self.model = model
        self.hosted = HostedRollout(config, model, seed=seed, baseline=baseline)
        self.eval_forward = eval_forward
        self.eval_tokenizer = eval_tokenizer
        self.max_length = max_length or _max_length(model)
        self._micro: list[tuple[tuple, list]] = []   # (training_step args, [its loss])
        self._stepped = False
        self._replaying = False
        self._clip_val: tuple[Any, ...] | None = None
        self.restore = bool(restore)
        self._saved: dict | None = None   # from the checkpoint Lightning resumes, until the session exists

    # ------------------------------------------------------------------ refusals
    def setup(self, trainer, pl_module, stage: str) -> None:
        if stage != "fit":
            return
        why = None
        if not pl_module.automatic_optimization:
            why = ("manual optimization (`automatic_optimization = False`): lowprec must see each step's loss and "
                   "replay its forward and backward, which only automatic optimization hands over")
        elif getattr(trainer.precision_plugin, "scaler", None) is not None:
            why = (f"precision={trainer.precision!r} with a GradScaler: the loss Lightning hands to callbacks is "
                   f"scaled; use precision='bf16-mixed' or '32-true'")
        elif type(trainer.strategy) not in (SingleDeviceStrategy, DDPStrategy):
            why = (f"the {type(trainer.strategy).__name__}: lowprec's replays and clipping are written for "
                   f"single-device and DDP training")
        if why is not None:
            raise MisconfigurationException(f"LowprecCallback cannot run with {why}")

    # ------------------------------------------------------------------ start and end
    def on_train_start(self, trainer, pl_module) -> None:
        if self.restore and trainer.ckpt_path is not None and self._saved is None:
            raise MissingRolloutStateError(
                f"Lightning resumes from {trainer.ckpt_path}, which holds no lowprec rollout state (it was written "
                f"without LowprecCallback), so lowprec cannot go on where it was; pass LowprecCallback(..., "
                f"restore=False) to start lowprec's rollout again from the plan's formats")
        if len(trainer.optimizers) != 1 or len(trainer.lr_scheduler_configs) > 1:
            raise MisconfigurationException(
                f"LowprecCallback runs one optimizer and at most one LR scheduler (found "
                f"{len(trainer.optimizers)} and {len(trainer.lr_scheduler_configs)}): a rewind restores what it holds")
        optimizer = trainer.optimizers[0]
        mine = {id(p) for p in self.model.parameters()}
        if any(id(p) not in mine for g in optimizer.param_groups for p in g["params"]):
            raise MisconfigurationException(
                "the optimizer updates parameters outside the module given to LowprecCallback, which a skip or a "
                "rewind would miss: give LowprecCallback the LightningModule (with FQNs in the config relative to it)")
        scheduler = trainer.lr_scheduler_configs[0].scheduler if trainer.lr_scheduler_configs else None
        max_norm = None
        self._clip_val = (trainer.gradient_clip_val,)
        own_clip = is_overridden("configure_gradient_clipping", pl_module)
        algorithm = GradClipAlgorithmType(trainer.gradient_clip_algorithm or "norm")   # None: Lightning's default
        if trainer.gradient_clip_val and algorithm is GradClipAlgorithmType.NORM and not own_clip:
            max_norm = float(trainer.gradient_clip_val)
            trainer.gradient_clip_val = None   # lowprec clips (and sees the norm before clipping)
        attach = None
        mlflow_logger = next((lg for lg in trainer.loggers if isinstance(lg, MLFlowLogger)), None)
        if mlflow_logger is not None and trainer.is_global_zero:
            client = mlflow_logger.experiment   # the logger's MlflowClient; its experiment_name, not the YAML's
            attach = Attach(mlflow_logger.run_id, client.tracking_uri,
                            client.get_experiment(mlflow_logger.experiment_id).name)
        model = self.model
        forward = self.eval_forward or (lambda tokens: _logits_of(model(tokens)))
        root = Path(trainer.default_root_dir)
        with _routed(trainer):
            self.hosted.start(optimizer, scheduler, max_grad_norm=max_norm, eval_forward=forward,
                              eval_tokenizer=self.eval_tokenizer, max_length=self.max_length,
                              run_name=root.resolve().name or "lightning", buffer_root=root / "lowprec",
                              attach=attach)
        if self.restore and self._saved is not None:
            saved, self._saved = self._saved, None
            self.hosted.load_state_dict(saved)   # on failure, on_exception ends the run it opened

    # ------------------------------------------------------------------ Lightning's checkpoints
    def state_dict(self) -> dict[str, Any]:
        """Saved by Lightning in its checkpoint: lowprec's rollout state (`HostedRollout.state_dict`)."""
        return self.hosted.state_dict() if self.hosted.session is not None else {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Called by Lightning when it resumes, before `on_train_start`: kept until the session exists."""
        self._saved = dict(state_dict) or None

    def on_train_end(self, trainer, pl_module) -> None:
        self._restore_clip(trainer)
        with _routed(trainer):
            self.hosted.end()   # the final eval

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        """The run ends FAILED, or KILLED (tagged `lowprec.stopped`) when a signal stopped it:
        Ctrl-C reaches here as KeyboardInterrupt, SIGTERM as Lightning's SIGTERMException at the
        next batch's end. Either is resumable from Lightning's last checkpoint."""
        self._restore_clip(trainer)
        if self.hosted.session is None:
            return
        stopped = {KeyboardInterrupt: "SIGINT (Ctrl-C)", SIGTERMException: "SIGTERM"}.get(type(exception))
        if stopped is None:
            self.hosted.end(RunStatus.FAILED)
            return
        self.hosted.end(RunStatus.KILLED, reason=(
            f"{stopped} at lowprec step {self.hosted.step} under Lightning: resume with trainer.fit(..., "
            f"ckpt_path=<the last checkpoint>), which restores the rollout"))

    def _restore_clip(self, trainer) -> None:
        if self._clip_val is not None:
            trainer.gradient_clip_val, self._clip_val = self._clip_val[0], None

    # ------------------------------------------------------------------ each micro-batch
    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx: int) -> None:
        if self.hosted.session is None:
            return
        if not self._micro:
            self.hosted.begin_step()   # a replay re-runs training_step from here
        # as Lightning calls it: batch_idx only when the signature takes a second argument
        takes_idx = is_param_in_hook_signature(pl_module.training_step, "batch_idx", min_args=2)
        self._micro.append(((batch, batch_idx) if takes_idx else (batch,), []))

    def on_before_backward(self, trainer, pl_module, loss: torch.Tensor) -> None:
        if self._micro and not self._replaying:
            self._micro[-1][1].append(loss.detach())

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        if self.hosted.session is None:
            return
        if not self._micro or any(len(losses) != 1 for _, losses in self._micro):
            raise RuntimeError(
                "LowprecCallback needs one backward per micro-batch: a training_step that returns None (a skipped "
                "batch) or calls backward itself cannot be measured and replayed by lowprec")
        loss = sum(losses[0] for _, losses in self._micro)
        self._stepped = True
        closure = self._closure(trainer, pl_module)
        with _routed(trainer):   # a check's in-loop gate evaluates here
            self.hosted.before_optimizer_step(loss, closure, framework_step=trainer.global_step + 1)   # counted after

    def _closure(self, trainer, pl_module) -> Callable[[], torch.Tensor]:
        micro, divide = [args for args, _ in self._micro], trainer.accumulate_grad_batches
        precision = trainer.precision_plugin

        def replay() -> torch.Tensor:
            self._replaying = True
            pl_module.log = pl_module.log_dict = _no_log   # the step was logged when it ran
            try:
                total = 0.0
                with torch.enable_grad():
                    for args in micro:
                        with precision.train_step_context():
                            loss = _loss_of(pl_module.training_step(*args)) / divide
                        loss.backward()
                        total = total + loss.detach()
                allreduce_grads(pl_module)   # the unwrapped module: DDP's reduction did not run
                return total
            finally:
                vars(pl_module).pop("log", None)
                vars(pl_module).pop("log_dict", None)
                self._replaying = False
        return replay

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx: int) -> None:
        if not self._stepped:
            return   # accumulating: the step goes on with the next micro-batch
        self._stepped = False
        self._micro.clear()
        with _routed(trainer):
            self.hosted.after_optimizer_step()   # rewinds, and eval checkpoints of an `eval:` section
