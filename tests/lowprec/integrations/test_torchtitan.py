"""lowprec's torchtitan converter (`lowprec.integrations.torchtitan`, torchtitan 0.3) without
a process group: what it refuses, and the llama3 `debugmodel` it prepares (built on the meta
device, materialized and initialized as torchtitan's Trainer does). The rollout under
torchtitan's real Trainer and torchrun: test_torchtitan_trainer.py.
"""

from __future__ import annotations

import importlib
import sys

import pytest

from lowprec.base.parse import ConfigError
from lowprec.integrations.extras import MissingExtraError


PLAN_YAML = """\
precision:
  backend: emulated
  default: bf16
  keep_high_precision: [{fqns: [lm_head]}]
  rules:
    - {name: blocks, select: {glob: "layers.*"}, format: bf16, ladder: [fp8_delayed, bf16]}
rollout:
  check_every: 2
  min_steps: 2
  cooldown_steps: 1000
  attribution: {replay: false}
  thresholds: {max_saturated_frac: 0.05, site_patience: 1}
  stages:
    - {name: mlp_fp8, select: {glob: "layers.*.feed_forward.*"}, format: fp8_delayed}
    - {name: attn_fp8, select: {glob: "layers.*.attention.*"}, format: fp8_delayed}
"""


@pytest.fixture
def titan():
    return pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install 'lowprec[torchtitan]')")


def test_converter_refuses_what_torchtitan_does_not_allow(titan, tmp_path):
    from lowprec.integrations.torchtitan import LowprecConverter, load_config
    te = tmp_path / "te.yaml"
    te.write_text(PLAN_YAML.replace("backend: emulated", "backend: te"))
    with pytest.raises(ConfigError, match=r"precision\.backend.*need CUDA.*backend: torch"):
        load_config(te)
    bad = tmp_path / "bad.yaml"
    bad.write_text(PLAN_YAML.replace("format: fp8_delayed}", "format: fp8_delayd}", 1))
    with pytest.raises(ConfigError, match=r"fp8_delayd") as e:
        LowprecConverter.Config(config=str(bad)).build()
    assert str(bad) in str(e.value)   # which file the key is in
    train = tmp_path / "train.yaml"   # torchtitan owns the model, the data and the training settings
    train.write_text(PLAN_YAML + "train: {steps: 10}\n")
    with pytest.raises(ConfigError, match=r"train"):
        load_config(train)
    # what the framework sections allow is taken: rewind, loss gap, LR probe, eval, tracking
    full = tmp_path / "full.yaml"
    full.write_text(PLAN_YAML.replace("attribution: {replay: false}", "rewind: true\n  lr_probe: true")
                    + "tracking: {enabled: false}\n")
    cfg = load_config(full)
    assert cfg.rollout.rewind.enabled and cfg.rollout.lr_probe.enabled
    evals = tmp_path / "eval.yaml"   # an eval section (hosted under every parallelism, pipeline included)
    evals.write_text(PLAN_YAML + "eval: {suite: default, every: 0, mode: fast, final_mode: fast}\n")
    assert load_config(evals).eval is not None
    # telemetry: LowprecTrainer times torchtitan's steps; the HF and Lightning callbacks time nothing and refuse it
    from lowprec.integrations.core import framework_config
    from lowprec.tracking.telemetry import EnergySource
    timed = tmp_path / "telemetry.yaml"
    timed.write_text(PLAN_YAML + "telemetry: {energy: 'off', system_metrics_s: 5}\n")
    cfg = load_config(timed)
    assert cfg.telemetry.energy is EnergySource.OFF and cfg.telemetry.system_metrics_s == 5
    with pytest.raises(ConfigError, match=r"unknown key 'telemetry'"):
        framework_config(timed)


def test_converter_prepares_the_debugmodel_and_a_plain_trainer_is_stopped(titan, tmp_path):
    """The converter swaps the planned layers at build (torchtitan Modules, initialized by
    torchtitan's param_init); a model trained without LowprecTrainer stops at its first forward."""
    import torch
    from torchtitan.models.llama3 import model_registry

    from lowprec.integrations.torchtitan import LowprecConverter, TitanPrecisionLinear, prepared_of
    plan = tmp_path / "precision.yaml"
    plan.write_text(PLAN_YAML)
    spec = model_registry("debugmodel", converters=[LowprecConverter.Config(config=str(plan))])
    with torch.device("meta"):
        model = spec.model.build()
    model.verify_module_protocol()          # every layer is a torchtitan Module, lowprec's included
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    state = prepared_of(model).state
    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    planned = {n for n in linears if n.startswith("layers.")}
    assert len(planned) == 6 * 5 and all(isinstance(linears[n], TitanPrecisionLinear) for n in planned)
    assert not isinstance(linears["lm_head"], TitanPrecisionLinear)   # kept in high precision
    assert set(state.formats()) == planned and set(state.formats().values()) == {"bf16"}
    w = state.sites["layers.0.feed_forward.w1"].module.weight
    assert abs(w.std().item() - 0.02) < 0.002, w.std().item()      # torchtitan's param_init
    with pytest.raises(RuntimeError, match=r"no LowprecTrainer.*lowprec_trainer\(config\)"):
        model(torch.zeros(1, 8, dtype=torch.long))


def test_import_without_torchtitan_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchtitan", None)   # as if not installed
    monkeypatch.delitem(sys.modules, "lowprec.integrations.torchtitan", raising=False)
    with pytest.raises(MissingExtraError, match=r"pip install 'lowprec\[torchtitan\]'"):
        importlib.import_module("lowprec.integrations.torchtitan")


def test_import_with_a_torchtitan_without_the_03_protocol_names_the_supported_versions(titan, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchtitan.protocols.model", None)   # as torchtitan 0.2, which lacks it
    monkeypatch.delitem(sys.modules, "lowprec.integrations.torchtitan", raising=False)
    with pytest.raises(MissingExtraError, match=r"torchtitan 0\.3\.x.*torchtitan>=0\.3,<0\.4"):
        importlib.import_module("lowprec.integrations.torchtitan")


@pytest.mark.parametrize("edit, where, words", [
    # a stage that names a module the model does not have (issue 56: found only after torchtitan built FSDP)
    (lambda t: t.replace('"layers.*.attention.*"}', '"layers.*.attn.*"}'), "rollout.stages[1].select", "attn_fp8"),
    # a two-stage rollout over rules without `ladder:` (issue 56: a ValueError without a key path)
    (lambda t: t.replace(", ladder: [fp8_delayed, bf16]", ""), "rollout.stages[0].format", "ladder"),
    # the default in-loop gate needs Milton; the shakespeare suite has none: the fix is named
    (lambda t: t + "eval: {suite: shakespeare, every: 0}\n", "eval.gates", "Fix: a suite with that task"),
])
def test_the_converter_checks_every_setting_against_the_model_before_torchtitan_builds(titan, tmp_path, edit, where,
                                                                                       words):
    """`model_registry(..., converters=[LowprecConverter...])`, which a job's config function
    calls before torchtitan builds anything, refuses each with its key path and the file (the
    model built on the meta device); the launcher turns that into one line and exit 2."""
    from torchtitan.models.llama3 import model_registry

    from lowprec.integrations.torchtitan import LowprecConverter
    plan = tmp_path / "lowprec.yaml"
    plan.write_text(edit(PLAN_YAML))
    with pytest.raises(ConfigError) as e:
        model_registry("debugmodel", converters=[LowprecConverter.Config(config=str(plan))])
    assert e.value.path == where and words in e.value.message and str(plan) in e.value.message, str(e.value)
