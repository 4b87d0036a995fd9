"""Gate files: which metrics gate a rollout, which way is better, how much worse is allowed.

    gates:
      - metric: eval/heldout_shakespeare/bits_per_byte
        direction: lower_is_better          # or higher_is_better
        max_regression: {relative: 0.02}    # or {absolute: 0.01}
        statistic: paired_bootstrap         # or stderr
        confidence: 0.95
        min_samples: 50
    defaults: {confidence: 0.95, bootstrap_samples: 2000, seed: 0}

`GateSpec.from_yaml(ref)` reads such a file (by path, or by the name of one that ships with this
package: `default`, `inloop`, `telemetry`; see `gate_file`) into frozen `lowprec.gates.gate.Gate` objects and checks it
all at load time: unknown keys (with a did-you-mean), a direction or statistic that does not
exist, a missing, negative or non-numeric tolerance, a confidence outside (0.5, 1), a metric
gated twice. Every gate goes through the one config parser (`lowprec.base.parse`, as every
section of a config), and every problem is its `ConfigError` (`GateSpecError` is the same class)
naming the file, the gate (index and metric) and the key, what was found, what is allowed and
how to fix it. `metric`, `direction` and `max_regression` are
required in every gate; `statistic`, `confidence`, `min_samples`, `bootstrap_samples` and
`seed` come from `defaults:` (or the built-in defaults below) unless a gate sets them.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

from lowprec.base.parse import ConfigError, check_keys, parse, suggest
from lowprec.base.yaml_read import load_yaml
from lowprec.gates.errors import GateSpecError, spec_error
from lowprec.gates.budget import ErrorBudget
from lowprec.gates.gate import PAIRED_BOOTSTRAP, Gate, Tolerance

__all__ = ["GateSpec", "GateSpecError", "gate_file", "gate_names", "is_gate_name", "BUILTIN_DEFAULTS", "TOP_KEYS",
           "GATE_KEYS", "DEFAULT_KEYS"]

BUILTIN_DEFAULTS: dict[str, Any] = {"statistic": PAIRED_BOOTSTRAP, "confidence": 0.95, "min_samples": 30,
                                    "bootstrap_samples": 2000, "seed": 0}
TOP_KEYS = ("gates", "defaults", "error_budget")
DEFAULT_KEYS = tuple(BUILTIN_DEFAULTS)
GATE_KEYS = ("metric", "direction", "max_regression") + DEFAULT_KEYS + ("informational", "noise", "bounds")
# a gate file's name (one shipped in this package): no folder, no suffix; anything else is a path
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")
# the package holding the shipped gate files: the repository's top-level gates/ folder, installed under lowprec
FILES = "lowprec.gates.files"


def gate_names() -> tuple[str, ...]:
    """The names of the gate files that ship with this package (its `*.yaml` files)."""
    return tuple(sorted(f.name.removesuffix(".yaml") for f in resources.files(FILES).iterdir()
                        if f.name.endswith(".yaml")))


def is_gate_name(ref: str | os.PathLike) -> bool:
    """Whether `ref` names a shipped gate file (`default`) rather than giving a path (`./g.yaml`)."""
    return isinstance(ref, str) and _NAME.fullmatch(ref) is not None


def gate_file(ref: str | os.PathLike) -> "Path | Traversable":
    """The gate file `ref` means: a shipped one by name (`default`, `inloop`, ...: a word with no
    `/` and no `.`), found through the package (importlib.resources), or a path as given. An
    unknown name is a GateSpecError listing the names; a path that is not a file is checked by
    `GateSpec.from_yaml`."""
    if not is_gate_name(ref):
        return Path(ref)
    names = gate_names()
    if ref not in names:
        raise spec_error(f"no gate file named {ref!r} ships with lowprec.{suggest(ref, names)} The named gate "
                            f"files are: {', '.join(names)}; give one of these names, or the path of a gate file "
                            f"of your own (e.g. ./my_gates.yaml, see docs/gates.md)")
    return resources.files(FILES) / f"{ref}.yaml"   # a Path where the package is installed as files


REQUIRED = ("metric", "direction", "max_regression")
EXAMPLE = ("gates:\n  - metric: eval/heldout_shakespeare/bits_per_byte\n    direction: lower_is_better\n"
           "    max_regression: {relative: 0.02}")


def _gate(d: Any, defaults: Mapping[str, Any]) -> Gate:
    """One gate, its missing settings from `defaults`, by the one config parser (`lowprec.base.parse`)."""
    if not isinstance(d, Mapping):
        raise spec_error(f"each gate must be a mapping with metric, direction and max_regression, got "
                         f"{type(d).__name__} {d!r}. For example:\n{EXAMPLE}")
    check_keys(d, list(GATE_KEYS), "")
    for k in REQUIRED:
        if d.get(k) is None:
            raise spec_error(f"is required (every gate says which metric, which way is better and how much "
                             f"worse is allowed). For example:\n{EXAMPLE}", key=k)
    return parse(Gate, {**defaults, **d}, "")


def _defaults(d: Any) -> dict[str, Any]:
    if d is None:
        return dict(BUILTIN_DEFAULTS)
    if not isinstance(d, Mapping):
        raise spec_error(f"must be a mapping such as {{confidence: 0.95, bootstrap_samples: 2000, seed: 0}}, "
                            f"got {type(d).__name__}", where="defaults")
    try:
        check_keys(d, list(DEFAULT_KEYS), "")
        out = {**BUILTIN_DEFAULTS, **d}
        # Checked here (with a placeholder gate) so that an error points at `defaults:`.
        Gate("placeholder", "lower_is_better", Tolerance("absolute", 0.0), **out)
    except GateSpecError as e:
        raise e.located(where="defaults") from None
    return out


@dataclass(frozen=True)
class GateSpec:
    """A gate file: its gates, in order, and where it came from (`source`, for messages)."""

    gates: tuple[Gate, ...]
    source: str = "<gates>"
    error_budget: ErrorBudget | None = None   # the in-loop gate's budget over a run's checks (lowprec.gates.budget)

    def __post_init__(self):
        if not self.gates:
            raise spec_error(f"has no gates; add at least one under `gates:`. For example:\n{EXAMPLE}",
                                source=self.source)
        seen: dict[str, int] = {}
        for i, g in enumerate(self.gates):
            if not isinstance(g, Gate):
                raise spec_error(f"must be a Gate, got {type(g).__name__}", where=f"gates[{i}]", source=self.source)
            if g.metric in seen:
                raise spec_error(f"gates {g.metric!r} again (gates[{seen[g.metric]}] already does); keep one "
                                    f"gate per metric", where=f"gates[{i}] ({g.metric})", key="metric",
                                    source=self.source)
            seen[g.metric] = i
        object.__setattr__(self, "gates", tuple(self.gates))

    @property
    def metrics(self) -> list[str]:
        return [g.metric for g in self.gates]

    def gate(self, metric: str) -> Gate:
        for g in self.gates:
            if g.metric == metric:
                return g
        raise KeyError(f"{self.source} has no gate on {metric!r}.{suggest(metric, self.metrics)}")

    def with_overrides(self, **changes) -> "GateSpec":
        """Every gate with the given fields replaced (e.g. `confidence=0.99`), validated again."""
        return GateSpec(tuple(replace(g, **changes) for g in self.gates), self.source, self.error_budget)

    @classmethod
    def from_dict(cls, d: Any, source: str = "<gates>") -> "GateSpec":
        """From the parsed YAML mapping (`{gates: [...], defaults: {...}}`)."""
        if not isinstance(d, Mapping):
            raise spec_error(f"must hold a mapping with a `gates:` list, found {type(d).__name__}. "
                                f"For example:\n{EXAMPLE}", source=source)
        try:
            check_keys(d, list(TOP_KEYS), "")
        except ConfigError as e:
            raise e.located(source=source) from None
        defaults = _located(lambda: _defaults(d.get("defaults")), source, "")
        raw = d.get("gates")
        if not isinstance(raw, list) or not raw:
            raise spec_error(f"must be a non-empty list of gates, found {raw!r}. For example:\n{EXAMPLE}",
                                key="gates", source=source)
        gates = []
        for i, g in enumerate(raw):
            metric = g.get("metric") if isinstance(g, Mapping) else None
            where = f"gates[{i}]" + (f" ({metric})" if isinstance(metric, str) else "")
            gates.append(_located(lambda g=g: _gate(g, defaults), source, where))
        budget = None
        if d.get("error_budget") is not None:
            budget = _located(lambda: ErrorBudget.from_dict(d["error_budget"]), source, "error_budget")
        return cls(tuple(gates), source, budget)

    @classmethod
    def from_yaml(cls, path: str | os.PathLike) -> "GateSpec":
        """Read and check a gate file, by path or by name (`gate_file`); GateSpecError on any
        problem, naming the file."""
        p = gate_file(path)
        if not _is_file(p):
            raise spec_error(f"gate file {str(p)!r} does not exist" + (" (it is a folder)" if p.is_dir() else "")
                                + f"; pass the path of a YAML file, or the name of one that ships with lowprec "
                                f"({', '.join(gate_names())})")
        try:
            d = load_yaml(p.read_text(encoding="utf-8"), str(p))
        except ConfigError as e:   # the one reader's refusal: bad YAML, a bomb, duplicate keys, too deep
            raise spec_error(e.message, source=str(p), key="" if e.path == str(p) else e.path) from None
        except (OSError, UnicodeDecodeError) as e:
            raise spec_error(f"cannot be read: {e}", source=str(p)) from None
        return cls.from_dict(d, source=str(p))


def _is_file(p) -> bool:
    try:
        return p.is_file()
    except OSError:   # a name too long for the file system, a folder that cannot be searched: not a file
        return False


def _located(fn, source: str, where: str):
    try:
        return fn()
    except GateSpecError as e:
        raise e.located(source=source, where=where) from None
