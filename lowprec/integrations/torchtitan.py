"""lowprec as a torchtitan model converter: staged low-precision rollout under `torchtitan.train`.

For torchtitan 0.3 (`torchtitan>=0.3,<0.4`). A torchtitan 0.3 job is a Python function that
returns a `Trainer.Config` (a "config registry" module, `--module my_configs --config fn`); its
model comes from a model's `model_registry(flavor, converters=[...])`, which applies the
converters to the model's *config tree* before the model is built. lowprec plugs in there,
as torchtitan's own float8 converter does, and adds a post-optimizer-build function:

    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from lowprec.integrations.torchtitan import LowprecConverter, with_rollout

    def llama3_debugmodel_lowprec():
        config = llama3_debugmodel()
        config.model_spec = with_rollout(model_registry(
            "debugmodel", converters=[LowprecConverter.Config(config="precision.yaml")]))
        return config

What each part does (torchtitan's protocol: `ModelConfigConverter.convert(model_config)`
and `ModelSpec.post_optimizer_build_fn(optimizers, model_parts, parallel_dims)`):

* `LowprecConverter(config)` reads and validates the YAML file (`precision:` and optional
  `rollout:`; a `ConfigError` names the key, what was found and the fix) and refuses what the
  protocol cannot carry (below), so a job fails at start, not after hours.
* `convert(model_config)` wraps the root model config: the model class becomes a subclass
  whose constructor builds the model as before and then runs `lowprec.prepare(model, plan)`,
  so the planned linear layers become `TitanPrecisionLinear`s (a `PrecisionLinear` that is a
  torchtitan `Module`, holding the same Parameters and their `param_init`). The plan's
  selectors need the built modules (types, parents, block indices), so the swap happens at
  build, on the meta device; `to_empty` + `init_weights` materialize and initialize the layers.
* `with_rollout(model_spec)` sets the spec's `post_optimizer_build_fn` (after the model's own,
  if it has one): it registers the rollout on torchtitan's optimizers as a step post-hook, so
  after every `optimizer.step()` lowprec keeps the step's quantizer statistics (on check
  steps) and on every `check_every`-th step the controller decides: stage promotions after
  `min_steps` stable steps, fallbacks by the statistics rules (a site's saturated or flushed
  fraction or SQNR across its thresholds for `site_patience` checks; NaN/Inf in a site's
  forward operands), cooldown retries and quarantine. Without it a rollout never decides:
  the model's first forward then stops the job and says how to add it.

What the protocol cannot support, and why. A converter sees the model config, lowprec's
layers see the forwards, the hook sees the end of each optimizer step; none sees the loss,
the grad norm (computed and clipped inside `Trainer.train_step`) or a closure that redoes the
step, and none has a say over `optimizer.step()`. So:

* no skip: a step with NaN/Inf or a spike is applied by torchtitan before the hook runs;
* no rewind (`rollout.rewind.enabled: true` is refused): it needs the loop and the data loader;
* no replay attribution (`rollout.attribution` has no effect): it needs the step's closure;
* no loss or grad-norm anomaly detection, no loss gap (`thresholds.loss_gap` and `baseline`
  are refused); a NaN still falls back the site whose own operands went non-finite;
* no LR probe (`rollout.lr_probe.enabled: true` is refused): no held batch, no forward-only loss;
* only the `emulated` and `torch` backends (`te` and `torchao` are refused): their layers are
  not torchtitan Modules, which torchtitan's `init_weights` and protocol check need;
* no pipeline parallelism (refused when the optimizers are built): the stages split the model
  after the build, and one rank's rollout would name layers it does not hold;
* no LoRA converter (refused at build): lowprec would replace the LoRA layers, adapters and all;
* the rollout's state is not in torchtitan's checkpoints: a resumed job starts again from the
  plan's formats.

No global state: each built model holds its own `TitanRollout` (`rollout_of(model)`): its
PrecisionState, controller, monitor, events and step.
"""

# no `from __future__ import annotations`: torchtitan (tyro) resolves the config dataclasses' field types

import dataclasses
from dataclasses import dataclass
from pathlib import Path

from lowprec.integrations.extras import MissingExtraError, require

_titan = require("torchtitan", "torchtitan", "torchtitan")
try:   # torchtitan 0.3's converter protocol; 0.2 had another one (torchtitan.protocols.model_converter)
    from torchtitan.protocols.model import ModelConfigConverter
except ImportError as e:
    raise MissingExtraError(
        f"lowprec.integrations.torchtitan needs torchtitan 0.3.x (its ModelConfigConverter protocol); the installed "
        f"torchtitan {getattr(_titan, '__version__', '?')} does not have it ({e}); install a supported one with: "
        f"pip install 'lowprec[torchtitan]' (torchtitan>=0.3,<0.4)") from None

from torch import nn  # noqa: E402
from torchtitan.protocols.module import Module  # noqa: E402
from torchtitan.tools.logging import logger  # noqa: E402

from lowprec.base.parse import ConfigError  # noqa: E402
from lowprec.config import ConfigRole, LowprecConfig  # noqa: E402
from lowprec.policy.decisions import apply_decision  # noqa: E402
from lowprec.policy.events import Event, EventLog  # noqa: E402
from lowprec.policy.monitor import Monitor  # noqa: E402
from lowprec.policy.rollout import RolloutConfig, build_controller  # noqa: E402
from lowprec.sites.backends import BackendName  # noqa: E402
from lowprec.sites.layers import PrecisionLinear  # noqa: E402
from lowprec.sites.plan import PrecisionPlan  # noqa: E402
from lowprec.sites.precision_state import prepare  # noqa: E402

__all__ = ["LowprecConverter", "TitanPrecisionLinear", "TitanRollout", "load_config",
           "post_optimizer_build_fn", "rollout_of", "with_rollout"]

_ATTR = "_lowprec_rollout"   # the built model's attribute holding its TitanRollout


def _refuse(path: str, found, why: str, fix: str) -> ConfigError:
    return ConfigError(path, f"is {found!r}; under torchtitan's model converter {why}. Fix: {fix}")


def load_config(path: str | Path) -> tuple[PrecisionPlan, RolloutConfig | None]:
    """The plan and the rollout of a lowprec YAML file, checked against what a torchtitan
    converter can do (see the module docstring). Raises ConfigError."""
    if not str(path):
        raise ConfigError("LowprecConverter.Config.config", "is empty; name the lowprec YAML file (a "
                          "`precision:` section and optionally `rollout:`), e.g. "
                          "LowprecConverter.Config(config=\"precision.yaml\")")
    cfg = LowprecConfig.from_yaml(path, role=ConfigRole.SESSION)
    plan, rollout = cfg.precision, cfg.rollout
    if BackendName(plan.backend) in (BackendName.TE, BackendName.TORCHAO):
        raise _refuse("precision.backend", str(plan.backend), "layers must be torchtitan Modules (its "
                      "init_weights initializes only those) and this backend makes its own", "use "
                      "`backend: emulated` or `backend: torch`")
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


class TitanPrecisionLinear(PrecisionLinear, Module):
    """A PrecisionLinear that satisfies torchtitan's Module protocol: `init_weights` initializes
    it with the `param_init` of the layer it replaced, and its sharding config comes along."""

    @classmethod
    def from_module(cls, module: nn.Module, fmt, backend, **kw) -> "TitanPrecisionLinear":
        layer = super().from_module(module, fmt, backend, **kw)
        layer._param_init = getattr(module, "_param_init", None)
        layer._sharding_config = getattr(module, "_sharding_config", None)
        return layer


@dataclass(frozen=True)
class _Setup:
    """What the converter hands the model it wraps: the checked config, read once."""

    source: str
    plan: PrecisionPlan
    rollout: RolloutConfig | None
    seed: int
    event_log: str


class LowprecConverter(ModelConfigConverter):
    """torchtitan's ModelConfigConverter for lowprec; see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        config: str = ""
        """Path of the lowprec YAML file: a `precision:` section and an optional `rollout:` one."""

        seed: int = 0
        """Base seed of every site's stochastic-rounding generator and Hadamard signs."""

        event_log: str = ""
        """A JSONL file the rollout's events (promotions, fallbacks, retries) are appended to; "" for none."""

    def __init__(self, config: Config):
        self.config = config
        try:
            plan, rollout = load_config(config.config)
        except ConfigError as e:   # say which file the key is in
            where = e.path if e.path.startswith(("LowprecConverter.", str(config.config))) else \
                f"{e.path} (in {config.config})"
            raise type(e)(where, e.message) from None
        self.setup = _Setup(str(config.config), plan, rollout, config.seed, config.event_log)

    def convert(self, model_config: Module.Config) -> Module.Config:
        """The same model config, its model class made one that prepares itself after building."""
        if hasattr(model_config, "_lowprec"):
            raise ConfigError("converters", "name LowprecConverter twice; one rollout prepares one model. "
                              "Fix: keep one LowprecConverter.Config in the converters list")
        base = type(model_config)._owner
        if base is None:
            raise TypeError(f"{type(model_config).__name__} is not a model Config (it builds no class)")
        cls = _lowprec_model_class(base)
        values = {f.name: getattr(model_config, f.name) for f in dataclasses.fields(model_config) if f.init}
        logger.info(f"lowprec: {base.__name__} will prepare its linear layers by {self.setup.source}")
        return cls.Config(**values, _lowprec=self.setup)


def _lowprec_model_class(base: type) -> type:
    """`base` (a torchtitan model class) whose constructor runs lowprec's prepare at the end."""

    class LowprecModel(base):
        @dataclass(kw_only=True, slots=True)
        class Config(base.Config):
            _lowprec: object = None

        def __init__(self, config):
            super().__init__(config)
            lora = [n for n, m in self.named_modules() if hasattr(m, "lora_a") and hasattr(m, "lora_b")]
            if lora:
                raise ConfigError("converters", f"hold a LoRA converter (LoRA layers {lora[:3]}); lowprec "
                                  "would replace the LoRA layers, adapters and all. Fix: drop LoRAConverter "
                                  "or LowprecConverter")
            setattr(self, _ATTR, TitanRollout(config._lowprec, self))

    LowprecModel.__name__ = LowprecModel.__qualname__ = f"Lowprec{base.__name__}"
    return LowprecModel


def rollout_of(model: nn.Module) -> "TitanRollout":
    """The TitanRollout of a model built with LowprecConverter."""
    r = getattr(model, _ATTR, None)
    if r is None:
        raise ValueError(f"{type(model).__name__} was not built with LowprecConverter; add "
                         "LowprecConverter.Config(config=...) to model_registry(..., converters=[...])")
    return r


def post_optimizer_build_fn(optimizers, model_parts: list[nn.Module], parallel_dims) -> None:
    """torchtitan's post-optimizer-build function: conclude each step with lowprec's rollout."""
    if parallel_dims is not None and getattr(parallel_dims, "pp_enabled", False):
        raise _refuse("parallelism.pipeline_parallel_degree", parallel_dims.pp, "pipeline stages split the "
                      "model after it was built, and a rank's rollout would name layers it does not hold",
                      "run lowprec without pipeline parallelism (degree 1)")
    rollouts = [getattr(m, _ATTR) for m in model_parts if hasattr(m, _ATTR)]
    if not rollouts:
        raise ValueError("with_rollout's post_optimizer_build_fn found no model built with LowprecConverter; "
                         "add LowprecConverter.Config(config=...) to model_registry(..., converters=[...])")
    for r in rollouts:
        r.attach(optimizers)


def with_rollout(model_spec):
    """`model_spec` whose post_optimizer_build_fn also registers lowprec's rollout (after the
    model's own function, e.g. MoE load balancing)."""
    own = model_spec.post_optimizer_build_fn

    def build_fn(optimizers, model_parts, parallel_dims):
        if own is not None:
            own(optimizers, model_parts, parallel_dims)
        post_optimizer_build_fn(optimizers, model_parts, parallel_dims)

    return dataclasses.replace(model_spec, post_optimizer_build_fn=build_fn)


class TitanRollout:
    """The rollout of one built model: its sites, controller and monitor; decides after each
    optimizer step (`after_optimizer_step`)."""

    def __init__(self, setup: _Setup, model: nn.Module):
        self.plan, self.rollout = setup.plan, setup.rollout
        self.log = EventLog(setup.event_log) if setup.event_log else None
        self.state = prepare(model, setup.plan, seed=setup.seed, layer_cls=TitanPrecisionLinear)
        self.controller = None
        self.monitor: Monitor | None = None
        self.events: list[Event] = []
        self.step = 0                     # the training step the next after_optimizer_step concludes
        self.attached = False
        self._hook = None
        if self.rollout is None:
            self.state.collect_stats(False)   # the plan as it is: nothing reads statistics
        else:
            self.controller = build_controller(self.rollout, self.state, model)
            # the monitor's buffers live on the weights' device, which a meta model does not have
            # yet: it is built at the first forward (or the first step, whichever comes first)
            self._hook = model.register_forward_pre_hook(lambda *_: self._start())
            mc = self.rollout.monitor_config()
            self.state.collect_stats(mc.stats_every_step or mc.check_every == 1)   # is step 0 a check step?
        logger.info(f"lowprec: {len(self.state.sites)} precision sites {self._summary()}"
                    f"{'' if self.rollout is None else f', {len(self.rollout.stages)} rollout stage(s)'}")

    def attach(self, optimizers) -> None:
        """Conclude every step of `optimizers` (torchtitan's OptimizersContainer or a torch optimizer)."""
        if self.attached:
            raise RuntimeError("lowprec: the rollout is already attached to an optimizer")
        optimizers.register_step_post_hook(lambda *a, **k: self.after_optimizer_step())
        self.attached = True

    def after_optimizer_step(self) -> None:
        """Conclude one training step: keep the statistics, and on a check step let the
        controller decide; changes apply from the next step."""
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

    def _start(self) -> None:
        """Build the monitor once the weights are materialized (not on the meta device)."""
        if self.monitor is not None:
            return
        if not self.attached:
            raise RuntimeError("lowprec: the model trains but its rollout was never attached to the optimizers, "
                               "so it would never decide. Fix: config.model_spec = with_rollout(model_registry("
                               "..., converters=[LowprecConverter.Config(...)])) (lowprec.integrations.torchtitan)")
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
        """Remove the monitor's hooks (the model keeps its precision layers)."""
        if self.monitor is not None:
            self.monitor.close()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
