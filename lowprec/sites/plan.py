"""PrecisionPlan: the `precision:` section of a training config, typed and validated.

    precision:
      backend: emulated        # emulated | torch | te
      default: bf16            # the format of every linear layer that no rule selects
      keep_high_precision: [{module_type: Embedding}, {fqns: [lm_head]}, {first_layers: 1}]
      rules:
        - {name: mlp_fp4, select: {glob: "blocks.*.mlp.*", last_layers: 2},   # keys AND together
           format: nvfp4, ladder: [nvfp4, fp8_tensorwise, bf16]}              # the fallback path

`PrecisionPlan.from_yaml` / `from_dict` turn strings into typed, frozen objects at once and
fail with the one parser's `ConfigError` (`lowprec.base.parse`, as every config section: also
importable as `PlanError`) whose `path` (`precision.rules[1].format`) says where, what was
found, the allowed values and a did-you-mean. `lowprec.sites.resolution.resolve(model, plan)` gives every
linear layer its format, ladder and reason and checks what needs the model.

* Precedence: keep_high_precision beats every rule; among rules the LAST match wins (as in
  CSS or torchtitan: general rules first, refinements after); otherwise `default`.
* Ladders rise strictly in `Format.bits`. The rule's format is prepended if it is not on
  the ladder and bf16 appended if missing, so every fallback ends in high precision; no
  ladder means `[format, bf16]`; a format out of order is an error. The rule's format may
  sit above the ladder's bottom (a site starting in bf16 that a rollout will promote).
* Blocks (`first_layers` / `last_layers`): the integer path component right after the
  outermost `nn.ModuleList` (or integer-keyed `nn.ModuleDict`) in the FQN, as in
  `h.3.mlp.c_fc` or `layers.3.mlp.up_proj`, counted in that container. Nested lists (MoE
  experts) do not count; modules outside any list (`lm_head`) are in no block.
* A rule that matches no linear layer is an error; a keep_high_precision selector only has
  to match some module (`{module_type: Embedding}` is fine). A rule whose layers all go to
  keep_high_precision or later rules is allowed.
"""

from __future__ import annotations

import fnmatch
import os
import re
from dataclasses import dataclass, field, replace
from typing import Any

import torch.nn as nn
import yaml

from lowprec.sites.backends import BACKEND_NAMES
from lowprec.sites.gemm_config import LinearGemmConfig
from lowprec.base.parse import ConfigError, parse, suggest
from lowprec.base.yaml_read import read_yaml_file, read_yaml_text
from lowprec.numerics.formats import FORMATS, Format
from lowprec.sites.amax_scope import DEFAULT_AMAX_SCOPE, AmaxScope
from lowprec.sites.reasons import ReasonKind, SiteReason
from lowprec.sites.site_kinds import SITE_KINDS, SiteKind, expert_index_of, kind_of

__all__ = ["PlanError", "ModelInfo", "Selector", "Rule", "PrecisionPlan", "SiteReason", "ReasonKind", "make_ladder",
           "selection_from_dict"]

BF16 = FORMATS["bf16"]
BACKENDS = BACKEND_NAMES
SELECTOR_KEYS = ("glob", "regex", "fqns", "first_layers", "last_layers", "module_type", "layers", "kind", "experts")
RULE_KEYS = ("name", "select", "format", "ladder")
PLAN_KEYS = ("backend", "default", "keep_high_precision", "rules", "fused", "amax_scope", "gemm")


# The plan's errors are the one parser's `ConfigError` (kept under this name for callers that catch it).
PlanError = ConfigError


def _expect(ok: bool, v: Any, path: str, wanted: str, hint: str = "") -> Any:
    """`v` if `ok`, else a PlanError naming the field, what was found and what is allowed."""
    if not ok:
        raise PlanError(path, f"expected {wanted}, found {type(v).__name__} {v!r}{hint}")
    return v


def _str(v: Any, path: str) -> str:
    return _expect(isinstance(v, str) and v != "", v, path, "a non-empty string")


@dataclass(frozen=True)
class ModelInfo:
    """What selectors need to know about a model: its modules by FQN and its block lists."""
    modules: dict[str, nn.Module]
    block_lists: dict[str, tuple[str, ...]]  # container FQN -> child keys in block order

    @classmethod
    def of(cls, model: nn.Module) -> "ModelInfo":
        modules, lists = dict(model.named_modules()), {}
        for fqn, m in modules.items():
            keys = [str(i) for i in range(len(m))] if isinstance(m, nn.ModuleList) else (
                list(m.keys()) if isinstance(m, nn.ModuleDict) else [])
            if keys and all(k.isdigit() for k in keys):
                lists[fqn] = tuple(sorted(keys, key=int))
        return cls(modules, lists)

    def block(self, fqn: str) -> tuple[int, int] | None:
        """(index, number of blocks) in the outermost block list on `fqn`'s path, or None."""
        parts = fqn.split(".")
        for i in range(len(parts)):
            keys = self.block_lists.get(".".join(parts[:i]))
            if keys is not None and parts[i] in keys:
                return keys.index(parts[i]), len(keys)
        return None


@dataclass(frozen=True)
class Selector:
    """Which modules a rule or keep_high_precision entry means; the given fields AND together.

    glob: fnmatch on the FQN (case-sensitive, `*` crosses dots); regex: re.fullmatch on the FQN;
    fqns: exactly these; first_layers / last_layers: inside the first / last N blocks; module_type:
    class name or dotted path of the module or of its parent, base classes included; layers: these
    block indices; kind: `experts`, `shared_experts`, `router` or `dense` (lowprec.sites.site_kinds);
    experts: these expert indices (expert sites only)."""
    glob: str | None = None
    regex: str | None = None
    fqns: tuple[str, ...] | None = None
    first_layers: int | None = None
    last_layers: int | None = None
    module_type: str | None = None
    layers: tuple[int, ...] | None = None
    kind: SiteKind | None = None
    experts: tuple[int, ...] | None = None
    _re: re.Pattern | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for key in [k for k in ("glob", "regex", "module_type") if getattr(self, k) is not None]:
            _str(getattr(self, key), key)
        if (v := self.fqns) is not None:  # a list is fine too (YAML gives one); it is kept as a tuple
            _expect(isinstance(v, (tuple, list)) and v and all(isinstance(n, str) and n for n in v), v, "fqns",
                    "a non-empty list of module FQNs", f"; write [{v}]" if isinstance(v, str) else "")
            object.__setattr__(self, "fqns", tuple(v))
        for key in ("first_layers", "last_layers"):
            if (v := getattr(self, key)) is not None:
                _expect(isinstance(v, int) and not isinstance(v, bool) and v >= 1, v, key,
                        "an integer >= 1 (a number of transformer blocks)")
        for key, what in (("layers", "block indices"), ("experts", "expert indices")):
            if (v := getattr(self, key)) is not None:
                _expect(isinstance(v, (tuple, list)) and v and all(isinstance(i, int) and not isinstance(i, bool)
                                                                    and i >= 0 for i in v), v, key,
                        f"a non-empty list of {what} (integers >= 0)", f"; write [{v}]" if isinstance(v, int) else "")
                object.__setattr__(self, key, tuple(v))
        if self.kind is not None and not isinstance(self.kind, SiteKind):
            if self.kind not in SITE_KINDS:
                raise PlanError("kind", f"unknown site kind {self.kind!r}.{suggest(str(self.kind), SITE_KINDS)} "
                                        f"Allowed: {', '.join(SITE_KINDS)}.")
            object.__setattr__(self, "kind", SiteKind(self.kind))
        if not self.to_dict():
            raise PlanError("", f"an empty selector selects nothing; give one or more of {', '.join(SELECTOR_KEYS)}")
        if self.regex is not None:
            try:
                object.__setattr__(self, "_re", re.compile(self.regex))
            except re.error as e:
                raise PlanError("regex", f"invalid regular expression {self.regex!r}: {e}") from None

    def to_dict(self) -> dict[str, Any]:
        """The given fields in canonical order, as YAML values (fqns as a list)."""
        return {k: list(v) if isinstance(v, tuple) else v.value if isinstance(v, SiteKind) else v
                for k in SELECTOR_KEYS if (v := getattr(self, k)) is not None}

    @staticmethod
    def _is_type(m: nn.Module | None, name: str) -> bool:
        return m is not None and any(name in (c.__name__, f"{c.__module__}.{c.__qualname__}")
                                     for c in type(m).__mro__ if c not in (nn.Module, object))

    def matches(self, fqn: str, module: nn.Module, info: ModelInfo | None = None) -> bool:
        """Whether the module at `fqn` is selected; `info` is needed for blocks and parents."""
        b = info.block(fqn) if info is not None else None
        parent = info.modules.get(fqn.rpartition(".")[0]) if info is not None and fqn else None
        return ((self.glob is None or fnmatch.fnmatchcase(fqn, self.glob))
                and (self._re is None or self._re.fullmatch(fqn) is not None)
                and (self.fqns is None or fqn in self.fqns)
                and (self.first_layers is None or (b is not None and b[0] < self.first_layers))
                and (self.last_layers is None or (b is not None and b[0] >= b[1] - self.last_layers))
                and (self.module_type is None or self._is_type(module, self.module_type)
                     or self._is_type(parent, self.module_type))
                and (self.layers is None or (b is not None and b[0] in self.layers))
                and (self.experts is None or expert_index_of(module) in self.experts)
                and (self.kind is None or kind_of(fqn, module, info.modules if info is not None else {}) is self.kind))

    def names(self, fqn: str, module: nn.Module, info: ModelInfo | None = None) -> bool:
        """Whether this selector names a router explicitly (`kind: router`, or its FQN in `fqns`):
        a router is a site a rule switches only then (lowprec.sites.site_kinds)."""
        return (self.kind is SiteKind.ROUTER or fqn in (self.fqns or ())) and self.matches(fqn, module, info)

    def describe(self) -> str:
        """E.g. `glob blocks.*.mlp.* and last_layers 2`, for the plan table's why column."""
        return " and ".join(f"{k} {', '.join(map(str, v)) if isinstance(v, list) else v}" for k, v in self.to_dict().items())


def selection_from_dict(d: Any, path: str = "selection") -> Selector:
    """A Selector from a `select:`-style mapping (the `rollout:` section reuses it), by the one parser."""
    return parse(Selector, d, path)


def make_ladder(fmt: Format, ladder: tuple[Format, ...] = ()) -> tuple[Format, ...]:
    """The normalized ladder: holds `fmt` (prepended if missing), ends with bf16, rank strictly
    increasing. `fmt` may sit above the bottom: a site that starts in bf16 with the ladder
    nvfp4 -> fp8_tensorwise -> bf16 is what a staged rollout promotes down that ladder."""
    out = tuple(ladder) if ladder and fmt in ladder else (fmt, *ladder)
    out = out if out[-1] == BF16 else (*out, BF16)
    for lo, hi in zip(out, out[1:]):
        if hi.bits <= lo.bits:
            raise PlanError("ladder", f"{' -> '.join(f.name for f in out)} is not ordered from low to high precision: "
                                      f"{hi.name} ({hi.bits} bits) comes after {lo.name} ({lo.bits} bits). "
                                      "Each step falls back to more bits (4 -> 8 -> 16); list each level once.")
    return out


@dataclass(frozen=True)
class Rule:
    """Layers that `select` matches run in `format` and fall back along `ladder` (normalized)."""
    select: Selector
    format: Format
    ladder: tuple[Format, ...] = ()
    name: str | None = None   # unnamed: the plan calls it by its place, `rules[i]`

    def __post_init__(self) -> None:
        if self.name is not None:
            _str(self.name, "name")
        object.__setattr__(self, "ladder", make_ladder(self.format, self.ladder))


@dataclass(frozen=True)
class PrecisionPlan:
    """The parsed `precision:` section (the module docstring says what wins over what)."""
    backend: str = "emulated"
    default: Format = BF16
    rules: tuple[Rule, ...] = ()
    keep_high_precision: tuple[Selector, ...] = ()
    fused: bool = False
    amax_scope: AmaxScope = DEFAULT_AMAX_SCOPE
    gemm: LinearGemmConfig = field(default_factory=LinearGemmConfig)   # the fast path's GEMMs

    def __post_init__(self) -> None:
        if not isinstance(self.amax_scope, AmaxScope):
            raise PlanError("amax_scope", f"amax_scope must be an AmaxScope, got {self.amax_scope!r}")
        if self.backend not in BACKENDS:
            raise PlanError("backend", f"unknown backend {self.backend!r}.{suggest(str(self.backend), BACKENDS)} "
                                       f"Allowed: {', '.join(BACKENDS)}.")
        named = tuple(r if r.name is not None else replace(r, name=f"rules[{i}]") for i, r in enumerate(self.rules))
        object.__setattr__(self, "rules", named)   # an unnamed rule is called by its place
        names = [r.name for r in named]
        for i, n in enumerate(names):
            if n in names[:i]:
                raise PlanError(f"rules[{i}].name", f"duplicate rule name {n!r}; rule names must be unique")

    @classmethod
    def from_dict(cls, d: Any, path: str = "precision") -> "PrecisionPlan":
        """Parse the contents of the `precision:` section (by the one parser, `lowprec.base.parse`);
        a rule without a name is called by its place, `rules[i]`."""
        return parse(cls, d, path)

    @classmethod
    def from_yaml(cls, source: str | os.PathLike) -> "PrecisionPlan":
        """From a YAML file (a path) or YAML text, with a top-level `precision:` section."""
        is_file = isinstance(source, os.PathLike) or ("\n" not in source and os.path.isfile(source))
        try:
            doc = read_yaml_file(source) if is_file else read_yaml_text(source)
        except ConfigError as e:   # one line that is not YAML of a mapping: a path, most likely
            hint = "" if is_file or "\n" in str(source) else " (if that is a file path, there is no such file)"
            raise PlanError(e.path, e.message + hint) from None
        if "precision" not in doc:
            raise PlanError("precision", f"no `precision:` section; found top-level keys {', '.join(map(str, doc))}")
        return cls.from_dict(doc["precision"])

    def to_dict(self) -> dict[str, Any]:
        return {"backend": self.backend, "default": self.default.name, "fused": self.fused,
                "amax_scope": self.amax_scope.value, "gemm": self.gemm.to_dict(),
                "keep_high_precision": [s.to_dict() for s in self.keep_high_precision],
                "rules": [{"name": r.name, "select": r.select.to_dict(), "format": r.format.name,
                           "ladder": [f.name for f in r.ladder]} for r in self.rules]}

    def to_yaml(self) -> str:
        return yaml.safe_dump({"precision": self.to_dict()}, sort_keys=False)
