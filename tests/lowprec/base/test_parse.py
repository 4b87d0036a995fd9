"""The generic config parser: types from annotations, unknown and missing keys, __post_init__ errors."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowprec.base.parse import ConfigError, describe_type, parse, to_data
from lowprec.sites.plan import PlanError


class Color(str, enum.Enum):
    RED = "red"
    GREEN = "green"


@dataclass(frozen=True)
class Inner:
    size: int
    scale: float = 1.0


@dataclass(frozen=True)
class Outer:
    name: str
    inner: Inner
    maybe: Inner | None = None
    count: int = 3
    rate: float = 0.5
    flag: bool = False
    mode: Literal["fast", "full"] = "fast"
    color: Color = Color.RED
    opt: Optional[int] = None
    items: list[int] = field(default_factory=list)
    shape: tuple[int, ...] = ()
    pair: tuple[str, float] = ("a", 1.0)
    extra: dict[str, Any] = field(default_factory=dict)
    inners: tuple[Inner, ...] = ()

    def __post_init__(self) -> None:
        if self.count < 0:
            raise ValueError(f"count is {self.count}; give a number >= 0")
        if self.rate > 10:
            raise ConfigError("rate", f"{self.rate} is above 10")


def err(data: Any, path: str = "top") -> ConfigError:
    with pytest.raises(ConfigError) as e:
        parse(Outer, data, path)
    assert str(e.value) == f"{e.value.path}: {e.value.message}"
    return e.value


def test_parses_every_supported_type():
    o = parse(Outer, {"name": "x", "inner": {"size": 2}, "maybe": {"size": 1, "scale": 2}, "count": 4,
                      "rate": "3e-3", "flag": True, "mode": "full", "color": "green", "opt": 7, "items": [1, 2],
                      "shape": [3, 4], "pair": ["b", 2], "extra": {"k": [1, {"z": None}]},
                      "inners": [{"size": 5}]}, "top")
    assert o == Outer(name="x", inner=Inner(2), maybe=Inner(1, 2.0), count=4, rate=0.003, flag=True, mode="full",
                      color=Color.GREEN, opt=7, items=[1, 2], shape=(3, 4), pair=("b", 2.0),
                      extra={"k": [1, {"z": None}]}, inners=(Inner(5),))
    assert isinstance(o.rate, float) and isinstance(o.maybe.scale, float) and isinstance(o.pair[1], float)
    assert parse(Outer, {"name": "x", "inner": {"size": 1}, "maybe": None, "opt": None}, "top").maybe is None


def test_float_accepts_ints_and_numeric_strings_only():
    for raw, want in [(3, 3.0), ("3e-3", 0.003), ("-1.5E+2", -150.0), (".5", 0.5), (" 2 ", 2.0)]:
        assert parse(Outer, {"name": "x", "inner": {"size": 1}, "rate": raw}, "t").rate == want
    e = err({"name": "x", "inner": {"size": 1}, "rate": "fast"})
    assert e.path == "top.rate" and "expected a number, found the string 'fast'" in e.message


def test_bool_is_not_a_number_and_a_number_is_not_a_bool():
    assert "expected an integer, found the boolean true" in err({"name": "x", "inner": {"size": True}}).message
    assert err({"name": "x", "inner": {"size": 1}, "rate": False}).path == "top.rate"
    e = err({"name": "x", "inner": {"size": 1}, "flag": 1})
    assert e.path == "top.flag" and "expected true or false, found the integer 1" in e.message
    assert "without quotes" in err({"name": "x", "inner": {"size": 1}, "flag": "yes"}).message


def test_int_field_refuses_strings_and_floats_with_a_fix():
    e = err({"name": "x", "inner": {"size": "12"}})
    assert e.path == "top.inner.size" and "found the string '12'; write 12, without quotes" in e.message
    assert "write 1000" in err({"name": "x", "inner": {"size": 1000.0}}).message
    assert "found the number 1.5" in err({"name": "x", "inner": {"size": 1.5}}).message


def test_str_field_refuses_numbers():
    e = err({"name": 2024, "inner": {"size": 1}})
    assert e.path == "top.name" and 'quote it: "2024"' in e.message


def test_unknown_key_with_did_you_mean_at_every_level():
    e = err({"name": "x", "inner": {"size": 1}, "cont": 2})
    assert e.path == "top.cont" and "Did you mean 'count'" in e.message and "Allowed keys: name, inner" in e.message
    e = err({"name": "x", "inner": {"size": 1, "scael": 2}})
    assert e.path == "top.inner.scael" and "Did you mean 'scale'?" in e.message
    assert err({"name": "x", "inner": {"size": 1}, "inners": [{"size": 1}, {"siz": 2}]}).path == "top.inners[1].siz"


def test_missing_required_keys_are_named():
    e = err({"inner": {}})
    assert e.path == "top.name" and "missing required key name" in e.message
    e = err({"name": "x", "inner": {}})
    assert e.path == "top.inner.size" and "it is empty" in e.message
    e = err({})
    assert "missing required keys name, inner" in e.message


def test_literal_enum_and_containers():
    e = err({"name": "x", "inner": {"size": 1}, "mode": "fsat"})
    assert e.path == "top.mode" and "one of 'fast', 'full'" in e.message and "Did you mean 'fast'?" in e.message
    e = err({"name": "x", "inner": {"size": 1}, "color": "gren"})
    assert "one of 'red', 'green'" in e.message and "found the string 'gren'. Did you mean 'green'" in e.message
    e = err({"name": "x", "inner": {"size": 1}, "items": [1, "two"]})
    assert e.path == "top.items[1]" and "expected an integer" in e.message
    e = err({"name": "x", "inner": {"size": 1}, "items": "1, 2"})
    assert "expected a list of integers" in e.message and "write a list" in e.message
    assert "2 items" in describe_type(tuple[str, float]) or "a list of 2 items" in describe_type(tuple[str, float])
    assert err({"name": "x", "inner": {"size": 1}, "pair": ["a"]}).path == "top.pair"
    e = err({"name": "x", "inner": {"size": 1}, "extra": {1: 2}})
    assert e.path == "top.extra.1" and "expected a string" in e.message
    e = err({"name": "x", "inner": 5})
    assert e.path == "top.inner" and "expected a mapping with keys size, scale, found the integer 5" in e.message
    e = err({"name": "x", "inner": {"size": 1}, "maybe": "big"})
    assert e.path == "top.maybe" and "or null" in e.message
    e = err({"name": "x", "inner": {"size": 1}, "maybe": {"size": "s"}})   # the nested error, not the union's
    assert e.path == "top.maybe.size"


def test_post_init_errors_get_the_section_path():
    e = err({"name": "x", "inner": {"size": 1}, "count": -1})
    assert e.path == "top" and "count is -1" in e.message
    e = err({"name": "x", "inner": {"size": 1}, "rate": 11})
    assert e.path == "top.rate" and "above 10" in e.message
    assert err([1, 2]).message.startswith("expected a mapping with keys name, inner")


def test_plan_error_is_a_config_error():
    assert issubclass(PlanError, ConfigError)
    e = PlanError("rules[0]", "bad").under("precision")
    assert type(e) is PlanError and e.path == "precision.rules[0]" and str(e) == "precision.rules[0]: bad"
    assert ConfigError("[2].x", "m").under("stages").path == "stages[2].x"
    assert ConfigError("", "m").under("train").path == "train"
    assert ConfigError("train.lr", "m").under("train").path == "train.lr"


def test_to_data_round_trips():
    o = parse(Outer, {"name": "x", "inner": {"size": 2}, "color": "green", "shape": [1], "inners": [{"size": 3}]},
              "top")
    data = to_data(o)
    assert data["color"] == "green" and data["shape"] == [1] and data["inners"] == [{"size": 3, "scale": 1.0}]
    assert parse(Outer, data, "top") == o


# --- property: whatever the mapping, parse gives an Outer or a ConfigError, nothing else ---

_scalars = st.one_of(st.none(), st.booleans(), st.integers(-5, 20), st.floats(allow_nan=True),
                     st.sampled_from(["fast", "full", "red", "green", "3e-3", "12", "", "x", "1.5", "true"]),
                     st.text(max_size=5))
_keys = st.sampled_from(["name", "inner", "maybe", "count", "rate", "flag", "mode", "color", "opt", "items",
                         "shape", "pair", "extra", "inners", "size", "scale", "cont", "nmae"]) | st.integers(0, 3)
_values = st.recursive(_scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_keys, inner, max_size=4),
                       max_leaves=12)
_good_inner = st.fixed_dictionaries({"size": st.integers(0, 9)}, optional={"scale": st.floats(-1, 1)})
_inner = _good_inner | st.fixed_dictionaries({}, optional={"size": _values, "scale": _values, "bogus": _values})
_fields = {  # each field: a good value or anything
    "maybe": st.none() | _inner, "count": st.integers(-1, 5), "rate": st.floats(0, 12) | st.just("3e-3"),
    "flag": st.booleans(), "mode": st.sampled_from(["fast", "full"]), "color": st.sampled_from(["red", "green"]),
    "opt": st.none() | st.integers(), "items": st.lists(st.integers(), max_size=3),
    "shape": st.lists(st.integers(), max_size=3), "pair": st.tuples(st.text(max_size=3), st.integers()),
    "extra": st.dictionaries(st.text(max_size=3), _values, max_size=3), "inners": st.lists(_inner, max_size=2),
    "cont": st.nothing()}
_optional = {k: good | _values for k, good in _fields.items()}
_outer = (st.fixed_dictionaries({"name": st.text(max_size=4), "inner": _good_inner}, optional=_optional)
          | st.fixed_dictionaries({}, optional={"name": st.text(max_size=4) | _values, "inner": _inner | _values,
                                                **_optional}))


@settings(max_examples=400, deadline=None)
@given(st.one_of(_outer, _values))
def test_parse_never_raises_anything_but_config_error(data):
    try:
        out = parse(Outer, data, "top")
    except ConfigError as e:
        assert e.path.startswith("top") and str(e) == f"{e.path}: {e.message}"
    else:
        assert isinstance(out, Outer) and repr(parse(Outer, to_data(out), "top")) == repr(out)


@pytest.mark.parametrize("loader", ["run", "hosted", "session"])
def test_every_config_file_reader_names_the_file_for_what_it_cannot_read(tmp_path, loader):
    """`lowprec run` configs, the integrations' configs and `Session.from_yaml` read files the
    same way: a folder, a YAML tag, bytes that are not UTF-8 and a non-mapping are each a
    ConfigError naming the file, not a traceback."""
    from lowprec.config import ConfigRole, LowprecConfig
    from lowprec.runtime.session.session import Session
    read = {"run": LowprecConfig.from_yaml, "hosted": lambda p: LowprecConfig.from_yaml(p, ConfigRole.FRAMEWORK),
            "session": lambda p: Session.from_yaml(p, torch.nn.Linear(2, 2), None)}[loader]
    cases = {"tag.yaml": b'precision: !!python/object/apply:os.system ["true"]\n',
             "latin1.yaml": "precision: {default: caf\u00e9}\n".encode("latin-1"),
             "list.yaml": b"- precision\n"}
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
    for path, words in ((tmp_path, "is a folder"), (tmp_path / "tag.yaml", "YAML tag"),
                        (tmp_path / "latin1.yaml", "cannot read the file"), (tmp_path / "list.yaml", "found")):
        with pytest.raises(ConfigError, match=words) as e:
            read(path)
        assert e.value.path == str(path)
