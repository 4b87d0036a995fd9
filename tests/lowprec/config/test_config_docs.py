"""docs/config.md and the typed config agree: every key, both ways, with its default."""

from __future__ import annotations

import dataclasses
import re
import typing
from pathlib import Path
from typing import Any

import pytest
import yaml

import lowprec.policy.rollout
from lowprec.config import (DataConfig, EvalConfig, ModelConfig, LowprecConfig, ParallelConfig, TelemetryConfig,
                            TrackingConfig, TrainConfig)
from lowprec.base.parse import to_data
from lowprec.numerics.formats import Format
from lowprec.sites.gemm_config import GEMM_ROLES, LinearGemmConfig
from lowprec.sites.plan import PLAN_KEYS, RULE_KEYS, SELECTOR_KEYS, PrecisionPlan, Rule, Selector

PAGE = Path(__file__).resolve().parents[3] / "docs" / "config.md"
REQUIRED = "required"
NESTED = object()   # a key whose default is a nested section: its keys are listed, its default is not compared


def page_tables() -> dict[str, dict[str, str]]:
    """{section heading: {key: default cell}} for every `## heading` followed by a key table."""
    tables: dict[str, dict[str, str]] = {}
    section = None
    for line in PAGE.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        elif section and (m := re.match(r"\|\s*`([^`]+)`\s*\|([^|]*)\|([^|]*)\|(.*)\|\s*$", line)):
            tables.setdefault(section, {})[m[1]] = m[3].strip()
    return tables


def _default(f: dataclasses.Field) -> Any:
    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
        return REQUIRED
    v = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    if dataclasses.is_dataclass(v) and not isinstance(v, Format):
        return NESTED
    return v.name if isinstance(v, Format) else to_data(v)


def _nested(tp: Any) -> list[tuple[str, type]]:
    """The dataclasses (other than selectors, which have their own table) a field of type `tp` holds,
    each with the suffix its keys take: `.` for a mapping, `[].` for a list of mappings."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        return [n for a in args for n in _nested(a)]
    if origin in (list, tuple):
        return [("[]" + s, c) for a in args if a is not Ellipsis for s, c in _nested(a)]
    if dataclasses.is_dataclass(tp) and tp is not Selector:
        return [(".", tp)]
    return []


def code_keys(cls: type, prefix: str = "", walk: bool = True) -> dict[str, Any]:
    """{dotted key: default} for every init field of `cls`, nested dataclasses walked if `walk`."""
    hints = typing.get_type_hints(cls)
    out = {}
    for f in dataclasses.fields(cls):
        if not f.init or f.name in ("source", "role") and cls is LowprecConfig:
            continue
        key = prefix + f.name
        out[key] = _default(f)
        for suffix, sub in _nested(hints[f.name]) if walk else ():
            out.update(code_keys(sub, key + suffix))
    return out


def precision_keys() -> dict[str, Any]:
    """The plan's keys (its allowed-key tuples), defaults from PrecisionPlan and Rule."""
    plan = {f.name: f for f in dataclasses.fields(PrecisionPlan)}
    rule = {f.name: f for f in dataclasses.fields(Rule)}
    keys = {k: _default(plan[k]) for k in PLAN_KEYS}
    keys.update({f"rules[].{k}": _default(rule[k]) for k in RULE_KEYS})
    # a rule without a name is named after its position (by PrecisionPlan), not Rule's own default
    assert PrecisionPlan.from_dict({"rules": [{"select": {"glob": "*"}, "format": "bf16"}]}).rules[0].name == "rules[0]"
    keys["rules[].name"] = "rules[<i>]"
    keys.update(code_keys(LinearGemmConfig, "gemm."))
    # each GEMM's default is LinearGemmConfig's (torchao's), not GemmConfig's own
    keys.update({f"gemm.{r}.use_fast_accum": getattr(LinearGemmConfig(), r).use_fast_accum for r in GEMM_ROLES})
    return keys


def selector_keys() -> dict[str, Any]:
    fields = {f.name: f for f in dataclasses.fields(Selector)}
    return {k: _default(fields[k]) for k in SELECTOR_KEYS}


def _same(code: Any, cell: str) -> bool:
    if code is NESTED:
        return True
    if code == REQUIRED or cell == REQUIRED:
        return cell == code
    try:
        page = yaml.safe_load(cell.strip("`"))
    except yaml.YAMLError:
        return False
    if isinstance(code, float) and not isinstance(page, bool):
        try:
            return float(page) == code
        except (TypeError, ValueError):
            return False
    return page == code and type(page) is type(code) or code is None and page is None


def mismatches(section: str, code: dict[str, Any]) -> list[str]:
    page = page_tables().get(section, {})
    problems = [f"{section}.{k}: in the code, not in docs/config.md" for k in code if k not in page]
    problems += [f"{section}.{k}: in docs/config.md, not in the code" for k in page if k not in code]
    problems += [f"{section}.{k}: default {page[k]} in docs/config.md, {code[k]!r} in the code"
                 for k in code if k in page and not _same(code[k], page[k])]
    return problems


# the sections table lists the sections only: each has its own table
SECTIONS = {"sections": lambda: code_keys(LowprecConfig, walk=False), "model": lambda: code_keys(ModelConfig),
            "data": lambda: code_keys(DataConfig), "train": lambda: code_keys(TrainConfig),
            "precision": precision_keys, "selectors": selector_keys, "eval": lambda: code_keys(EvalConfig),
            "tracking": lambda: code_keys(TrackingConfig), "telemetry": lambda: code_keys(TelemetryConfig),
            "parallel": lambda: code_keys(ParallelConfig)}


@pytest.mark.parametrize("section", list(SECTIONS))
def test_page_and_code_agree(section):
    assert mismatches(section, SECTIONS[section]()) == []


@pytest.mark.skipif(not hasattr(lowprec.policy.rollout, "RolloutConfig"),
                    reason="lowprec.policy.rollout has no RolloutConfig dataclass yet (helper C's rewrite of the rollout "
                           "section); the page's rollout table follows /work/PLAN.md until then")
def test_rollout_page_and_code_agree():
    keys = code_keys(lowprec.policy.rollout.RolloutConfig)
    # a stage without a name is named after its position (parse_rollout), not by StageConfig's own default
    stages = [{"select": {"glob": "*"}, "format": "bf16"}] * 2
    assert [s.name for s in lowprec.policy.rollout.parse_rollout({"stages": stages}).stages] == ["stage0", "stage1"]
    keys["stages[].name"] = "stage<i>"
    assert mismatches("rollout", keys) == []


def test_every_section_has_a_table():
    tables = page_tables()
    assert set(tables) == set(SECTIONS) | {"rollout"}
    assert set(tables["sections"]) == {"model", "data", "train", "precision", "rollout", "eval", "tracking", "telemetry",
                                      "parallel"}


def test_the_check_catches_a_disagreement(monkeypatch):
    """The comparison itself: a key missing, an extra key, a changed default are all reported."""
    code = code_keys(TrainConfig)
    code.pop("seed")
    code["ghost"] = 1
    code["steps"] = 301
    got = mismatches("train", code)
    assert "train.ghost: in the code, not in docs/config.md" in got
    assert "train.seed: in docs/config.md, not in the code" in got
    assert "train.steps: default `300` in docs/config.md, 301 in the code" in got
    assert _same(0.003, "`0.003`") and _same(0.003, "`3e-3`") and _same(None, "`null`") and not _same(False, "`0`")
