"""lowprec as a torchtitan model converter: staged low-precision rollout under `torchtitan.train`.

A torchtitan job turns it on in its TOML config (the module is the job's custom config
module, which both adds the `[lowprec]` section and registers the converter):

    [job]
    custom_config_module = "lowprec.integrations.torchtitan"
    [model]
    converters = ["lowprec"]
    [lowprec]
    config = "precision.yaml"      # `precision:` and optional `rollout:`, as Session.from_yaml reads

What the converter does, through torchtitan's model-converter protocol
(`torchtitan.protocols.model_converter`: `__init__(job_config, parallel_dims)`,
`convert(model)`, `post_optimizer_hook(model)`):

* `__init__` reads and validates the YAML file (a `lowprec.base.parse.ConfigError` names
  the key, what was found and the fix) and refuses the features the protocol cannot carry
  (below), so a job fails at start, not after hours.
* `convert(model)` runs `lowprec.prepare(model, plan)`: the planned `nn.Linear`s become
  `PrecisionLinear`s holding the same Parameters. torchtitan builds its model on the meta
  device and materializes it later (`to_empty` + `init_weights`); the layers follow. It
  also builds the rollout controller (`lowprec.policy.rollout.build_controller`).
* `post_optimizer_hook(model)` runs once per training step, after `optimizer.step()`
  (torchtitan registers it as the optimizers' step post-hook). It keeps the step's
  quantizer statistics (on check steps), and on every `check_every`-th step hands the
  window's signals to the controller and applies its decision to the next steps: stage
  promotions after `min_steps` stable steps, fallbacks by the statistics rules (a site's
  saturated or flushed fraction or SQNR across its thresholds for `site_patience` checks;
  NaN/Inf in a site's forward operands), cooldown retries and quarantine.

What torchtitan's converter protocol cannot support, and why. A converter sees the model
twice, at `convert` and after each optimizer step; it never sees the loss, the grad norm
(torchtitan computes and clips it inside `Trainer.train_step`, out of a converter's
reach) or a closure that redoes the step, and it has no say over `optimizer.step()`. So:

* no skip: a step with NaN/Inf or a spike is applied by torchtitan before the hook runs;
* no rewind (`rollout.rewind.enabled: true` is refused): restoring model, optimizer and
  scheduler needs the loop, and the data loader belongs to the trainer;
* no replay attribution (`rollout.attribution` has no effect): it needs the step's closure;
* no loss or grad-norm anomaly detection and no loss gap (`thresholds.loss_gap` and
  `baseline` are refused): there is no loss to watch. A NaN still falls back the site
  whose own forward operands went non-finite, at the next check step;
* no LR probe (`rollout.lr_probe.enabled: true` is refused): it needs a held batch and a
  forward-only loss;
* no pipeline parallelism (refused): the stages split the model after `convert`, so one
  rank's state would name layers it does not hold;
* the rollout's state is not in torchtitan's checkpoints: a resumed job starts again
  from the plan's formats.

There is no global state here beyond torchtitan's own converter registry; each converter
holds its own PrecisionState, controller and monitor (`state`, `controller`, `monitor`,
`events`, `step`).
"""

# no `from __future__ import annotations`: torchtitan (tyro) resolves the config dataclasses' field types

from dataclasses import dataclass, field
from pathlib import Path

from lowprec.integrations.extras import require

require("torchtitan", "torchtitan", "torchtitan")

from torch import nn  # noqa: E402
from torchtitan.protocols.model_converter import register_model_converter  # noqa: E402
from torchtitan.tools.logging import logger  # noqa: E402

from lowprec.config import ConfigRole, LowprecConfig  # noqa: E402
from lowprec.base.parse import ConfigError  # noqa: E402
from lowprec.policy.decisions import apply_decision  # noqa: E402
from lowprec.policy.events import Event, EventLog  # noqa: E402
from lowprec.policy.monitor import Monitor  # noqa: E402
from lowprec.sites.plan import PrecisionPlan  # noqa: E402
from lowprec.policy.rollout import RolloutConfig, build_controller  # noqa: E402
from lowprec.sites.precision_state import prepare  # noqa: E402

__all__ = ["LowprecSection", "JobConfig", "LowprecConverter", "load_config", "NAME"]

NAME = "lowprec"   # the name in `[model] converters`


@dataclass
class LowprecSection:
    """The `[lowprec]` section of a torchtitan job config."""

    config: str = ""
    """Path of the lowprec YAML file: a `precision:` section and an optional `rollout:` one."""

    seed: int = 0
    """Base seed of every site's stochastic-rounding generator and Hadamard signs."""

    event_log: str = ""
    """A JSONL file the rollout's events (promotions, fallbacks, retries) are appended to; "" for none."""


@dataclass
class JobConfig:
    """What this module adds to torchtitan's JobConfig when it is the job's
    `custom_config_module` (torchtitan merges it into its own JobConfig)."""

    lowprec: LowprecSection = field(default_factory=LowprecSection)


def _refuse(path: str, found, why: str, fix: str) -> ConfigError:
    return ConfigError(path, f"is {found!r}; under torchtitan's model converter {why}. Fix: {fix}")


def load_config(path: str | Path) -> tuple[PrecisionPlan, RolloutConfig | None]:
    """The plan and the rollout of a lowprec YAML file, checked against what a torchtitan
    converter can do (see the module docstring). Raises ConfigError."""
    if not str(path):
        raise ConfigError("lowprec.config", "is empty; name the lowprec YAML file (a `precision:` section and "
                          "optionally `rollout:`), e.g. [lowprec] config = \"precision.yaml\"")
    cfg = LowprecConfig.from_yaml(path, role=ConfigRole.SESSION)
    plan, rollout = cfg.precision, cfg.rollout
    if rollout is not None:
        if rollout.rewind.enabled:
            raise _refuse("rollout.rewind.enabled", True, "the training loop and its data loader are "
                          "torchtitan's: a converter cannot restore model, optimizer and scheduler",
                          "set `rewind: false` (fallbacks still happen at check steps)")
        if rollout.lr_probe.enabled:
            raise _refuse("rollout.lr_probe.enabled", True, "there is no held batch and no forward-only loss "
                          "to probe with", "set `lr_probe: false`")
        if rollout.thresholds.loss_gap is not None:
            raise _refuse("rollout.thresholds.loss_gap", rollout.thresholds.loss_gap, "the loss never reaches "
                          "the converter", "remove `loss_gap` (null)")
        if rollout.baseline is not None:
            raise _refuse("rollout.baseline", "set", "the loss never reaches the converter, so there is "
                          "nothing to compare with a baseline", "remove `baseline`")
    return plan, rollout


class LowprecConverter:
    """torchtitan's ModelConverter for lowprec (registered as "lowprec"); see the module docstring."""

    def __init__(self, job_config, parallel_dims):
        section = getattr(job_config, "lowprec", None)
        if not isinstance(section, LowprecSection):
            raise ConfigError("lowprec", (
                f"the job config has no [lowprec] section (found {type(section).__name__}); set "
                "[job] custom_config_module = \"lowprec.integrations.torchtitan\" (it adds the section) and "
                "[lowprec] config = \"<your lowprec YAML>\""))
        if parallel_dims is not None and getattr(parallel_dims, "pp_enabled", False):
            raise _refuse("parallelism.pipeline_parallel_degree", job_config.parallelism.pipeline_parallel_degree,
                          "pipeline stages split the model after convert(), and a rank's rollout would name "
                          "layers it does not hold", "run lowprec without pipeline parallelism (degree 1)")
        try:
            self.plan, self.rollout = load_config(section.config)
        except ConfigError as e:   # say which file the key is in
            where = e.path if e.path.startswith(("lowprec.", str(section.config))) else \
                f"{e.path} (in {section.config})"
            raise type(e)(where, e.message) from None
        self.seed = section.seed
        self.log = EventLog(section.event_log) if section.event_log else None
        self.state = None
        self.controller = None
        self.monitor: Monitor | None = None
        self.events: list[Event] = []
        self.step = 0                     # the training step the next post_optimizer_hook concludes
        self._model: nn.Module | None = None
        self._hook = None

    # ---------------------------------------------------------------- the protocol
    def convert(self, model: nn.Module) -> None:
        """Swap the plan's linear layers for PrecisionLinear (in place, same Parameters) and
        build the controller. Called once, on the whole model (torchtitan: on the meta device)."""
        if self.state is not None:
            raise RuntimeError("LowprecConverter.convert was called twice; one converter prepares one model")
        self._model = model
        self.state = prepare(model, self.plan, seed=self.seed)
        if self.rollout is None:
            self.state.collect_stats(False)   # the plan as it is: nothing reads statistics
        else:
            self.controller = build_controller(self.rollout, self.state, model)
            # the monitor's buffers live on the weights' device, which a meta model does not have
            # yet: it is built at the first forward (or the first hook, whichever comes first)
            self._hook = model.register_forward_pre_hook(lambda *_: self._start())
            self.state.collect_stats(self._config_wants_stats(0))
        logger.info(f"lowprec: {len(self.state.sites)} precision sites {self._summary()}"
                    f"{'' if self.rollout is None else f', {len(self.rollout.stages)} rollout stage(s)'}")

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """Conclude one training step (after torchtitan's optimizer step): keep the statistics,
        and on a check step let the controller decide; changes apply from the next step."""
        if self.controller is None:
            self.step += 1
            return
        self._start()
        mon, s = self.monitor, self.step
        mon.record_statistics(s)
        if mon.is_check_step(s):
            decision = self.controller.observe_step(s, None, mon.check(s))
            if decision.changes:
                apply_decision(self.state, decision)
            if decision.events:
                self.events += decision.events
                if self.log is not None:
                    self.log.append(decision.events)
                for e in decision.events:
                    logger.info(f"lowprec: {e.summary()}")
        self.step = s + 1
        mon.before_step(self.step)   # statistics on for the next step if it is a check step

    # ---------------------------------------------------------------- helpers
    def _config_wants_stats(self, step: int) -> bool:
        mc = self.rollout.monitor_config()
        return mc.stats_every_step or (step + 1) % mc.check_every == 0

    def _start(self) -> None:
        """Build the monitor once the weights are materialized (not on the meta device)."""
        if self.monitor is not None:
            return
        if any(s.module.weight.is_meta for s in self.state.sites.values()):
            raise RuntimeError("lowprec: the model's weights are still on the meta device at its first forward; "
                               "materialize it (to_empty + init_weights) before training")
        self.monitor = Monitor(self.state, self.rollout.monitor_config())
        self.monitor.before_step(self.step)
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _summary(self) -> str:
        counts: dict[str, int] = {}
        for fmt in self.state.formats().values():
            counts[fmt] = counts.get(fmt, 0) + 1
        return "(" + ", ".join(f"{n} in {f}" for f, n in sorted(counts.items())) + ")"

    def close(self) -> None:
        """Remove the monitor's hooks (the model keeps its PrecisionLinear layers)."""
        if self.monitor is not None:
            self.monitor.close()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None


register_model_converter(LowprecConverter, NAME)
