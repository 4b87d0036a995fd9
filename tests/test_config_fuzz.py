"""Hostile configs and gate files, generated around the schema (issue 12, "What it must show").

Start from the shipped files (experiments/configs/default.yaml, whose loss-gap baseline names
an MLflow run and is replaced here by a losses file; gates/default.yaml) and mutate them:
values of the wrong type, unknown or misspelt keys, missing keys and sections, sections that
are not mappings, bad selectors, YAML that does not parse. Every case goes through the loaders
(`LowprecConfig.from_dict`, `GateSpec.from_dict`/`from_yaml`) and through the CLI in process
(`lowprec plan`, `lowprec gate`): a loader raises only its documented error (ConfigError,
GateSpecError), the CLI returns 0 or 2 and prints no traceback.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SETTINGS = settings(max_examples=300, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

# Values of every type the schema does and does not expect, and selectors that are wrong.
HOSTILE: list[Any] = [
    None, True, False, 0, -1, 1, 2.5, -0.5, float("nan"), float("inf"), "", "x", "3e-3", "1e400", "bf16",
    "fp8_tensorwise", "nvfp4", "no_such_format", "os:system", "experiments.model:nope", "json:loads",
    [], [1, "a"], ["bf16"], {}, {"k": 1}, {"glob": "["}, {"regex": "("}, {"regex": "*"}, {"glob": "nomatch.*"},
    {"fqns": "lm_head"}, {"fqns": [1]}, {"glob": 1}, {"glob": "blocks.*", "regex": ".*"}, {"select": {}},
    {"relative": -1}, {"absolute": "a"}, {"relative": 0.1, "absolute": 0.1}, "eval/x", "eval/a/b/c",
]
OPS = ("replace", "delete", "unknown_key", "misspell", "not_a_mapping")
RAW_YAML = ["", "[1, 2]", "a: [", "!!python/object/apply:os.system ['true']", "42", "model: !!binary aGk=",
            "{model: null, precision: null}", "\t- x"]


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


def _mutate(doc: Any, mutations: list[tuple[tuple, str, Any]]) -> Any:
    doc = copy.deepcopy(doc)
    for path, op, value in mutations:
        parent = doc
        try:
            for k in path[:-1]:
                parent = parent[k]
            key = path[-1]
            if not isinstance(parent, (dict, list)):
                continue
            parent[key]
        except (KeyError, IndexError, TypeError):
            continue   # an earlier mutation removed the place
        if op == "replace":
            parent[key] = copy.deepcopy(value)
        elif op == "delete":
            del parent[key]
        elif op == "unknown_key" and isinstance(parent[key], dict):
            parent[key]["unexpected_" + str(len(parent[key]))] = copy.deepcopy(value)
        elif op == "misspell" and isinstance(parent, dict) and isinstance(key, str) and key:
            parent[key[:-1] + ("x" if key[-1] != "x" else "y")] = parent.pop(key)
        elif op == "not_a_mapping":
            parent[key] = [parent[key]] if isinstance(parent[key], dict) else str(parent[key])
    return doc


def _mutations(base: Any) -> st.SearchStrategy:
    return st.lists(st.tuples(st.sampled_from(_paths(base)), st.sampled_from(OPS), st.sampled_from(HOSTILE)),
                    min_size=1, max_size=3)


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("fuzz")


def _base_config(folder: Path) -> dict:
    d = yaml.safe_load((ROOT / "experiments/configs/default.yaml").read_text())
    losses = folder / "losses.json"
    losses.write_text(json.dumps([2.0] * 300))
    d["rollout"]["baseline"] = {"losses": str(losses)}     # not an MLflow run: no store needed
    d["eval"]["gates"] = str(ROOT / "gates/inloop.yaml")
    d["tracking"] = {"enabled": False, "experiment": "fuzz"}
    return d


BASE_GATES = yaml.safe_load((ROOT / "gates/default.yaml").read_text())
BASE_CONFIG_SHAPE = yaml.safe_load((ROOT / "experiments/configs/default.yaml").read_text())


def _no_traceback(capsys, rc) -> str:
    out, err = capsys.readouterr()
    assert rc in (0, 2), f"exit {rc}\n{out}\n{err}"
    assert "Traceback" not in err and "Traceback" not in out, err
    if rc == 2:
        assert err.strip(), "exit 2 without a message"
    return err


def test_base_files_are_valid(folder, capsys):
    from lowprec.gates.spec import GateSpec
    from lowprec.cli import main
    from lowprec.config import LowprecConfig

    LowprecConfig.from_dict(_base_config(folder))
    GateSpec.from_dict(BASE_GATES)
    path = folder / "base.yaml"
    path.write_text(yaml.safe_dump(_base_config(folder)))
    assert main(["plan", str(path)]) == 0, capsys.readouterr().err


@SETTINGS
@given(mutations=_mutations(BASE_CONFIG_SHAPE))
def test_config_loader_raises_only_config_error(folder, mutations):
    from lowprec.config import LowprecConfig
    from lowprec.base.parse import ConfigError

    doc = _mutate(_base_config(folder), mutations)
    try:
        LowprecConfig.from_dict(doc)
    except ConfigError as e:
        assert str(e).strip() and e.path is not None
    # anything else propagates and fails the test, with hypothesis's smallest example


@SETTINGS
@given(mutations=_mutations(BASE_GATES))
def test_gate_loader_raises_only_gate_spec_error(mutations):
    from lowprec.gates.spec import GateSpec, GateSpecError

    try:
        GateSpec.from_dict(_mutate(BASE_GATES, mutations), source="fuzz.yaml")
    except GateSpecError as e:
        assert str(e).startswith("fuzz.yaml")


@settings(SETTINGS, max_examples=300)
@given(mutations=_mutations(BASE_CONFIG_SHAPE), gate_mutations=st.none() | _mutations(BASE_GATES),
       raw=st.none() | st.sampled_from(RAW_YAML))
@example(mutations=[(("model", "args", "n_head"), "replace", 0)], gate_mutations=None, raw=None)  # was a traceback
@example(mutations=[(("rollout", "stages", 0, "select"), "replace", {"regex": "*"})], gate_mutations=None, raw=None)
@example(mutations=[(("train", "lr"), "replace", "3e-3")], gate_mutations=[(("gates", 0, "metric"), "replace", "x")],
         raw=None)
def test_plan_cli_exits_0_or_2_without_traceback(folder, capsys, mutations, gate_mutations, raw):
    from lowprec.cli import main

    cfg_path, gate_path = folder / "c.yaml", folder / "g.yaml"
    doc = _base_config(folder)
    if gate_mutations is not None:   # the in-loop gate file, fuzzed too
        gate_path.write_text(yaml.safe_dump(_mutate(BASE_GATES, gate_mutations)))
        doc["eval"]["gates"] = str(gate_path)
    cfg_path.write_text(raw if raw is not None else yaml.safe_dump(_mutate(doc, mutations)))
    try:
        rc = main(["plan", str(cfg_path)])
    except SystemExit as e:   # argparse's own exits
        rc = e.code
    _no_traceback(capsys, rc)


@settings(SETTINGS, max_examples=100)
@given(mutations=_mutations(BASE_GATES), raw=st.none() | st.sampled_from(RAW_YAML))
def test_gate_cli_exits_2_without_traceback(folder, capsys, mutations, raw):
    """A gate file that is bad exits 2 naming it; a good one reaches the (absent) store: 2 too."""
    from lowprec.cli import main

    gate_path, store = folder / "gates.yaml", folder / "no-store.db"
    gate_path.write_text(raw if raw is not None else yaml.safe_dump(_mutate(BASE_GATES, mutations)))
    rc = main(["gate", "--baseline", "a" * 32, "--candidate", "b" * 32, "--gates", str(gate_path),
               "--tracking-uri", f"sqlite:///{store}"])
    err = _no_traceback(capsys, rc)
    assert rc == 2 and err.startswith("lowprec gate: ")
    assert not store.exists()
