"""Gate files: a good one loads into frozen Gates with defaults applied; each kind of bad one is a
GateSpecError that names the file, the gate and the key, what is allowed and how to fix it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from lowprec.gates import Gate, GateSpec, GateSpecError, Tolerance

ROOT = Path(__file__).resolve().parents[3]
GOOD = """
gates:
  - metric: eval/heldout_shakespeare/bits_per_byte
    direction: lower_is_better
    max_regression: {relative: 0.02}
    statistic: paired_bootstrap
    confidence: 0.95
    min_samples: 50
  - metric: eval/cloze_shakespeare/acc
    direction: higher_is_better
    max_regression: {absolute: 0.01}
defaults: {confidence: 0.9, bootstrap_samples: 1000, seed: 3}
"""


def _write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "gates.yaml"
    p.write_text(text)
    return p


def test_good_file_loads_with_defaults(tmp_path):
    spec = GateSpec.from_yaml(_write(tmp_path, GOOD))
    a, b = spec.gates
    assert a == Gate("eval/heldout_shakespeare/bits_per_byte", "lower_is_better", Tolerance("relative", 0.02),
                     "paired_bootstrap", 0.95, 50, 1000, 3)
    assert (b.confidence, b.bootstrap_samples, b.seed, b.min_samples, b.statistic) == (0.9, 1000, 3, 30,
                                                                                       "paired_bootstrap")
    assert b.max_regression.allowed(0.4) == 0.01 and a.max_regression.allowed(-2.0) == pytest.approx(0.04)
    with pytest.raises(dataclasses.FrozenInstanceError):
        a.confidence = 0.5
    assert spec.metrics == ["eval/heldout_shakespeare/bits_per_byte", "eval/cloze_shakespeare/acc"]


def test_the_default_gate_file_loads():
    spec = GateSpec.from_yaml(ROOT / "gates" / "default.yaml")
    assert {"eval/heldout_shakespeare/bits_per_byte", "eval/shift_milton/bits_per_byte"} <= set(spec.metrics)
    # only gates that can fire (the cloze accuracy of the small model cannot), each with its calibrated noise
    assert "eval/cloze_shakespeare/acc" not in spec.metrics
    assert all(g.noise is not None and not g.informational for g in spec.gates)


def test_informational_noise_and_bounds_keys():
    spec = GateSpec.from_dict({"gates": [{"metric": "eval/x/acc", "direction": "higher_is_better",
                                          "max_regression": {"absolute": 0.02}, "informational": True,
                                          "noise": {"sd": 0.01, "mean": -0.001}, "bounds": [0, 100]}]})
    g = spec.gates[0]
    assert g.informational and g.noise.sd == 0.01 and g.noise.mean == -0.001 and g.value_bounds() == (0.0, 100.0)
    assert g.cannot_fire(0.01) and not g.cannot_fire(50.0)
    plain = GateSpec.from_dict({"gates": [{"metric": "eval/x/acc", "direction": "higher_is_better",
                                           "max_regression": {"absolute": 0.02}}]}).gates[0]
    assert plain.value_bounds() == (0.0, 1.0) and "floor 0" in plain.cannot_fire(0.001)
    assert plain.cannot_fire(0.5) is None
    for bad, part in (({"sd": -1}, "noise.sd"), ({"sdev": 1}, "Did you mean 'sd'"), (0.1, "mapping")):
        with pytest.raises(GateSpecError, match="noise") as e:
            GateSpec.from_dict({"gates": [{"metric": "m", "direction": "lower_is_better",
                                           "max_regression": {"relative": 0.1}, "noise": bad}]})
        assert part in str(e.value)
    with pytest.raises(GateSpecError, match="bounds"):
        GateSpec.from_dict({"gates": [{"metric": "m", "direction": "lower_is_better",
                                       "max_regression": {"relative": 0.1}, "bounds": [1, 0]}]})
    with pytest.raises(GateSpecError, match="informational"):
        GateSpec.from_dict({"gates": [{"metric": "m", "direction": "lower_is_better",
                                       "max_regression": {"relative": 0.1}, "informational": "yes"}]})


GATE = "  - metric: eval/x/acc\n    direction: higher_is_better\n    max_regression: {absolute: 0.01}\n"
BAD = {
    "unknown gate key": (GATE + "    confidance: 0.9\n",
                         ["gates[0] (eval/x/acc)", "confidance", "unknown key", "Did you mean 'confidence'"]),
    "unknown top key": ("gate:\n" + GATE, ["unknown key 'gate'", "Did you mean 'gates'", "Allowed keys: gates, defaults"]),
    "bad direction": (GATE.replace("higher_is_better", "up"),
                      ["gates[0] (eval/x/acc)", "direction", "'up' is not allowed", "lower_is_better, higher_is_better"]),
    "negative tolerance": (GATE.replace("0.01", "-0.01"), ["max_regression.absolute", "must be >= 0"]),
    "absent tolerance": ("  - metric: eval/x/acc\n    direction: higher_is_better\n",
                         ["max_regression", "is required", "max_regression: {relative: 0.02}"]),
    "two tolerances": (GATE.replace("{absolute: 0.01}", "{absolute: 0.01, relative: 0.02}"),
                       ["needs exactly one of relative, absolute"]),
    "tolerance not a number": (GATE.replace("0.01", "'2%'"), ["max_regression.absolute", "must be a finite number"]),
    "percent as relative": (GATE.replace("absolute: 0.01", "relative: 2"), ["fraction", "write 0.02"]),
    "unknown tolerance kind": (GATE.replace("absolute", "absolut"), ["max_regression.absolut", "Did you mean 'absolute'"]),
    "confidence too high": (GATE + "    confidence: 1.0\n", ["confidence", "strictly between 0.5 and 1"]),
    "confidence too low": (GATE + "    confidence: 0.5\n", ["confidence", "strictly between 0.5 and 1"]),
    "bad statistic": (GATE + "    statistic: bootstrap\n", ["statistic", "Did you mean 'paired_bootstrap'"]),
    "bad min_samples": (GATE + "    min_samples: 0\n", ["min_samples", "whole number from 1"]),
    "bad default": (GATE + "defaults: {confidence: 2}\n", ["defaults.confidence", "strictly between"]),
    "unknown default": (GATE + "defaults: {direction: lower_is_better}\n", ["defaults.direction", "unknown key"]),
    "duplicate metric": (GATE + GATE, ["gates[1] (eval/x/acc)", "again", "gates[0]"]),
    "gate not a mapping": ("  - eval/x/acc\n", ["gates[0]", "must be a mapping"]),
    "missing metric": ("  - direction: higher_is_better\n    max_regression: {absolute: 0.01}\n",
                       ["gates[0]", "metric: is required"]),
}


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_file_is_a_clear_error(tmp_path, kind):
    text, expected = BAD[kind]
    if text.startswith("  "):  # a gate list: under `gates:`
        text = "gates:\n" + text
    path = _write(tmp_path, text)
    with pytest.raises(GateSpecError) as e:
        GateSpec.from_yaml(path)
    msg = str(e.value)
    assert msg.startswith(str(path)), msg
    for part in expected:
        assert part in msg, f"{part!r} not in {msg!r}"


@pytest.mark.parametrize("text, expected", [
    ("gates: [\n", "is not valid YAML"),
    ("- a\n- b\n", "must hold a mapping with a `gates:` list"),
    ("gates: []\n", "must be a non-empty list"),
    ("defaults: {seed: 1}\n", "must be a non-empty list"),
])
def test_bad_file_shape(tmp_path, text, expected):
    with pytest.raises(GateSpecError, match=expected):
        GateSpec.from_yaml(_write(tmp_path, text))


def test_missing_file(tmp_path):
    with pytest.raises(GateSpecError, match="does not exist"):
        GateSpec.from_yaml(tmp_path / "nope.yaml")


def test_shipped_gate_files_by_name(tmp_path, monkeypatch):
    from lowprec.gates.inloop import GateFileChecker
    from lowprec.gates.spec import gate_file, gate_names
    monkeypatch.chdir(tmp_path)                   # a name is found through the package, not the working folder
    assert {"default", "inloop", "telemetry"} <= set(gate_names())
    for name in ("default", "inloop"):
        assert GateSpec.from_yaml(name) == GateSpec.from_yaml(ROOT / "gates" / f"{name}.yaml")
    assert GateFileChecker("inloop").metrics == GateFileChecker(ROOT / "gates" / "inloop.yaml").metrics
    assert gate_file("./default") == Path("./default")          # a path (a `/` or a `.`) stays a path
    with pytest.raises(GateSpecError, match=r"no gate file named 'defualt' ships with lowprec\. Did you mean "
                                            r"'default'\?.*named gate files are: default, inloop, telemetry"):
        GateSpec.from_yaml("defualt")
    with pytest.raises(GateSpecError, match="'my.yaml' does not exist"):
        GateSpec.from_yaml("my.yaml")


def test_plans_gate_files_and_configs_share_one_parser_and_one_error(tmp_path):
    """Issue 55: a gate file and a plan go through `lowprec.base.parse` as every config section
    does: one error class (`GateSpecError` and `PlanError` are `ConfigError`), one message shape
    (the place, what was expected, what was found, the hint)."""
    from lowprec.base.parse import ConfigError
    from lowprec.sites.plan import PlanError, PrecisionPlan
    assert GateSpecError is ConfigError and PlanError is ConfigError
    gate = {"metric": "m", "direction": "lower_is_better", "max_regression": {"relative": 0.1}}
    cases = [
        ({"gates": [{**gate, "confidence": "high"}]}, "gates[0] (m).confidence: expected a number, found the string 'high'"),
        ({"gates": [{**gate, "noise": {"sd": "x"}}]}, "gates[0] (m).noise.sd: expected a number, found the string 'x'"),
        ({"gates": [{**gate, "min_samples": 2.5}]}, "gates[0] (m).min_samples: expected an integer, found the number 2.5"),
        ({"gates": [gate], "error_budget": {"alpha": "x"}}, "error_budget.alpha: expected a number, found the string 'x'"),
        ({"gates": [{**gate, "max_regression": 0.1}]},
         "gates[0] (m).max_regression: expected a mapping with keys relative, absolute, found the number 0.1"),
    ]
    for d, text in cases:
        with pytest.raises(ConfigError) as e:
            GateSpec.from_dict(d, source="g.yaml")
        assert str(e.value).startswith("g.yaml: " + text), str(e.value)
    with pytest.raises(ConfigError) as e:
        PrecisionPlan.from_dict({"rules": [{"select": {"glob": "*"}, "format": "nvfp4", "ladder": "bf16"}]})
    assert str(e.value).startswith("precision.rules[0].ladder: expected a list of format names, found the string "
                                   "'bf16'; write a list"), str(e.value)
    with pytest.raises(ConfigError) as e:
        PrecisionPlan.from_dict({"default": "fp9"})
    assert str(e.value).startswith("precision.default: expected a format name, found the string 'fp9': unknown "
                                   "precision format 'fp9'."), str(e.value)
