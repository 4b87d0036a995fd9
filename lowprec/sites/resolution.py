"""Resolving a `PrecisionPlan` against a model: which modules are linear sites, what format,
ladder and reason each gets (`resolve`), why a selector matched nothing, and the plain-text
table of the result (`format_plan_table`). The plan itself (parsing, validation) is
`lowprec.sites.plan`; `prepare` (`lowprec.sites.precision_state`) calls `resolve`."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Callable

import torch.nn as nn

from lowprec.base.parse import suggest
from lowprec.numerics.formats import FORMATS, Format
from lowprec.numerics.quantize import check_layer_fits
from lowprec.sites.plan import BF16, ModelInfo, PlanError, PrecisionPlan, Selector, make_ladder
from lowprec.sites.reasons import ReasonKind, SiteReason
from lowprec.sites.site_kinds import SiteKind, expert_index_of, kind_of

__all__ = ["SitePlan", "resolve", "format_plan_table", "is_linear", "is_site", "linear_shape", "gemm_shapes"]


def is_linear(module: nn.Module, fqn: str = "") -> bool:
    """nn.Linear, or GPT-2's `Conv1D` (by name and `nf`: no transformers import; weight stored (in, out))."""
    return isinstance(module, nn.Linear) or (
        type(module).__name__ == "Conv1D" and hasattr(module, "nf") and hasattr(module, "weight"))


def is_site(module: nn.Module, fqn: str = "") -> bool:
    """A linear layer or one expert of a grouped-experts module (lowprec.sites.experts)."""
    return is_linear(module) or expert_index_of(module) is not None


def linear_shape(module: nn.Module) -> tuple[int, int]:
    """(out, in) of a linear-like module, whatever the layout its weight is stored in; for an
    expert (in = hidden size, out = its GEMMs' weights over that), what gives its FLOPs."""
    if expert_index_of(module) is not None:
        return module.out_features, module.in_features
    return (module.nf, module.weight.shape[0]) if type(module).__name__ == "Conv1D" else tuple(module.weight.shape[:2])


def gemm_shapes(module: nn.Module) -> list[tuple[int, int]]:
    """(out, in) of each weight whose GEMMs a site runs: one for a linear layer, one per projection
    for an expert."""
    return list(module.gemm_shapes) if expert_index_of(module) is not None else [linear_shape(module)]


@dataclass(frozen=True)
class SitePlan:
    """One linear layer: its format now, its fallback ladder, and why."""
    fqn: str
    module: nn.Module
    format: Format
    ladder: tuple[Format, ...]
    reason: SiteReason

    @property
    def shape(self) -> tuple[int, int]:
        return linear_shape(self.module)


def _no_match(path: str, what: str, noun: str, sel: Selector, candidates: dict, info: ModelInfo) -> PlanError:
    """Why `sel` matched nothing among `candidates`: each field's own count, and the nearest names."""
    counts = "; ".join(f"{a.describe()} alone matches {sum(a.matches(f, m, info) for f, m in candidates.items())}"
                       for a in (Selector(**{k: getattr(sel, k)}) for k in sel.to_dict()))
    hints = [f"{n!r} is not a module.{suggest(n, list(info.modules))}" for n in sel.fqns or () if n not in info.modules]
    if sel.module_type is not None:
        types = sorted({type(m).__name__ for m in info.modules.values()})
        hints.append(f"Module types in the model: {', '.join(types)}.{suggest(sel.module_type, types)}")
    if sel.first_layers is not None or sel.last_layers is not None:
        outer = [f"{f or '<root>'} ({len(k)} blocks)" for f, k in info.block_lists.items() if info.block(f) is None]
        hints.append(f"Block lists: {', '.join(outer)}." if outer else "The model has no ModuleList of blocks.")
    for pattern in (sel.glob, sel.regex):
        if pattern is not None:
            close = difflib.get_close_matches(pattern, list(candidates), n=3, cutoff=0.3)
            hints.append(f"{'Nearest' if close else 'Some'} FQNs: {', '.join(close or list(candidates)[:3])}.")
    return PlanError(path, f"{what} ({sel.describe()}) matches no {noun} ({counts}). {' '.join(hints)}")


def resolve(model: nn.Module, plan: PrecisionPlan, *, site_filter: Callable[[nn.Module, str], bool] = is_linear,
            supported: Callable[[Format], tuple[bool, str]] = lambda fmt: (True, "")) -> list[SitePlan]:
    """Every module that `site_filter(module, fqn)` accepts, with its format, ladder and reason. PlanError
    for a selector that matches nothing, a format `supported` refuses, a shape the blocks do not divide."""
    info = ModelInfo.of(model)
    linears = {f: m for f, m in info.modules.items() if site_filter(m, f)}
    if not linears:
        raise PlanError("model", f"{type(model).__name__} has no linear layers (nn.Linear or Conv1D) to plan")
    for i, sel in enumerate(plan.keep_high_precision):
        if not any(sel.matches(f, m, info) for f, m in info.modules.items()):
            raise _no_match(f"precision.keep_high_precision[{i}]", "keep_high_precision selector", "module", sel,
                            info.modules, info)
    planned, hit = [], set()  # (SitePlan, config path its format came from), rules that matched
    for fqn, m in linears.items():
        keep = next((s for s in plan.keep_high_precision if s.matches(fqn, m, info)), None)
        router = kind_of(fqn, m, info.modules) is SiteKind.ROUTER   # switched only by a rule that names it
        matching = [i for i, r in enumerate(plan.rules)
                    if (r.select.names(fqn, m, info) if router else r.select.matches(fqn, m, info))]
        hit.update(matching)
        if keep is not None:
            planned.append((SitePlan(fqn, m, BF16, (BF16,), SiteReason(ReasonKind.KEEP_HIGH_PRECISION, f"({keep.describe()})")), None))
        elif matching:
            r = plan.rules[matching[-1]]
            planned.append((SitePlan(fqn, m, r.format, r.ladder, SiteReason(ReasonKind.RULE, f"{r.name} ({r.select.describe()})")),
                            f"precision.rules[{matching[-1]}]"))
        elif router:
            planned.append((SitePlan(fqn, m, BF16, (BF16,), SiteReason(ReasonKind.DEFAULT, "(a router: no rule names it)")),
                            None))
        else:
            planned.append((SitePlan(fqn, m, plan.default, make_ladder(plan.default), SiteReason(ReasonKind.DEFAULT)), "precision.default"))
    for i, r in enumerate(plan.rules):
        if i not in hit:
            noun = "linear layer or expert" if any(expert_index_of(m) is not None for m in linears.values()) else \
                "linear layer"
            raise _no_match(f"precision.rules[{i}].select", f"rule {r.name!r}", noun, r.select, linears, info)
    runs = [n for n, f in FORMATS.items() if supported(f)[0]]
    for site, base in planned:
        for fmt in site.ladder if base is not None else ():
            path = base if base.endswith("default") else f"{base}.{'format' if fmt == site.format else 'ladder'}"
            ok, why = supported(fmt)
            if not ok:
                raise PlanError(path, f"backend {plan.backend!r} cannot run {fmt.name}: {why}. It runs: "
                                      f"{', '.join(runs) or 'nothing'}. Pick one of those or another backend.")
            try:
                for shape in gemm_shapes(site.module):
                    check_layer_fits(fmt, *shape, site.fqn)
            except ValueError as e:
                raise PlanError(path, f"{e} To keep only this layer out, add {{fqns: [{site.fqn}]}} "
                                      f"to precision.keep_high_precision.") from None
    return [site for site, _ in planned]


def format_plan_table(sites: list[SitePlan]) -> str:
    """A plain-text table: FQN, shape (out x in), format now, ladder, why."""
    rows = [("FQN", "shape (out x in)", "format", "ladder", "why")]
    rows += [(s.fqn, "%d x %d" % s.shape, s.format.name, " -> ".join(f.name for f in s.ladder), str(s.reason))
             for s in sites]
    widths = [max(len(r[c]) for r in rows) for c in range(5)]
    lines = ["  ".join(r[c].ljust(widths[c]) for c in range(5)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)
