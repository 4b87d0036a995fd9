"""The `rollout:` section of a config as typed objects, and the few lines a training loop needs.

    rollout:
      check_every: 10            # read signals on the host every N steps
      stats_every_step: false    # quantizer statistics on check steps only
      min_steps: 100             # stable steps before the next stage
      cooldown_steps: 200        # before a fallen-back site retries
      quarantine_after: 2        # failures before a site stays where it is
      rewind: {enabled: true, skip_batches: 20, source: memory, snapshot_every: 20, keep: 2}
      attribution: {replay: true, max_replays: 8, persist_steps: 2, accept_after: 8,   # anomalous steps
                    window: true, window_close: 0.3, window_replays: 3, not_precision: restore}   # slow signals
      thresholds: {max_saturated_frac: 1.0e-3, site_patience: 2, loss_gap: 0.03}
      lr_probe: {enabled: true, every_checks: 5, factors: [2.0, 0.5], hold_above: 0.0, hold_rise: 0.04}
      baseline: {losses: runs/bf16/losses.json}      # or {mlflow_run: RUN}; loss_gap needs it
      stages:
        - {name: mlp_fp8,  select: {glob: "blocks.*.mlp.*"},  format: fp8_tensorwise}
        - {name: attn_fp8, select: {glob: "blocks.*.attn.*"}, format: fp8_tensorwise}

`parse_rollout(d)` gives a `RolloutConfig` (frozen dataclasses, parsed by
`lowprec.base.parse.parse`: every problem a ConfigError with its path, e.g.
`rollout.stages[1].format`). `RolloutConfig.controller_config()` and `.monitor_config()`
are what the controller and the monitor take; `build_controller` resolves the stages'
selectors (the plan's typed selectors) against the prepared model.

What a training loop holds is `lowprec.runtime.Session` (monitor, controller, snapshots).
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from lowprec.base.parse import ConfigError, check_keys, parse
from lowprec.policy.controller import ControllerConfig, RolloutController, Stage
from lowprec.policy.detectors import Thresholds
from lowprec.numerics.formats import format_names, get_format
from lowprec.policy.monitor import MonitorConfig
from lowprec.sites.plan import ModelInfo, PlanError, Selector, selection_from_dict

__all__ = ["RewindConfig", "AttributionConfig", "LRProbeConfig", "BaselineConfig", "StageConfig", "RolloutConfig",
           "parse_rollout", "read_losses", "build_controller"]


@dataclass(frozen=True)
class RewindConfig:
    """Whether and how an instability goes back to the last good state."""

    enabled: bool = False
    skip_batches: int = 0                          # batches skipped after a rewind
    source: Literal["memory", "disk"] = "memory"   # in-memory snapshots, or the checkpoints
    snapshot_every: int = 20                       # steps between in-memory snapshots
    keep: int = 2                                  # in-memory snapshots kept

    def __post_init__(self) -> None:
        for name, lo in (("skip_batches", 0), ("snapshot_every", 1), ("keep", 1)):
            if not lo <= getattr(self, name) <= 10 ** 9:   # a billion steps: past any run, a typo
                raise ConfigError(name, f"must be >= {lo} and <= 1,000,000,000 (steps), got {getattr(self, name)}")


@dataclass(frozen=True)
class AttributionConfig:
    """What happens at an anomalous step (NaN/Inf, a loss or grad-norm spike): replays that
    find whether precision is to blame (`lowprec.policy.attribution`), and when a fault that is not
    precision's rewinds."""

    replay: bool = True          # replay anomalous steps (needs the loop's closure)
    max_replays: int = 8         # replays per anomalous step, at most
    persist_steps: int = 2       # anomalous this many steps in a row (not precision's), the loss off: rewind
    accept_after: int = 8        # ... this many, no rewind: a new level, accepted (fewer: a burst, skipped)
    # slow signals (the loss gap, an eval checkpoint's regression): the window since the last snapshot
    window: bool = True          # judge them by the window's losses with sites in high precision
    window_close: float = 0.3    # fraction of the window's loss gap high precision must close, also beyond the control
    window_replays: int = 3      # windows trained again per suspicion, at most
    not_precision: Literal["restore", "rewind"] = "restore"   # the state after a gap precision did not cause

    def __post_init__(self) -> None:
        for name in ("max_replays", "persist_steps", "window_replays"):
            if getattr(self, name) < 1:
                raise ConfigError(name, f"must be >= 1, got {getattr(self, name)} (replay: false turns replays off)")
        if self.accept_after < 2:
            raise ConfigError("accept_after", f"must be >= 2 (anomalous steps in a row before their level is "
                                              f"accepted; fewer are a burst, each step skipped), got "
                                              f"{self.accept_after!r}")
        if not (isinstance(self.window_close, (int, float)) and 0 < self.window_close <= 1):
            raise ConfigError("window_close", f"must be a fraction in (0, 1] of the window's loss gap that a replay "
                                              f"in high precision must close to blame precision (e.g. 0.5), "
                                              f"got {self.window_close!r}")


@dataclass(frozen=True)
class LRProbeConfig:
    """The learning-rate sensitivity probe (`lowprec.runtime.session.lrprobe`): every `every_checks`
    checks, the held batch's loss after a virtual step at each lr factor; a sensitivity
    above `hold_above`, or risen by more than `hold_rise` above the median of the probes
    before, holds the next promotion (`lowprec.policy.controller.lr_hold_level`)."""

    enabled: bool = False
    every_checks: int = 5                        # probe at every this-many-th check
    factors: tuple[float, ...] = (2.0, 0.5)      # lr multipliers: one above 1, one below
    hold_above: float | None = 0.0               # (L_up - L_down) / |L0| above this holds a promotion
    hold_rise: float | None = 0.04               # so does a rise by more than this (above the recent median)

    def __post_init__(self) -> None:
        if self.every_checks < 1:
            raise ConfigError("every_checks", f"must be >= 1, got {self.every_checks}")
        f = self.factors
        if len(f) < 2 or len(set(f)) != len(f) or min(f) <= 0 or not min(f) < 1 < max(f):
            raise ConfigError("factors", f"must be distinct positive lr multipliers, one above 1 and one below, "
                                         f"e.g. [2.0, 0.5]; got {list(f)}")
        if self.hold_rise is not None and not (math.isfinite(self.hold_rise) and self.hold_rise >= 0):
            raise ConfigError("hold_rise", f"must be a finite number >= 0 (or null: off), got {self.hold_rise}")
        if self.hold_above is not None and not math.isfinite(self.hold_above):
            raise ConfigError("hold_above", f"must be a finite number (or null: off), got {self.hold_above}")


@dataclass(frozen=True)
class BaselineConfig:
    """The loss curve `thresholds.loss_gap` compares with: exactly one of a JSON file of
    losses by step, or an MLflow run (id or unique name) whose `train/loss` is the curve."""

    losses: str | None = None
    mlflow_run: str | None = None

    def __post_init__(self) -> None:
        given = [k for k in ("losses", "mlflow_run") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError(f"name exactly one baseline, {{losses: FILE}} or {{mlflow_run: RUN}}; "
                             f"found {' and '.join(given) if given else 'neither'}")
        for k in given:
            if not getattr(self, k).strip():
                raise ConfigError(k, "is empty; name a losses file or an MLflow run")


@dataclass(frozen=True)
class StageConfig:
    """Sites promoted together: those `select` matches, to `format`."""

    name: str
    select: dict[str, Any]
    format: str

    def __post_init__(self) -> None:
        if not self.name.strip():
            raise ConfigError("name", "is empty; name the stage (it appears in events and pictures)")
        selection_from_dict(self.select, "select")
        try:
            fmt = get_format(self.format)
        except ValueError as e:
            raise ConfigError("format", str(e)) from None
        object.__setattr__(self, "format", fmt.name)

    @property
    def selector(self) -> Selector:
        return selection_from_dict(self.select, "select")


@dataclass(frozen=True, kw_only=True)
class RolloutConfig:
    """The `rollout:` section (see the module docstring; docs/config.md lists every key)."""

    check_every: int = 10
    stats_every_step: bool = False
    min_steps: int = 100
    cooldown_steps: int = 200
    quarantine_after: int = 2
    rewind: RewindConfig = dataclasses.field(default_factory=RewindConfig)
    attribution: AttributionConfig = dataclasses.field(default_factory=AttributionConfig)
    thresholds: Thresholds = dataclasses.field(default_factory=Thresholds)
    lr_probe: LRProbeConfig = dataclasses.field(default_factory=LRProbeConfig)
    baseline: BaselineConfig | None = None
    stages: tuple[StageConfig, ...]

    def __post_init__(self) -> None:
        for name, lo in (("check_every", 1), ("min_steps", 0), ("cooldown_steps", 0), ("quarantine_after", 1)):
            if not lo <= getattr(self, name) <= 10 ** 9:   # a billion steps: past any run, a typo
                raise ConfigError(name, f"must be >= {lo} and <= 1,000,000,000 (steps), got {getattr(self, name)}")
        if not self.stages:
            raise ConfigError("stages", f"a rollout needs at least one stage, e.g. {{name: mlp_fp8, select: "
                                        f"{{glob: \"blocks.*.mlp.*\"}}, format: fp8_tensorwise}}; "
                                        f"formats: {', '.join(format_names())}")
        rw, back = self.rewind, 2 * self.check_every   # a rewind goes two checks back
        if rw.enabled and rw.source == "memory" and rw.snapshot_every * (rw.keep - 1) < back:
            raise ConfigError("rewind.keep", (
                f"{rw.keep} snapshots every {rw.snapshot_every} steps never reach {back} steps back (two checks "
                f"of check_every {self.check_every}, where a rewind goes); keep at least "
                f"{-(-back // rw.snapshot_every) + 1}, or set rewind.snapshot_every lower"))
        seen: set[str] = set()
        for i, st in enumerate(self.stages):
            if st.name in seen:
                raise ConfigError(f"stages[{i}].name", f"stage name {st.name!r} is used twice; name each stage once")
            seen.add(st.name)
        if self.thresholds.loss_gap is not None and self.baseline is None:
            raise ConfigError("thresholds.loss_gap", (
                f"is {self.thresholds.loss_gap}, but there is no baseline loss curve to compare with: name it "
                "in rollout.baseline ({losses: FILE} or {mlflow_run: RUN}) or remove loss_gap"))

    def controller_config(self) -> ControllerConfig:
        return ControllerConfig(min_steps=self.min_steps, cooldown_steps=self.cooldown_steps,
                                quarantine_after=self.quarantine_after, rewind=self.rewind.enabled,
                                rewind_skip_batches=self.rewind.skip_batches,
                                persist_steps=self.attribution.persist_steps,
                                accept_after=self.attribution.accept_after, thresholds=self.thresholds,
                                not_precision_rewind=self.attribution.not_precision == "rewind",
                                lr_hold_rise=self.lr_probe.hold_rise if self.lr_probe.enabled else None,
                                lr_hold_above=self.lr_probe.hold_above if self.lr_probe.enabled else None)

    def monitor_config(self) -> MonitorConfig:
        return MonitorConfig(check_every=self.check_every, stats_every_step=self.stats_every_step)


def parse_rollout(d: Any, path: str = "rollout") -> RolloutConfig:
    """The `rollout:` mapping as a RolloutConfig; a ConfigError naming the path if it cannot be.

    Besides the generic rules (`lowprec.base.parse.parse`): `rewind: true` / `false` and
    `lr_probe: true` / `false` mean `{enabled: true}` / `{enabled: false}`, an empty `rewind:`,
    `thresholds:` or `lr_probe:` means the defaults, and a stage without a name is called
    `stage<i>` after its position."""
    if isinstance(d, RolloutConfig):
        return d
    data = dict(check_keys(d, [f.name for f in dataclasses.fields(RolloutConfig)], path))
    for key in ("rewind", "attribution", "thresholds", "lr_probe"):
        if key in data and data[key] is None:
            del data[key]
    for key in ("rewind", "lr_probe"):
        if isinstance(data.get(key), bool):
            data[key] = {"enabled": data[key]}
    if isinstance(data.get("stages"), (list, tuple)):
        data["stages"] = [{"name": f"stage{i}", **s} if isinstance(s, Mapping) and "name" not in s else s
                          for i, s in enumerate(data["stages"])]
    return parse(RolloutConfig, data, path)


def read_losses(path: str | Path, where: str = "rollout.baseline.losses") -> dict[int, float]:
    """A baseline loss curve {step: loss} from a JSON file: a list (index = step, as a
    training run's losses.json) or a mapping {step: loss}. Non-finite losses are left out."""
    p = Path(path)
    try:
        raw = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(where, f"no such file {str(p)!r} (from {Path.cwd()}); train the baseline first "
                                 "or point at its losses file") from None
    except (OSError, ValueError) as e:
        raise ConfigError(where, f"cannot read {str(p)!r} as JSON: {e}") from None
    items = enumerate(raw) if isinstance(raw, list) else raw.items() if isinstance(raw, dict) else None
    try:
        curve = {int(k): float(v) for k, v in items}
    except (TypeError, ValueError):
        curve = None
    if curve is None:
        raise ConfigError(where, f"{str(p)!r} holds neither a list of losses nor a mapping {{step: loss}}")
    curve = {k: v for k, v in curve.items() if math.isfinite(v)}
    if not curve:
        raise ConfigError(where, f"{str(p)!r} holds no finite loss")
    return curve


def build_controller(rollout: RolloutConfig, state, model: torch.nn.Module | ModelInfo, *,
                     baseline: dict[int, float] | None = None) -> RolloutController:
    """The controller over `state`'s sites (every site of the model, in forward order):
    the stages' selectors resolved against the prepared model (or its `ModelInfo`, taken
    before the model was split into pipeline stages). `baseline` ({step: loss})
    is the loss-gap curve; without it, a `baseline: {losses: FILE}` is read here, and a
    `baseline: {mlflow_run: RUN}` must be resolved by the caller and passed as `baseline`."""
    info = model if isinstance(model, ModelInfo) else ModelInfo.of(model)
    stages = []
    for i, st in enumerate(rollout.stages):
        sel = st.selector
        sites = tuple(f for f, s in state.sites.items() if sel.matches(f, s.module, info))
        if not sites:
            raise PlanError(f"rollout.stages[{i}].select", f"stage {st.name!r} ({sel.describe()}) selects no "
                            f"precision site; sites: {', '.join(list(state.sites)[:6])} ...")
        stages.append(Stage(st.name, sites, st.format))
    if baseline is None and rollout.thresholds.loss_gap is not None:
        if rollout.baseline is None or rollout.baseline.losses is None:
            raise ConfigError("rollout.baseline", (
                "thresholds.loss_gap needs the baseline's loss curve: a run named by mlflow_run is read by the "
                "caller (pass baseline={step: loss} to build_controller); or name a losses file"))
        baseline = read_losses(rollout.baseline.losses)
    ladders = {f: tuple(x.name for x in s.ladder) for f, s in state.sites.items()}
    return RolloutController(ladders, state.formats(), stages, rollout.controller_config(), baseline=baseline)
