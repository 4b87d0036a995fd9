"""The rollout section as typed objects (RolloutConfig), build_controller and the session's NaN guard."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn

import lowprec
from lowprec.base.parse import ConfigError, to_data
from lowprec.policy.controller import Action, ControllerConfig
from lowprec.policy.detectors import Thresholds
from lowprec.policy.events import EventKind
from lowprec.policy.monitor import MonitorConfig
from lowprec.sites.plan import PrecisionPlan
from lowprec.policy.rollout import (BaselineConfig, RewindConfig, RolloutConfig, StageConfig,
                             build_controller, parse_rollout, read_losses)

STAGES = [{"name": "mlp_fp8", "select": {"glob": "blocks.*.mlp.*"}, "format": "fp8_tensorwise"}]


def section(**kw) -> dict:
    return {"check_every": 5, "min_steps": 10, "stages": STAGES, **kw}


def error(d) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        parse_rollout(d)
    assert str(e.value).startswith(f"{e.value.path}: ")
    return e.value


def test_the_section_parses_into_frozen_dataclasses_and_round_trips():
    r = parse_rollout(section(rewind={"enabled": True, "skip_batches": 20, "source": "disk"},
                              thresholds={"spike_sigmas": "5e0", "loss_gap": 0.03},
                              baseline={"losses": "runs/bf16/losses.json"}))
    assert r.rewind == RewindConfig(enabled=True, skip_batches=20, source="disk", snapshot_every=20, keep=2)
    assert r.thresholds == Thresholds(spike_sigmas=5.0, loss_gap=0.03)
    assert r.baseline == BaselineConfig(losses="runs/bf16/losses.json")
    assert r.stages == (StageConfig("mlp_fp8", {"glob": "blocks.*.mlp.*"}, "fp8_tensorwise"),)
    assert r.controller_config() == ControllerConfig(min_steps=10, rewind=True, rewind_skip_batches=20,
                                                     thresholds=r.thresholds)
    assert r.monitor_config() == MonitorConfig(check_every=5)
    assert isinstance(r, RolloutConfig) and parse_rollout(to_data(r)) == r and parse_rollout(r) is r
    with pytest.raises(AttributeError):
        r.check_every = 1   # frozen


def test_shorthands_rewind_true_empty_subsections_and_stage_names():
    r = parse_rollout(section(rewind=True, thresholds=None,
                              stages=[{"select": {"glob": "blocks.*"}, "format": "bf16"}] + STAGES))
    assert r.rewind == RewindConfig(enabled=True) and r.thresholds == Thresholds()
    assert [s.name for s in r.stages] == ["stage0", "mlp_fp8"]
    assert parse_rollout(section(rewind=False)).rewind.enabled is False
    assert r.thresholds.loss_gap is None   # the loss gap is off unless asked for


@pytest.mark.parametrize("changes,path,words", [
    ({"thresholds": {"loss_gap": 0.03}}, "rollout.thresholds.loss_gap", "name it in rollout.baseline"),
    ({"baseline": {"losses": "a.json", "mlflow_run": "r"}}, "rollout.baseline", "exactly one"),
    ({"baseline": {}}, "rollout.baseline", "found neither"),
    ({"baseline": {"mlflow_run": " "}}, "rollout.baseline.mlflow_run", "empty"),
    ({"stages": [{"select": {"glob": "*"}, "format": "fp8_tensorwse"}]}, "rollout.stages[0].format",
     "Did you mean 'fp8_tensorwise'"),
    ({"stages": [{"select": {"glb": "*"}, "format": "bf16"}]}, "rollout.stages[0].select.glb", "Did you mean 'glob'"),
    ({"stages": [{"name": "a", "select": {"glob": "*"}, "format": "bf16"}] * 2}, "rollout.stages[1].name",
     "used twice"),
    ({"stages": []}, "rollout.stages", "at least one stage"),
    ({"stages": None}, "rollout.stages", "expected a list"),
    ({"rewind": {"source": "dsk"}}, "rollout.rewind.source", "Did you mean 'disk'"),
    ({"rewind": {"keep": 0}}, "rollout.rewind.keep", ">= 1"),
    ({"rewind": "yes"}, "rollout.rewind", "expected a mapping"),
    ({"thresholds": {"spike_sigma": 6.0}}, "rollout.thresholds.spike_sigma", "Did you mean 'spike_sigmas'"),
    ({"thresholds": {"spike_window": 1}}, "rollout.thresholds.spike_window", ">= 2"),
    ({"thresholds": {"site_patience": "2"}}, "rollout.thresholds.site_patience", "write 2"),
    ({"check_every": 0}, "rollout.check_every", ">= 1"),
    ({"quarantine_after": 0}, "rollout.quarantine_after", ">= 1"),
    ({"check_everyy": 10}, "rollout.check_everyy", "Did you mean 'check_every'"),
])
def test_bad_sections_are_config_errors_with_their_path(changes, path, words):
    e = error(section(**changes))
    assert e.path == path and words in e.message, str(e)


def test_read_losses_takes_a_list_or_a_mapping(tmp_path):
    (tmp_path / "list.json").write_text(json.dumps([3.0, 2.5, float("nan"), 2.0]))
    assert read_losses(tmp_path / "list.json") == {0: 3.0, 1: 2.5, 3: 2.0}
    (tmp_path / "map.json").write_text(json.dumps({"0": 3.0, "10": 2.0}))
    assert read_losses(tmp_path / "map.json") == {0: 3.0, 10: 2.0}
    (tmp_path / "bad.json").write_text(json.dumps({"losses": [1, 2]}))
    for name, words in (("missing.json", "no such file"), ("bad.json", "neither a list")):
        with pytest.raises(ConfigError, match=words) as e:
            read_losses(tmp_path / name)
        assert e.value.path == "rollout.baseline.losses"


# ---------------------------------------------------------------- with a model

class Block(nn.Module):
    def __init__(self, d: int):
        super().__init__()
        self.mlp = nn.ModuleDict({"fc": nn.Linear(d, d), "proj": nn.Linear(d, d)})

    def forward(self, x):
        return x + self.mlp["proj"](torch.relu(self.mlp["fc"](x)))


class Tiny(nn.Module):
    def __init__(self, d: int = 16, n: int = 2):
        super().__init__()
        self.blocks = nn.ModuleList(Block(d) for _ in range(n))

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x.pow(2).mean()


PLAN = {"backend": "emulated", "rules": [{"name": "all", "select": {"glob": "blocks.*"}, "format": "bf16",
                                          "ladder": ["fp8_tensorwise", "bf16"]}]}


def prepared():
    torch.manual_seed(0)
    model = Tiny()
    return model, lowprec.prepare(model, PrecisionPlan.from_dict(PLAN), seed=0)


def test_build_controller_resolves_stages_and_reads_the_named_baseline(tmp_path, monkeypatch):
    model, state = prepared()
    ctl = build_controller(parse_rollout(section()), state, model)
    assert ctl.stages[0].sites == ("blocks.0.mlp.fc", "blocks.0.mlp.proj", "blocks.1.mlp.fc", "blocks.1.mlp.proj")
    assert ctl.loss_gap is None
    gap = section(thresholds={"loss_gap": 0.05}, baseline={"losses": "bf16/losses.json"})
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match="no such file"):
        build_controller(parse_rollout(gap), state, model)
    (tmp_path / "bf16").mkdir()
    (tmp_path / "bf16" / "losses.json").write_text(json.dumps([2.0] * 50))
    assert build_controller(parse_rollout(gap), state, model).loss_gap.baseline[49] == 2.0
    given = build_controller(parse_rollout(gap), state, model, baseline={0: 3.0})   # passed in code: wins
    assert given.loss_gap.baseline == {0: 3.0}
    run = section(thresholds={"loss_gap": 0.05}, baseline={"mlflow_run": "bf16-baseline"})
    with pytest.raises(ConfigError, match="pass baseline="):
        build_controller(parse_rollout(run), state, model)
    with pytest.raises(ConfigError, match="selects no precision site") as e:
        build_controller(parse_rollout(section(stages=[{"select": {"glob": "head.*"}, "format": "bf16"}])),
                         state, model)
    assert e.value.path == "rollout.stages[0].select"


def test_session_skips_a_nan_step_once_and_forces_a_check():
    from lowprec.runtime import Session, SessionSettings
    model, state = prepared()
    rollout = parse_rollout(section(check_every=4))
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    session = Session(model, opt, state, build_controller(rollout, state, model),
                      settings=SessionSettings(monitor=rollout.monitor_config()))
    actions = []
    for step in range(8):
        x = torch.randn(4, 16)
        if step == 1:
            x[0, 0] = math.nan
        loss = model(x)
        loss.backward()
        actions.append(session.step(loss).action)
    assert actions == [Action.CONTINUE, Action.SKIP_STEP] + [Action.CONTINUE] * 6
    assert [(e.step, e.kind) for e in session.events] == [(1, EventKind.SKIP_STEP)]
    assert session.last_signals.step == 7 and all(map(math.isfinite, session.last_signals.losses))
    assert all(torch.isfinite(p).all() for p in model.parameters())
