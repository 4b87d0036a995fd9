"""The one YAML reader for what users hand lowprec: configs, gate files, suite files, task files.

A YAML file is data, and a hostile one can still cost memory, time or a traceback: a
1.5 KB alias bomb expands to ten million leaves, a file nested ten thousand levels deep
overflows Python's recursion, a second `train:` section silently replaces the first. Before
anything is built, `load_yaml` walks the file's event stream once (an iterative walk, no
recursion; libyaml's C parser where PyYAML has it) and refuses, as a `ConfigError` naming the
file and the key path:

* a file over `YamlLimits.max_bytes`;
* more than `max_nodes` values once aliases are expanded (an alias counts the whole value it
  repeats, so a bomb is caught after a few aliases, long before it is built);
* collections nested deeper than `max_depth`;
* a key that appears twice in one mapping, at any level (YAML would keep the last one).

Only then is the document constructed, with PyYAML's safe constructors (C loader where
installed) plus the tags a caller names (`tags={"!function": ...}` for lm-eval task files).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from lowprec.base.parse import ConfigError, found, shown

__all__ = ["YamlLimits", "LIMITS", "load_yaml", "read_yaml_file", "read_yaml_text"]


@dataclass(frozen=True)
class YamlLimits:
    """What one YAML file may hold. The defaults are far above any config, gate, suite or profile
    file lowprec writes or reads (the largest, a written per-module plan, is tens of KB)."""
    max_bytes: int = 4 << 20
    max_nodes: int = 100_000
    max_depth: int = 64


LIMITS = YamlLimits()
_MERGE = "<<"


def _loader_base() -> type:
    import yaml
    return getattr(yaml, "CSafeLoader", yaml.SafeLoader)   # libyaml's parser when PyYAML was built with it


_LOADERS: dict[tuple, type] = {}


def _loader(tags: Mapping[str, Callable[[Any], Any]]) -> type:
    """A safe loader class with `tags` added (each `constructor(scalar_text)`), made once per tag set."""
    key = tuple(sorted((t, id(f)) for t, f in tags.items()))
    if key not in _LOADERS:
        base = _loader_base()
        cls = type(f"Lowprec{base.__name__}", (base,), {})
        for tag, make in tags.items():
            cls.add_constructor(tag, lambda loader, node, make=make: make(loader.construct_scalar(node)))
        _LOADERS[key] = cls
    return _LOADERS[key]


class _Frame:
    """One open collection while the event stream is walked."""
    __slots__ = ("path", "anchor", "mapping", "size", "keys", "key", "index", "line")

    def __init__(self, path: str, anchor: str | None, mapping: bool, line: int):
        self.path, self.anchor, self.mapping, self.line = path, anchor, mapping, line
        self.size, self.keys, self.key, self.index = 1, {}, None, 0


def _child_path(frame: _Frame | None) -> str:
    if frame is None:
        return ""
    if frame.mapping:
        key = frame.key if frame.key is not None else "?"
        return f"{frame.path}.{key}" if frame.path else key
    return f"{frame.path}[{frame.index}]"


def _begin(frame: _Frame | None, key: str | None, line: int, origin: str) -> None:
    """A child value begins in `frame`: a sequence counts it; a mapping takes it as a key (checked
    against the keys before it) or as the value of the key before it."""
    if frame is None:
        return
    if not frame.mapping:
        frame.index += 1
    elif frame.key is None:
        name = key if key is not None else "?"
        if key is not None and key != _MERGE and key in frame.keys:
            name = key if len(key) <= 40 else shown(key, 40)
            path = f"{frame.path}.{name}" if frame.path else name
            raise ConfigError(path, f"appears twice in the same mapping ({origin}, lines {frame.keys[key]} and {line}); "
                                    f"YAML would keep only the last one and drop the other's keys: merge the two "
                                    f"into one")
        frame.keys.setdefault(name, line)
        frame.key = name if len(name) <= 40 else shown(name, 40)
    else:
        frame.key = None


def _check_events(events, origin: str, limits: YamlLimits) -> None:
    """Walk the event stream once: depth, expanded size and duplicate keys (see the module doc)."""
    import yaml

    stack: list[_Frame] = []
    sizes: dict[str, int] = {}     # anchor -> the expanded size of the value it names
    total = 0
    for ev in events:
        line = ev.start_mark.line + 1 if ev.start_mark is not None else 0
        top = stack[-1] if stack else None
        if isinstance(ev, (yaml.MappingStartEvent, yaml.SequenceStartEvent)):
            path = _child_path(top)
            _begin(top, None, line, origin)
            stack.append(_Frame(path, ev.anchor, isinstance(ev, yaml.MappingStartEvent), line))
            if len(stack) > limits.max_depth:
                raise ConfigError(path or origin, (
                    f"nests lists and mappings more than {limits.max_depth} levels deep ({origin}, line {line}); "
                    f"a lowprec file needs a handful: flatten it"))
            size = 0
        elif isinstance(ev, (yaml.MappingEndEvent, yaml.SequenceEndEvent)):
            done = stack.pop()
            if done.anchor is not None:
                sizes[done.anchor] = done.size
            if stack:
                stack[-1].size += done.size
            continue
        elif isinstance(ev, yaml.ScalarEvent):
            path = _child_path(top)
            _begin(top, ev.value, line, origin)
            if ev.anchor is not None:
                sizes[ev.anchor] = 1
            size = 1
        elif isinstance(ev, yaml.AliasEvent):
            path = _child_path(top)
            _begin(top, None, line, origin)
            size = sizes.get(ev.anchor, 1)
        else:
            continue
        total += size if size else 1
        if top is not None and size:
            top.size += size
        if total > limits.max_nodes:
            raise ConfigError(path or origin, (
                f"{origin} holds more than {limits.max_nodes:,} values once its aliases (*name) are expanded "
                f"(line {line}); a lowprec file is plain data: write each value out, or split the file"))


def _check_size(size: int, origin: str, limits: YamlLimits) -> None:
    if size > limits.max_bytes:
        raise ConfigError(origin, f"is {size:,} bytes; a lowprec YAML file is at most {limits.max_bytes:,} bytes "
                                  f"(configs, gate and suite files are a few KB): is this the right file?")


def load_yaml(text: str | bytes, origin: str = "<yaml>", *, tags: Mapping[str, Callable[[Any], Any]] | None = None,
              limits: YamlLimits = LIMITS) -> Any:
    """The document in `text`, checked as the module doc says; every problem a ConfigError naming `origin`."""
    import yaml

    _check_size(len(text.encode("utf-8", "replace") if isinstance(text, str) else text), origin, limits)
    loader = _loader(tags or {})
    try:
        _check_events(yaml.parse(text, Loader=loader), origin, limits)
        return yaml.load(text, Loader=loader)
    except yaml.constructor.ConstructorError as e:
        at = f", line {e.problem_mark.line + 1}" if e.problem_mark else ""
        raise ConfigError(origin, f"uses a YAML tag that safe loading refuses ({str(e.problem)[:200]}{at}); a "
                                  f"lowprec file is plain data: mappings, lists, strings, numbers") from None
    except yaml.MarkedYAMLError as e:
        at = f" at line {e.problem_mark.line + 1}, column {e.problem_mark.column + 1}" if e.problem_mark else ""
        what = "; ".join(str(p) for p in (e.context, e.problem) if p)
        raise ConfigError(origin, f"is not valid YAML{at}: {what[:300]}"
                                  f"; fix the file there (docs/config.md shows the shape)") from None
    except yaml.YAMLError as e:
        raise ConfigError(origin, f"is not valid YAML: {shown(' '.join(str(e).split()), 300)}") from None
    except RecursionError:   # not reached within max_depth; kept so that no input ends in a traceback
        raise ConfigError(origin, "nests too deeply to read; flatten it") from None


def read_yaml_file(path: str | Path, expected: str = "a mapping of sections") -> dict:
    """A config file's top-level mapping; every problem is a ConfigError naming the file: a
    folder or no file, an unreadable or non-UTF-8 file, and what `read_yaml_text` refuses."""
    p = Path(path)
    try:
        if not p.is_file():
            raise ConfigError(str(p), "is a folder, not a config file" if p.is_dir() else
                              "no such config file; give the path of a YAML file (e.g. "
                              "experiments/configs/default.yaml)")
        _check_size(p.stat().st_size, str(p), LIMITS)
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(str(p), f"cannot read the file: {shown(str(e), 300)}") from None
    return read_yaml_text(text, str(p), expected)


def read_yaml_text(text: str | bytes, origin: str = "<yaml>", expected: str = "a mapping of sections") -> dict:
    """YAML's top-level mapping, read by `load_yaml`; contents that are not a mapping are a
    ConfigError too (`expected` says what is)."""
    doc = load_yaml(text, origin)
    if not isinstance(doc, dict):
        raise ConfigError(origin, f"expected {expected}, found {found(doc)}")
    return doc
