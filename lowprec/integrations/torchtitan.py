"""lowprec in torchtitan: a model converter that prepares the layers and a Trainer that hosts the rollout.

For torchtitan 0.3 (`torchtitan>=0.3,<0.4`). A torchtitan 0.3 job is a Python function that
returns a `Trainer.Config` (a "config registry" module, `--module my_configs --config fn`); its
model comes from a model's `model_registry(flavor, converters=[...])`, which applies the
converters to the model's *config tree* before the model is built. lowprec takes part twice:

    from torchtitan.models.llama3 import model_registry
    from torchtitan.models.llama3.config_registry import llama3_debugmodel
    from lowprec.integrations.torchtitan import LowprecConverter, lowprec_trainer

    def llama3_debugmodel_lowprec():
        config = llama3_debugmodel()
        config.model_spec = model_registry("debugmodel", converters=[LowprecConverter.Config(config="lowprec.yaml")])
        return lowprec_trainer(config)     # torchtitan.train then builds a LowprecTrainer

* `LowprecConverter(config)` reads and validates the YAML file (a `lowprec run` config
  without `model:`, `data:` and `train:`: `precision:`, `rollout:`, `eval:`, `tracking:`, `telemetry:`; a
  `ConfigError` names the key, the file, what was found and the fix) when torchtitan reads the job.
* `convert(model_config)` wraps the root model config: the model class becomes a subclass
  whose constructor builds the model as before and then runs `lowprec.prepare(model, plan)`,
  so the planned linear layers become `TitanPrecisionLinear`s (a `PrecisionLinear` that is a
  torchtitan `Module`, holding the same Parameters, their `param_init` and sharding config;
  with the `torchao` backend, its own site class with torchtitan's `Module` mixed in).
  The plan's selectors need the built modules, so the swap happens at build, on the meta
  device, before torchtitan's parallelisms; `to_empty` + `init_weights` initialize the layers.
* `LowprecConverter.Config(..., fp8_all_gather=True)` (with `backend: torch`): the built
  model's PrecisionLinear weights become `lowprec.sites.fp8_allgather` shards, on the meta
  device before torchtitan's TP and `fully_shard`, so FSDP2 gathers each FP8 site's weight as
  FP8 bytes and one scale and the other sites' (a fallen-back one's from its next step) in
  BF16; the weights' amaxes are taken in one all-reduce before each forward
  (`lowprec.runtime.engines.fsdp_fp8`).
* `lowprec_trainer(config)` makes the job's `Trainer.Config` a `LowprecTrainer.Config`:
  `LowprecTrainer` (`lowprec.integrations.torchtitan_trainer`) is torchtitan's `Trainer`
  with `lowprec.integrations.core.HostedRollout` driven from it, as the HF and Lightning
  callbacks drive it: the loss of every micro-batch (its loss function wrapped), the grad
  norm where torchtitan computes it, skips (the step withheld from the optimizers in their
  step pre-hook), replay attribution, rewinds from in-memory snapshots of each rank's shards,
  the LR probe, eval checkpoints and the gate, MLflow tracking from rank 0, and the rollout's
  state in torchtitan's checkpoints, under FSDP, HSDP, TP and pipeline parallelism. Its
  docstring says how each is done.

A model built with the converter but trained by torchtitan's plain `Trainer` stops at its
first forward with an error that says to use `lowprec_trainer` (it would otherwise train
without ever deciding).

What is not hosted, and why:

* the `te` backend (refused when the model is built): not built. Transformer Engine's layers
  need CUDA, so nothing on a CPU can build or test them; hosting them takes what the
  `torchao` sites have: a site class with torchtitan's `Module` mixed in, built on the meta
  device (TE's `device="meta"`) and initialized from torchtitan's `init_weights`, tested on a GPU;
* LoRA's converter together with lowprec's (refused when the model is built): not built;
  lowprec's swap would replace the LoRA layers, adapters and all. Hosting it takes a site that
  wraps the LoRA layer's frozen base GEMM and leaves the adapters in high precision.

No global state: each built model holds its own `Prepared` (`prepared_of(model)`): the
checked config and the PrecisionState.
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
from lowprec.integrations.torchtitan_trainer import (PREPARED_ATTR, LowprecTrainer, Prepared,  # noqa: E402
                                                     lowprec_trainer, prepared_of)
from lowprec.sites.backends import BackendName  # noqa: E402
from lowprec.sites.layers import PrecisionLinear  # noqa: E402
from lowprec.sites.precision_state import PrecisionState, prepare  # noqa: E402

__all__ = ["LowprecConverter", "LowprecTrainer", "Prepared", "TitanPrecisionLinear", "load_config",
           "lowprec_trainer", "prepared_of"]

def _refuse(path: str, found, why: str, fix: str) -> ConfigError:
    return ConfigError(path, f"is {found!r}; under torchtitan {why}. Fix: {fix}")


def load_config(path: str | Path) -> LowprecConfig:
    """The lowprec config of a torchtitan job (role FRAMEWORK), checked against what torchtitan
    allows (see the module docstring). Raises ConfigError."""
    if not str(path):
        raise ConfigError("LowprecConverter.Config.config", "is empty; name the lowprec YAML file (a "
                          "`precision:` section and optionally `rollout:`, `eval:`, `tracking:`), e.g. "
                          "LowprecConverter.Config(config=\"lowprec.yaml\")")
    cfg = _framework_config_with_probe(path)
    backend = BackendName(cfg.precision.backend)
    if backend is BackendName.TE:
        raise _refuse("precision.backend", str(backend), "lowprec does not host Transformer Engine's layers in "
                      "torchtitan yet (they need CUDA, and under torchtitan they must be its Modules, built on the "
                      "meta device and initialized by its init_weights)",
                      "use `backend: torch` (FP8 GEMMs by torch._scaled_mm), `torchao` or `emulated`")
    return cfg


def _framework_config_with_probe(path: str | Path) -> LowprecConfig:
    """The file as a framework's config, `rollout.lr_probe` and `telemetry:` included: the HF and
    Lightning hosts have no held batch and refuse the probe; LowprecTrainer takes torchtitan's
    validation data's, and times torchtitan's steps (`lowprec.integrations.torchtitan_timing`)."""
    return LowprecConfig.from_yaml(path, role=ConfigRole.FRAMEWORK, held_batch=True, timed=True)


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
class Setup:
    """What the converter hands the model it wraps: the checked config, read once."""

    source: str
    config: LowprecConfig
    seed: int
    event_log: str
    fp8_all_gather: bool = False


class LowprecConverter(ModelConfigConverter):
    """torchtitan's ModelConfigConverter for lowprec; see the module docstring."""

    @dataclass(kw_only=True, slots=True)
    class Config(ModelConfigConverter.Config):
        config: str = ""
        """Path of the lowprec YAML file: `precision:`, and optionally `rollout:`, `eval:`, `tracking:`."""

        seed: int = 0
        """Base seed of every site's stochastic-rounding generator and Hadamard signs."""

        event_log: str = ""
        """A JSONL file rank 0 appends the rollout's events (promotions, fallbacks, retries) to; "" for none."""

        fp8_all_gather: bool = False
        """FSDP2 gathers each FP8 site's weight as FP8 bytes and one scale (`backend: torch`,
        tensor-wise FP8), the other sites' and a fallen-back site's in high precision
        (lowprec.runtime.engines.fsdp_fp8); torchtitan's own float8 converter gathers in BF16."""

    def __init__(self, config: Config):
        self.config = config
        try:
            cfg = load_config(config.config)
        except ConfigError as e:   # say which file the key is in
            where = e.path if e.path.startswith(("LowprecConverter.", str(config.config))) else \
                f"{e.path} (in {config.config})"
            raise type(e)(where, e.message) from None
        if config.fp8_all_gather and BackendName(cfg.precision.backend) is not BackendName.TORCH:
            raise ConfigError("LowprecConverter.Config.fp8_all_gather", (
                f"is true with precision.backend {cfg.precision.backend!r} (in {config.config}); only the torch "
                f"backend's FP8 sites gather FP8 bytes. Fix: backend: torch, or fp8_all_gather=False"))
        self.setup = Setup(str(config.config), cfg, config.seed, config.event_log, config.fp8_all_gather)

    def convert(self, model_config: Module.Config) -> Module.Config:
        """The same model config, its model class made one that prepares itself after building."""
        if hasattr(model_config, "_lowprec"):
            raise ConfigError("converters", "name LowprecConverter twice; one rollout prepares one model. "
                              "Fix: keep one LowprecConverter.Config in the converters list")
        base = type(model_config)._owner
        if base is None:
            raise TypeError(f"{type(model_config).__name__} is not a model Config (it builds no class)")
        _check_before_build(base, model_config, self.setup)
        cls = _lowprec_model_class(base)
        values = {f.name: getattr(model_config, f.name) for f in dataclasses.fields(model_config) if f.init}
        logger.info(f"lowprec: {base.__name__} will prepare its linear layers by {self.setup.source}")
        return cls.Config(**values, _lowprec=self.setup)


def _check_before_build(base: type, model_config, setup: Setup) -> None:
    """Every lowprec setting checked against the model before torchtitan builds anything (its
    process groups, FSDP, optimizers, data loaders): the model built on the meta device (no
    memory, no weights) and prepared by the plan, then the check the HF and Lightning callbacks
    run (`lowprec.runtime.session.framework_check`: every stage selects sites whose `ladder:` has its
    format, the baseline curve, the evaluator, the gate file and the suite's tasks)."""
    import torch

    from lowprec.runtime.session.framework_check import check_framework_config
    with torch.device("meta"):
        model = base(model_config)
    try:
        state = _prepare(model, setup)
        check_framework_config(setup.config, state, model)
    except ConfigError as e:
        raise type(e)(e.path, f"{e.message} (in {setup.source})") from None


def _not_hosted(module, args) -> None:
    if getattr(module, PREPARED_ATTR).hosted is None:
        raise RuntimeError("lowprec: the model trains but no LowprecTrainer hosts its rollout, so it would never "
                           "decide. Fix: return lowprec_trainer(config) from the job's config function "
                           "(lowprec.integrations.torchtitan)")


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
            setup = config._lowprec
            state = _prepare(self, setup)
            if setup.fp8_all_gather:   # on the meta device, before torchtitan's TP and fully_shard
                from lowprec.runtime.engines.fsdp_fp8 import enable_fp8_all_gather, install
                enable_fp8_all_gather(self)
                install(self)
            from lowprec.sites.plan import ModelInfo
            setattr(self, PREPARED_ATTR, Prepared(setup, state, info=ModelInfo.of(self)))
            self._lowprec_guard = self.register_forward_pre_hook(_not_hosted)
            logger.info(f"lowprec: {len(state.sites)} precision sites {_summary(state)}")

    LowprecModel.__name__ = LowprecModel.__qualname__ = f"Lowprec{base.__name__}"
    return LowprecModel


def _prepare(model: nn.Module, setup: Setup) -> PrecisionState:
    """lowprec's prepare on a torchtitan model, every new layer a torchtitan Module that keeps the
    replaced layer's `param_init` and sharding config (the torchao backend's own site class gets
    torchtitan's Module mixed in, as torchtitan's float8 converter does with torchao's layer, and
    so do the expert sites of a `GroupedExperts`, which hold no parameter: docs/moe.md)."""
    plan = setup.config.precision
    if BackendName(plan.backend) is not BackendName.TORCHAO:
        state = prepare(model, plan, seed=setup.seed, layer_cls=TitanPrecisionLinear)
        kept = {}
    else:
        kept = {n: (getattr(m, "_param_init", None), getattr(m, "_sharding_config", None))
                for n, m in model.named_modules()}
        state = prepare(model, plan, seed=setup.seed)
    for fqn, site in state.sites.items():   # torchao's layers; expert sites (no parameter, nothing to init)
        cls = type(site.module)
        if not isinstance(site.module, Module):
            site.module.__class__ = _TITAN_CLASSES.setdefault(cls, type(f"Titan{cls.__name__}", (cls, Module), {}))
            site.module._param_init, site.module._sharding_config = kept.get(fqn, (None, None))
    return state


_TITAN_CLASSES: dict[type, type] = {}   # a backend's site class -> the same with torchtitan's Module mixed in


def _summary(state: PrecisionState) -> str:
    counts: dict[str, int] = {}
    for fmt in state.formats().values():
        counts[fmt] = counts.get(fmt, 0) + 1
    return "(" + ", ".join(f"{n} in {f}" for f, n in sorted(counts.items())) + ")"


