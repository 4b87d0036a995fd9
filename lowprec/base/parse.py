"""One parser for every config section: a frozen dataclass from a mapping, types checked.

    @dataclass(frozen=True)
    class TrainConfig:
        steps: int = 300
        lr: float = 3e-3
        grad_clip: float | None = 1.0

    parse(TrainConfig, {"steps": 100, "lr": "3e-3"}, "train")  # TrainConfig(steps=100, lr=0.003, ...)

Every problem is a `ConfigError` whose `path` says where (`train.lr`,
`rollout.stages[1].format`) and whose message says what was found, what is allowed and
the fix. The checks, the same for every section:

* unknown keys, with a did-you-mean and the allowed keys (`check_keys`, also for sections
  parsed by hand); missing required keys, named;
* types from the field annotations: `int`, `float`, `bool`, `str`, `X | None`,
  `Literal[...]`, Enum subclasses (by value), nested dataclasses, `list[T]`,
  `tuple[T, ...]`, `dict[str, T]`, `Any`. A bool is never a number and a number never a
  bool. A float accepts an int and a numeric string such as "3e-3" (PyYAML 1.1 reads
  `3e-3`, without a dot, as a string); any other string where a number belongs is an error;
* a value type (a class with a `from_config_value(v)` classmethod and a `config_description`,
  e.g. `Format` from its name) is built by that method; its ValueError is the hint after
  "expected <description>, found <value>";
* a ValueError or TypeError from the dataclass's `__post_init__` becomes a ConfigError at
  the section's path (raise a ConfigError with a relative path, e.g. `ConfigError("lr", ...)`,
  to point at one field: it is prefixed with the section's path).

`to_data(obj)` is the way back: plain lists, dicts and scalars that `parse` accepts again.
"""

from __future__ import annotations

import dataclasses
import difflib
import enum
import functools
import math
import re
import types
import typing
from collections.abc import Mapping
from typing import Any, Iterable, TypeVar


__all__ = ["ConfigError", "parse", "check_keys", "to_data", "describe_type", "found", "shown", "cut_message"]

T = TypeVar("T")
_INT_LIMIT = 2 ** 63    # an integer setting fits a 64-bit integer (torch, numpy, MLflow and SQLite need it)
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")



def suggest(name: str, choices: Iterable[str], n: int = 3, cutoff: float = 0.5) -> str:
    """A ' Did you mean 'x', 'y'?' clause for an unknown name, or '' when nothing is close: the one
    did-you-mean of the package (config keys, formats, backends, sites, suites, gate files)."""
    close = difflib.get_close_matches(str(name), list(choices), n=n, cutoff=cutoff)
    return f" Did you mean {', '.join(repr(c) for c in close)}?" if close else ""

class ConfigError(ValueError):
    """A config, plan or gate file that cannot be used: the one error of every file lowprec
    reads. `path` says where (`rollout.thresholds.spike_sigmas`, `gates[1] (eval/x/acc).confidence`),
    `source` which file, when a message must name it (a gate file beside the config).

    str(e) == f"{path}: {message}" (f"{source}: {path}: {message}" with a source); the message
    says what was found, what is allowed, the fix."""

    def __init__(self, path: str, message: str, *, source: str = ""):
        path, message = cut_message(str(path), 300), cut_message(str(message), 1000)
        self.path, self.message, self.source = path, message, cut_message(str(source), 300)
        place = ": ".join(p for p in (self.source, path) if p) if self.source else path
        super().__init__(f"{place}: {message}" if place or not self.source else message)

    def under(self, prefix: str) -> "ConfigError":
        """This error with `prefix` in front of its path, unless it is already there."""
        p = self.path
        inside = not prefix or p == prefix or p.startswith((f"{prefix}.", f"{prefix}["))
        return ConfigError(p if inside else f"{prefix}.{p}" if p and not p.startswith("[") else f"{prefix}{p}",
                           self.message, source=self.source)

    def located(self, *, source: str | None = None, where: str | None = None) -> "ConfigError":
        """This error under `where` (`under`) and in the file `source` (unless it names one already)."""
        e = self.under(where) if where else self
        return ConfigError(e.path, e.message, source=e.source or source or "")


_QUOTED = re.compile(r"'([^'\s]{100,})'|\"([^\"\s]{100,})\"")   # no prose runs 100 characters unspaced


_LONG_WORD = re.compile(r"[^\s']{200,}")   # a file path is shorter; a pasted value may not be


def cut_message(text: str, limit: int) -> str:
    """`text` with every quoted run of over 100 characters without a space, and every bare run of
    over 200, cut to a prefix and its length; then, if still over `limit`, its head and tail:
    what a one-line refusal carries of a hostile value."""
    text = _QUOTED.sub(lambda m: f"'{(m.group(1) or m.group(2))[:40]}...' ({len(m.group(1) or m.group(2)):,} "
                                 f"characters)", text)
    text = _LONG_WORD.sub(lambda m: f"{m.group(0)[:60]}... ({len(m.group(0)):,} characters)", text)
    if len(text) <= limit:
        return text
    return f"{text[:limit * 2 // 3]} ... ({len(text):,} characters) ... {text[-limit // 4:]}"


class _Mismatch(Exception):
    """The value does not have the wanted type at this level (turned into a ConfigError by `_value`)."""

    def __init__(self, hint: str = ""):
        self.hint = hint


def found(v: Any) -> str:
    """`v` as an error message names it: `the string '3x'`, `the integer 3`, `null`."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return f"the boolean {str(v).lower()}"
    kind = {int: "the integer", float: "the number", str: "the string", list: "the list", tuple: "the list",
            dict: "the mapping"}.get(type(v), f"a {type(v).__name__}")
    return f"{kind} {shown(v)}"


def shown(v: Any, limit: int = 60) -> str:
    """`v` as a message quotes it: repr(v) for a string or any other value, or, past `limit`
    characters, a prefix and how long the whole is: `'aaaa...' (5000 characters)`. A message
    never carries a user's value whole: a file may hand lowprec megabytes."""
    text = repr(v)
    if len(text) <= limit:
        return text
    return f"{text[:max(limit - 25, 8)]}... ({len(text):,} characters)"


def _did_you_mean(v: Any, choices: list[str]) -> str:
    hint = suggest(v, choices) if isinstance(v, str) else ""
    return f".{hint}" if hint else ""


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) is typing.Union or isinstance(tp, types.UnionType)


def describe_type(tp: Any) -> str:
    """What a field of type `tp` takes, in words: `an integer or null`, `one of 'fast', 'full'`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp is object:
        return "any value"
    if tp is type(None):
        return "null"
    if isinstance(tp, type) and hasattr(tp, "config_description"):
        return tp.config_description
    if _is_union(tp):
        return " or ".join(describe_type(a) for a in sorted(args, key=lambda a: a is type(None)))
    if origin is typing.Literal:
        return f"one of {', '.join(repr(a) for a in args)}"
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return f"one of {', '.join(repr(m.value) for m in tp)}"
    if dataclasses.is_dataclass(tp):
        return f"a mapping with keys {', '.join(_init_fields(tp))}"
    if origin in (list, tuple) or tp in (list, tuple):
        item = args[0] if args else Any
        if origin is tuple and args and (len(args) != 2 or args[1] is not Ellipsis):
            return f"a list of {len(args)} items ({', '.join(describe_type(a) for a in args)})"
        return "a list" + ("" if item is Any else f" of {_plural(describe_type(item))}")
    if origin is dict or tp is dict:
        return "a mapping" + ("" if len(args) < 2 or args[1] is Any else f" of {_plural(describe_type(args[1]))}")
    return {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(
        tp, f"a {getattr(tp, '__name__', tp)}")


def _plural(words: str) -> str:
    return words[3:] + "s" if words.startswith("an ") else words[2:] + "s" if words.startswith("a ") else words


@functools.lru_cache(maxsize=None)
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def _init_fields(cls: type) -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(cls) if f.init}


def _convert(tp: Any, v: Any, path: str) -> Any:
    """`v` as a `tp`; _Mismatch if it is not one at this level, ConfigError from deeper levels."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp is object:
        return v
    if isinstance(tp, type) and hasattr(tp, "from_config_value"):   # a value type named by a string or a mapping
        if isinstance(v, tp):
            return v
        try:
            return tp.from_config_value(v)
        except ConfigError as e:
            raise e.under(path) from None
        except (ValueError, TypeError, KeyError) as e:
            raise _Mismatch(f": {str(e).strip(chr(34) + chr(39))}") from None
    if tp is type(None):
        if v is None:
            return None
        raise _Mismatch()
    if _is_union(tp):
        if v is None and type(None) in args:
            return None
        options, hints = [a for a in args if a is not type(None)], []
        for a in options:
            try:
                return _convert(a, v, path)
            except _Mismatch as m:
                hints.append(m.hint)
            except ConfigError:
                if len(options) == 1:
                    raise
        raise _Mismatch(next((h for h in hints if h), ""))
    if origin is typing.Literal:
        if any(v == a and type(v) is type(a) for a in args):
            return v
        raise _Mismatch(_did_you_mean(v, [str(a) for a in args]))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(v, tp):
            return v
        for m in tp:
            if v == m.value and type(v) is type(m.value):
                return m
        raise _Mismatch(_did_you_mean(v, [str(m.value) for m in tp]))
    if dataclasses.is_dataclass(tp) and isinstance(tp, type):
        if isinstance(v, tp):
            return v
        if not isinstance(v, Mapping):
            raise _Mismatch()
        return parse(tp, v, path)
    if origin in (list, tuple) or tp in (list, tuple):
        if not isinstance(v, (list, tuple)):
            raise _Mismatch("; write a list, e.g. [a, b]" if isinstance(v, str) else "")
        if origin is tuple and args and (len(args) != 2 or args[1] is not Ellipsis):  # tuple[A, B]
            if len(v) != len(args):
                raise _Mismatch(f" ({len(v)} items)")
            return tuple(_value(a, x, f"{path}[{i}]") for i, (a, x) in enumerate(zip(args, v)))
        item = args[0] if args else Any
        out = [_value(item, x, f"{path}[{i}]") for i, x in enumerate(v)]
        return tuple(out) if (origin or tp) is tuple else out
    if origin is dict or tp is dict:
        if not isinstance(v, Mapping):
            raise _Mismatch()
        kt, vt = args if len(args) == 2 else (Any, Any)
        return {_value(kt, k, f"{path}.{k}"): _value(vt, x, f"{path}.{k}") for k, x in v.items()}
    if tp is bool:
        if isinstance(v, bool):
            return v
        raise _Mismatch(" (write true or false, without quotes)" if isinstance(v, str) else "")
    if tp is int:
        return _integer(v)
    if tp is float:
        return _number(v)
    if tp is str:
        if isinstance(v, str):
            return v
        raise _Mismatch(f"; quote it: \"{v}\"" if isinstance(v, (int, float)) and not isinstance(v, bool) else "")
    if isinstance(tp, type) and isinstance(v, tp):
        return v
    raise _Mismatch()


def _integer(v: Any) -> int:
    """`v` as an int setting: an integer that fits 64 bits (a bool is no integer)."""
    if isinstance(v, int) and not isinstance(v, bool):
        if not -_INT_LIMIT <= v < _INT_LIMIT:
            raise _Mismatch(f" ({len(str(abs(v)))} digits): no setting needs an integer beyond 64 bits")
        return v
    if isinstance(v, float) and v.is_integer():
        raise _Mismatch(f"; write {int(v)}")
    if isinstance(v, str) and _NUMBER.fullmatch(v.strip()) and float(v).is_integer():
        raise _Mismatch(f"; write {int(float(v))}, without quotes")
    raise _Mismatch()


def _number(v: Any) -> float:
    """`v` as a float setting: a finite number, or a numeric string (PyYAML reads 3e-3, no dot, as one)."""
    x = None
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        x = float(v) if abs(v) < 1e308 else math.inf
    elif isinstance(v, str) and _NUMBER.fullmatch(v.strip()):
        x = float(v)
    if x is None:
        raise _Mismatch()
    if not math.isfinite(x):   # .inf, .nan, 1e400: no threshold, rate or size means that
        raise _Mismatch("; a setting is a finite number (leave the key out for its default)")
    return x


def _value(tp: Any, v: Any, path: str) -> Any:
    try:
        return _convert(tp, v, path)
    except _Mismatch as m:
        raise ConfigError(path, f"expected {describe_type(tp)}, found {found(v)}{m.hint}") from None


def check_keys(data: Any, allowed: list[str], path: str) -> Mapping:
    """`data` if it is a mapping whose keys are all in `allowed`; else a ConfigError (with a did-you-mean)."""
    if not isinstance(data, Mapping):
        raise ConfigError(path, f"expected a mapping with keys {', '.join(allowed)}, found {found(data)}")
    for k in data:
        if k not in allowed:
            raise ConfigError(f"{path}.{k}" if path else str(k),
                              f"unknown key {k!r}.{suggest(str(k), allowed)} Allowed keys: {', '.join(allowed)}.")
    return data


def parse(cls: type[T], data: Any, path: str) -> T:
    """A `cls` (a dataclass) from the mapping `data`, every field checked; ConfigError at `path` if not."""
    if isinstance(data, cls):
        return data
    fields = _init_fields(cls)
    check_keys(data, list(fields), path)
    missing = [n for n, f in fields.items() if n not in data and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        given = f"; it has {', '.join(map(str, data))}" if data else "; it is empty"
        raise ConfigError(f"{path}.{missing[0]}" if path else missing[0],
                          f"missing required key{'s' if len(missing) > 1 else ''} {', '.join(missing)}{given}")
    hints = _hints(cls)
    kwargs = {k: _value(hints[k], v, f"{path}.{k}" if path else k) for k, v in data.items()}
    try:
        return cls(**kwargs)
    except ConfigError as e:
        raise e.under(path) from None
    except (ValueError, TypeError) as e:
        raise ConfigError(path, str(e)) from None


def to_data(obj: Any) -> Any:
    """Plain YAML data (dicts, lists, scalars) for a parsed config: what `parse` reads back.

    An object with its own `to_dict()` gives that; other dataclasses give their init fields;
    enums their value; tuples become lists."""
    if hasattr(obj, "to_dict") and not isinstance(obj, type):
        return obj.to_dict()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {n: to_data(getattr(obj, n)) for n in _init_fields(type(obj))}
    if isinstance(obj, enum.Enum):
        return obj.value
    if isinstance(obj, (list, tuple)):
        return [to_data(x) for x in obj]
    if isinstance(obj, Mapping):
        return {k: to_data(v) for k, v in obj.items()}
    return obj
