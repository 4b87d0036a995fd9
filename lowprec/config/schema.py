"""LowprecConfig: the whole YAML, parsed once into frozen dataclasses (docs/config.md).

    model:     {factory: "pkg.module:function", args: {...}}            # required
    data:      {factory: "pkg.module:function", args: {...}, block_size: 128}
    train:     {steps: 300, batch_size: 16, lr: 3e-3, ...}
    precision: {...}                                                    # required: lowprec.sites.plan
    rollout:   {...}                                                    # lowprec.policy.rollout
    eval:      {evaluator: lm_eval, suite: default, every: 100, ...}
    tracking:  {uri: null, experiment: lowprec, run_name: null, enabled: true}
    telemetry: {enabled: true, energy: auto, grid_g_per_kwh: null, mfu: true}  # lowprec.tracking.telemetry
    parallel:  {dp_replicate: 1, dp_shard: 2, tp: 2, pp: 1, peer_timeout_s: 120}  # under torchrun

Everything that can be checked without importing the user's code is checked here, at load,
by `lowprec.base.parse` (one unknown-key check with did-you-mean, types from the
annotations, the path of every error). Factories are only checked for their shape
(`package.module:function`): importing and calling them happens when the run is built.
`eval.gates` is the name of a gate file that ships with the evaluator's gate package
(`inloop`, `default`: a word with no `/` and no `.`, kept as it is and found by the gate
checker through its package) or a path, looked up relative to the config file's folder, then
the current folder, and kept as an absolute path; `eval.data_dir` likewise. The same class serves `lowprec run` (ConfigRole.RUN) and the
framework integrations (ConfigRole.FRAMEWORK: no `model:`, `data:`, `train:`); nothing else
in lowprec reads a YAML file or a config dict.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from lowprec.base.parse import ConfigError, check_keys, found, parse, shown, to_data
from lowprec.base.yaml_read import read_yaml_file
from lowprec.base.enums import StrEnum
from lowprec.sites.plan import PrecisionPlan
from lowprec.policy.rollout import RolloutConfig, parse_rollout
from lowprec.tracking.telemetry import TelemetryConfig

__all__ = ["ConfigError", "ModelConfig", "DataConfig", "TrainConfig", "EvalConfig", "TrackingConfig",
           "TelemetryConfig", "ParallelConfig", "RunDevice", "LowprecConfig", "ConfigRole", "SECTIONS",
           "FRAMEWORK_SECTIONS"]

SECTIONS = ("model", "data", "train", "precision", "rollout", "eval", "tracking", "telemetry", "parallel")
FRAMEWORK_SECTIONS = ("precision", "rollout", "eval", "tracking")   # what a framework's trainer leaves to lowprec
_FRAMEWORK_OWNS = ("model", "data", "train")
_FACTORY = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*")
_ENTRY_POINT = re.compile(r"[A-Za-z_][\w.-]*")


def _check_factory(value: str, key: str) -> None:
    if not _FACTORY.fullmatch(value):
        raise ConfigError(key, f"expected \"package.module:function\" (e.g. experiments.model:build_gpt), "
                               f"found {found(value)}; name a function in your own module")


_MAX_STEPS = 10 ** 9    # a billion optimizer steps: far past any training run; a larger count is a typo


def _at_least(obj: Any, key: str, low: int | float, what: str = "", high: int | None = None) -> None:
    v = getattr(obj, key)
    if v < low:
        raise ConfigError(key, f"expected {what or 'a number'} >= {low}, found {v}")
    if high is not None and v > high:
        raise ConfigError(key, f"expected {what or 'a number'} <= {high:,}, found {shown(v)}; no run is that long "
                               f"(is a digit too many?)")


@dataclass(frozen=True)
class ModelConfig:
    """`model:` the function that builds the nn.Module, and its keyword arguments."""
    factory: str
    args: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_factory(self.factory, "factory")


@dataclass(frozen=True)
class DataConfig:
    """`data:` the function that gives the training tokens (or batches), its arguments, the window."""
    factory: str
    args: dict[str, Any] = field(default_factory=dict)
    block_size: int | None = None

    def __post_init__(self) -> None:
        _check_factory(self.factory, "factory")
        if self.block_size is not None:
            _at_least(self, "block_size", 1, "a number of tokens")


@dataclass(frozen=True)
class TrainConfig:
    """`train:` steps, batches, the optimizer (AdamW, linear learning-rate warmup), checkpoints, logging."""
    steps: int = 300
    batch_size: int = 16
    lr: float = 3e-3
    weight_decay: float = 0.1
    warmup: int = 20
    grad_clip: float | None = 1.0
    seed: int = 0
    ckpt_every: int = 50
    ckpt_keep: int = 5
    log_every: int = 10
    microbatches: int = 1

    def __post_init__(self) -> None:
        for key in ("steps", "batch_size", "warmup", "ckpt_every", "ckpt_keep", "log_every", "microbatches"):
            _at_least(self, key, 1, "an integer", _MAX_STEPS)
        if self.batch_size % self.microbatches:
            raise ConfigError("microbatches", f"{self.microbatches} does not divide batch_size "
                                              f"{self.batch_size}; pick a divisor of batch_size")
        if not self.lr > 0:
            raise ConfigError("lr", f"expected a learning rate > 0, found {self.lr}")
        if not self.weight_decay >= 0:
            raise ConfigError("weight_decay", f"expected a number >= 0, found {self.weight_decay}")
        if self.grad_clip is not None and not self.grad_clip > 0:
            raise ConfigError("grad_clip", f"expected a norm > 0 or null (no clipping), found {self.grad_clip}")


@dataclass(frozen=True)
class EvalConfig:
    """`eval:` evaluation checkpoints (every N steps, before each promotion, at the end) and the in-loop gate."""
    evaluator: str = "lm_eval"
    suite: str = "default"
    every: int = 100
    mode: Literal["fast", "full"] = "fast"
    final_mode: Literal["fast", "full"] = "full"
    high_precision: bool = True
    gates: str | None = "inloop"
    batch_size: int = 32
    data_dir: str | None = None
    limit: int | None = None

    def __post_init__(self) -> None:
        if not _ENTRY_POINT.fullmatch(self.evaluator):
            raise ConfigError("evaluator", f"expected the name of an evaluator (an entry point in the group "
                                           f"lowprec.evaluators, e.g. lm_eval), found {found(self.evaluator)}")
        if not self.suite:
            raise ConfigError("suite", "expected a suite name (e.g. default), found an empty string")
        _at_least(self, "every", 0, "a step count (0: no periodic evals)", _MAX_STEPS)
        _at_least(self, "batch_size", 1, "an integer", _MAX_STEPS)
        if self.limit is not None:
            _at_least(self, "limit", 1, "a number of documents per task (or null: every eval's own set)", _MAX_STEPS)
        if self.gates is not None and not self.gates:
            raise ConfigError("gates", "expected the name of a shipped gate file (inloop, default), a gate file path "
                                       "or null (no in-loop gate), found an empty string")
        if self.data_dir is not None and not self.data_dir:
            raise ConfigError("data_dir", "expected the path of a folder or null, found an empty string")


@dataclass(frozen=True)
class TrackingConfig:
    """`tracking:` where the run is recorded (MLflow). `report`: the report pictures
    (`lowprec.tracking.report`) are drawn and logged at the run's end; False: none (they cost about a
    second of CPU a run; `lowprec report RUN` draws them from the store at any time)."""
    uri: str | None = None
    experiment: str = "lowprec"
    run_name: str | None = None
    enabled: bool = True
    report: bool = True

    def __post_init__(self) -> None:
        if not self.experiment.strip():
            raise ConfigError("experiment", "expected an experiment name, found an empty string")
        if self.uri is not None and not self.uri.strip():
            raise ConfigError("uri", "expected a tracking URI or null (sqlite:///<cwd>/mlflow.db), found ''")


class RunDevice(StrEnum):
    """`parallel.device`: where the ranks of a `lowprec run` under torchrun train."""
    AUTO = "auto"    # cuda where torch finds a CUDA device, else cpu
    CUDA = "cuda"    # NCCL, each rank on cuda:LOCAL_RANK
    CPU = "cpu"      # gloo


@dataclass(frozen=True)
class ParallelConfig:
    """`parallel:` how many processes `lowprec run` trains on and how the model is split over
    them (docs/parallel.md): data parallel, replicated (`dp_replicate`: each rank a whole copy,
    gradients all-reduced) or fully sharded (`dp_shard`: FSDP2), tensor parallel (`tp`) and
    pipeline stages (`pp`). The product of the degrees is the number of processes torchrun
    starts. `peer_timeout_s`: how long a rank waits at start for the others before it says so
    and exits. `fp8_all_gather`: FSDP2 (dp_shard > 1; alone, x TP or HSDP) all-gathers each FP8
    site's weight as its FP8 bytes and scale instead of BF16 (docs/distributed.md). `device`:
    where each rank trains (`lowprec.runtime.engines.rank_device`): `cuda` (NCCL, `cuda:LOCAL_RANK`),
    `cpu` (gloo), `auto` (cuda where torch finds a CUDA device, else cpu)."""
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    pp: int = 1
    peer_timeout_s: float = 120.0
    fp8_all_gather: bool = False
    device: RunDevice = RunDevice.AUTO

    def __post_init__(self) -> None:
        for key in ("dp_replicate", "dp_shard", "tp", "pp"):
            _at_least(self, key, 1, "a number of ranks", 1 << 20)
        if not self.peer_timeout_s > 0:
            raise ConfigError("peer_timeout_s", f"expected seconds > 0, found {self.peer_timeout_s}")
        if self.pp > 1 and self.dp_replicate * self.dp_shard * self.tp > 1:
            raise ConfigError("pp", (
                f"{self.pp} pipeline stages with dp_replicate {self.dp_replicate}, dp_shard {self.dp_shard}, "
                f"tp {self.tp}: pipeline stages run alone here; set the other degrees to 1, or pp: 1"))
        if self.fp8_all_gather and self.dp_replicate > 1 and self.dp_shard > 1 and self.tp > 1:
            raise ConfigError("fp8_all_gather", (
                f"true with dp_replicate {self.dp_replicate}, dp_shard {self.dp_shard} and tp {self.tp}: the FP8 "
                f"all-gather runs under FSDP2, FSDP2 x TP and HSDP, not yet on the 3-D mesh of HSDP x TP. Set "
                f"fp8_all_gather: false, or drop one of the three degrees"))
        if self.fp8_all_gather and self.dp_shard == 1:
            raise ConfigError("fp8_all_gather", (
                "true with dp_shard 1: only FSDP2 all-gathers weights (dp_shard > 1, alone, with tp or with "
                "dp_replicate); replicated data parallel and tp alone gather none. Set dp_shard > 1, or "
                "fp8_all_gather: false"))

    @property
    def world(self) -> int:
        """The number of processes: the product of the degrees."""
        return self.dp_replicate * self.dp_shard * self.tp * self.pp

    @property
    def data_ranks(self) -> int:
        """Ranks that each read their own rows of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def mode(self) -> str:
        """The layout in a word: `dp_shard2xtp2`, `pp2`, `single`."""
        parts = [f"{k}{v}" for k, v in (("dp_replicate", self.dp_replicate), ("dp_shard", self.dp_shard),
                                         ("tp", self.tp), ("pp", self.pp)) if v > 1]
        return "x".join(parts) or "single"


def _check_parallel(cfg: "LowprecConfig") -> None:
    """What `parallel:` asks of the other sections: each rank's share of a batch."""
    par, tc = cfg.parallel, cfg.train
    if par.world == 1:
        return
    if tc.batch_size % (tc.microbatches * par.data_ranks):
        raise ConfigError("train.batch_size", (
            f"{tc.batch_size} does not split into {par.data_ranks} data-parallel ranks x {tc.microbatches} "
            f"microbatches (parallel: dp_replicate {par.dp_replicate} x dp_shard {par.dp_shard}); make batch_size "
            f"a multiple of {tc.microbatches * par.data_ranks}"))


# the name of a gate file shipped with the gate package: no folder, no suffix (anything else is a path)
_GATE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def _resolve_path(value: str, base: Path | None, is_kind) -> tuple[Path | None, list[Path]]:
    """(`value` made absolute, or None where it is not there; the places looked at): relative to
    the config's folder, then the current folder."""
    p = Path(value).expanduser()
    looked = [p] if p.is_absolute() else [*([base / p] if base is not None else []), Path.cwd() / p]
    def there(c: Path) -> bool:
        try:
            return is_kind(c)
        except OSError:   # a name too long for the file system: not there
            return False
    return next((c.resolve() for c in looked if there(c)), None), looked


def _resolve_paths(ev: EvalConfig, base: Path | None) -> EvalConfig:
    """`ev` with `gates` (unless it names a shipped gate file) and `data_dir` as absolute paths."""
    if ev.gates is not None and not _GATE_NAME.fullmatch(ev.gates):
        at, looked = _resolve_path(ev.gates, base, Path.is_file)
        if at is None:
            raise ConfigError("eval.gates", (
                f"gate file {ev.gates!r} not found (looked at {', '.join(map(str, looked))}); give the name of a "
                f"gate file that ships with lowprec (inloop, default; see docs/gates.md), a gate file path, or "
                f"null for no in-loop gate"))
        ev = replace(ev, gates=str(at))
    if ev.data_dir is not None:
        at, looked = _resolve_path(ev.data_dir, base, Path.is_dir)
        if at is None:
            raise ConfigError("eval.data_dir", (
                f"folder {ev.data_dir!r} not found (looked at {', '.join(map(str, looked))}); give the folder that "
                f"holds the opt-in eval data (docs/config.md, \"Suites and eval data\"), or leave data_dir out"))
        ev = replace(ev, data_dir=str(at))
    return ev


class ConfigRole(StrEnum):
    """What a config file is for, which decides the sections it must and may have.

    RUN: `lowprec run` / `plan` / `profile`: `model:` and `precision:` required, every
    section allowed. FRAMEWORK: a framework's trainer owns the model, the data and the
    training settings (the HF Trainer, Lightning): `precision:` required, `rollout:`,
    `eval:`, `tracking:` allowed, `model:`/`data:`/`train:` refused. SESSION: a `Session` in a
    hand-written loop, or torchtitan's model converter: `precision:` and `rollout:` only."""

    RUN = "run"
    FRAMEWORK = "framework"
    SESSION = "session"

    @property
    def sections(self) -> tuple[str, ...]:
        return {ConfigRole.RUN: SECTIONS, ConfigRole.FRAMEWORK: FRAMEWORK_SECTIONS,
                ConfigRole.SESSION: ("precision", "rollout")}[self]


@dataclass(frozen=True)
class LowprecConfig:
    """The whole config, typed; `from_yaml` / `from_dict` check everything they can before
    anything runs. `lowprec run` and the framework integrations parse through this one class
    (`role` says which sections a file must and may have)."""
    precision: PrecisionPlan
    model: ModelConfig | None = None          # required for ConfigRole.RUN
    data: DataConfig | None = None
    train: TrainConfig = field(default_factory=TrainConfig)
    rollout: RolloutConfig | None = None   # None: no rollout: the plan's formats for the whole run
    eval: EvalConfig | None = None      # None: no evaluation checkpoints
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    telemetry: TelemetryConfig = field(default_factory=TelemetryConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    source: str = field(default="<dict>", compare=False)   # the file it came from
    role: ConfigRole = field(default=ConfigRole.RUN, compare=False)

    def __post_init__(self) -> None:
        _check_parallel(self)

    @classmethod
    def from_yaml(cls, path: str | Path, role: ConfigRole = ConfigRole.RUN, *,
                  held_batch: bool = False, timed: bool = False) -> "LowprecConfig":
        """Load a config file; every problem is a ConfigError naming the file or the key."""
        p = Path(path)
        doc = read_yaml_file(p, f"a mapping with sections {', '.join(role.sections)}")
        return cls.from_dict(doc, source=str(p), role=role, held_batch=held_batch, timed=timed)

    @classmethod
    def from_dict(cls, d: Any, source: str = "<dict>", role: ConfigRole = ConfigRole.RUN, *,
                  held_batch: bool = False, timed: bool = False) -> "LowprecConfig":
        """Parse a config's contents; `source` is the file (its folder is where `eval.gates` and `eval.data_dir` are looked up).
        held_batch: the framework's host gives the LR probe a held batch (torchtitan's validation data);
        timed: the framework's host times its steps (torchtitan's): a `telemetry:` section is allowed."""
        role = ConfigRole(role)
        if not isinstance(d, dict):
            raise ConfigError(source, f"expected a mapping with sections {', '.join(role.sections)}, found {found(d)}")
        if role is not ConfigRole.RUN:
            _refuse_framework_sections(d, source, role)
        check_keys(d, [*role.sections, *(("telemetry",) if timed and role is ConfigRole.FRAMEWORK else ())], "")
        for key in ("model", "precision") if role is ConfigRole.RUN else ("precision",):
            if d.get(key) is None:
                raise ConfigError(key, _missing(key, d, source, role))
        base = Path(source).resolve().parent if source != "<dict>" and Path(source).is_file() else None
        ev = parse(EvalConfig, d["eval"], "eval") if d.get("eval") is not None else None
        rollout = parse_rollout(d["rollout"], "rollout") if d.get("rollout") is not None else None
        if role is ConfigRole.FRAMEWORK and not held_batch and rollout is not None and rollout.lr_probe.enabled:
            raise ConfigError("rollout.lr_probe.enabled", (
                "is true; the learning-rate probe needs a batch that training never draws, which a framework's "
                "data loader does not give lowprec: set lr_probe.enabled: false under a framework's trainer "
                "(use lowprec's Session or `lowprec run` for the probe)"))
        return cls(model=parse(ModelConfig, d["model"], "model") if d.get("model") is not None else None,
                   precision=PrecisionPlan.from_dict(d["precision"], "precision"),
                   data=parse(DataConfig, d["data"], "data") if d.get("data") is not None else None,
                   train=parse(TrainConfig, d["train"], "train") if d.get("train") is not None else TrainConfig(),
                   rollout=rollout,
                   eval=_resolve_paths(ev, base) if ev is not None else None,
                   tracking=(parse(TrackingConfig, d["tracking"], "tracking") if d.get("tracking") is not None
                             else TrackingConfig()),
                   telemetry=(parse(TelemetryConfig, d["telemetry"], "telemetry") if d.get("telemetry") is not None
                              else TelemetryConfig()),
                   parallel=(parse(ParallelConfig, d["parallel"], "parallel") if d.get("parallel") is not None
                             else ParallelConfig()),
                   source=source, role=role)

    def to_dict(self) -> dict[str, Any]:
        """Plain data (for logging the config): `LowprecConfig.from_dict(c.to_dict(), role=c.role) == c`.
        Absent sections, and sections the role does not have, are left out."""
        return {k: to_data(v) for k in self.role.sections if (v := getattr(self, k)) is not None}


def _refuse_framework_sections(d: dict, source: str, role: ConfigRole) -> None:
    if role is ConfigRole.SESSION:
        unknown = sorted(set(d) - set(role.sections))
        if unknown:
            raise ConfigError(source, f"has section(s) {unknown}; a Session (and torchtitan's converter) reads "
                              "`precision:` and `rollout:` only (model, data and training are your loop's): "
                              "remove them")
        return
    owned = [k for k in _FRAMEWORK_OWNS if k in d]
    if owned:
        raise ConfigError(owned[0], (
            f"{source} has a `{owned[0]}:` section; under a framework's trainer the model, the data and the "
            f"training settings are the framework's: keep only {', '.join(FRAMEWORK_SECTIONS)} in this file "
            f"(`lowprec run` configs hold the others)"))


def _missing(key: str, d: dict, source: str, role: ConfigRole) -> str:
    if role is ConfigRole.SESSION:
        return (f"{source} has no `precision:` section; a Session (and torchtitan's converter) needs one "
                f"(and optionally `rollout:`), see docs/config.md")
    if role is ConfigRole.FRAMEWORK:
        return (f"{source} has no `precision:` section; the integrations need one "
                f"(and optionally rollout:, eval:, tracking:), see docs/config.md")
    return f"the config needs a `{key}:` section; it has {', '.join(map(str, d)) or 'none'}. See docs/config.md"
