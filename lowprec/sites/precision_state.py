"""`prepare(model, plan) -> PrecisionState`: swap linear layers in, then switch them at runtime.

`prepare` resolves the plan against the model (`lowprec.sites.resolution.resolve`), replaces every
linear layer that is not kept in high precision by a `PrecisionLinear` holding the same
Parameter objects, and returns the `PrecisionState` that knows every site: its FQN,
its current format and its ladder (the formats it may fall back through). Everything
the controller and the monitors do to the model goes through this object; there is no
global precision state anywhere.

`state_dict()` holds only strings, integers and tensors (formats by name, delayed-scaling
histories, stochastic-rounding generator states), so checkpoints load with
`torch.load(..., weights_only=True)`.
"""

from __future__ import annotations

import contextlib
from fractions import Fraction
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

from torch import nn

from lowprec.sites.backends import Backend, BackendName, SiteModule, get_backend
from lowprec.numerics.formats import FORMATS, Format, get_format
from lowprec.base.parse import suggest
from lowprec.sites.amax_scope import DEFAULT_AMAX_SCOPE
from lowprec.sites.shared_amax import SharedAmax
from lowprec.sites.layers import PrecisionLinear
from lowprec.sites.reasons import ReasonKind, SiteReason
from lowprec.numerics.quantize import check_layer_fits
from lowprec.sites.experts import experts_top_k, find_experts, unwrap_experts, wrap_experts
from lowprec.sites.flop_count import flops_share, other_gemms
from lowprec.sites.site_kinds import expert_index_of

__all__ = ["Site", "PrecisionState", "StagedPrecisionMap", "prepare"]

BF16 = FORMATS["bf16"]


@dataclass
class Site:
    """One switchable layer: where it is, what it runs in now, where it may fall back to."""

    fqn: str
    module: SiteModule          # PrecisionLinear, or the te / torchao backend's own site module
    ladder: tuple[Format, ...]
    reason: SiteReason = SiteReason(ReasonKind.DEFAULT)

    @property
    def format(self) -> Format:
        return self.module.format

    @property
    def flops_per_token(self) -> int | Fraction:
        """FLOPs of the three GEMMs per token (2 * in * out each); an expert's are weighted by the
        share of tokens routed to it when routing is even (lowprec.sites.experts)."""
        own = getattr(self.module, "flops_per_token", None)
        return own if own is not None else 6 * self.module.in_features * self.module.out_features


class PrecisionState:
    """The sites of a prepared model and their formats; switching never touches parameters."""

    def __init__(self, sites: Iterable[Site], backend: Backend,
                 kept_high_precision: Iterable[tuple[str, SiteReason]] = (),
                 other_gemms: dict[str, int | Fraction] | None = None):
        """other_gemms: FQN -> GEMM FLOPs per token of what runs no site (kept layers, a router
        that is no linear layer, experts a backend cannot switch): they run in high precision and
        count in the FLOP shares as `bf16` (`lowprec.sites.flop_count`)."""
        self.sites: dict[str, Site] = {s.fqn: s for s in sites}
        self.backend = backend
        self.kept_high_precision = dict(kept_high_precision)  # fqn -> reason, not swapped
        self.other_gemms = dict(other_gemms or {})

    # ------------------------------------------------------------------ queries
    def site(self, fqn: str) -> Site:
        try:
            return self.sites[fqn]
        except KeyError:
            raise KeyError(f"no precision site {fqn!r}.{suggest(fqn, list(self.sites))} "
                           f"{len(self.sites)} sites exist, e.g. {', '.join(list(self.sites)[:4])}") from None

    def formats(self) -> dict[str, str]:
        """fqn -> current format name (the precision map)."""
        return {fqn: s.format.name for fqn, s in self.sites.items()}

    def flops_share(self, formats: dict[str, str] | None = None) -> dict[str, float]:
        """Share of the model's GEMM FLOPs per format: every site's, and what runs no site
        (`other_gemms`, as `bf16`): one exact sum per format over the total, one rounding per share.
        formats: fqn -> format name to count instead of the sites' own (a pipeline rank's record
        of every stage's sites, whose layers it does not hold)."""
        return flops_share(self.sites, self.other_gemms, formats)

    def stats(self) -> dict[str, dict]:
        """fqn -> {role: QuantStats} from the last step (device tensors, no sync)."""
        return {fqn: dict(s.module.stats) for fqn, s in self.sites.items() if s.module.stats}

    # ------------------------------------------------------------------ switching
    def set_format(self, fqns: str | Iterable[str], fmt: Format | str) -> list[str]:
        """Switch sites to `fmt`; returns the FQNs that changed. Validates before changing any."""
        fmt = get_format(fmt)
        names = [fqns] if isinstance(fqns, str) else list(fqns)
        sites = [self.site(n) for n in names]
        ok, why = self.backend.supports(fmt)
        if not ok:
            raise ValueError(f"cannot switch {names[:3]} to {fmt.name}: {why}")
        for s in sites:  # the plan's check: weight, input and grad_output blocks
            for shape in getattr(s.module, "gemm_shapes", [(s.module.out_features, s.module.in_features)]):
                check_layer_fits(fmt, *shape, s.fqn)
        changed = []
        for s in sites:
            if s.format is not fmt:
                s.module.set_format(fmt)
                changed.append(s.fqn)
        return changed

    @contextlib.contextmanager
    def high_precision(self, fqns: Iterable[str] | None = None) -> Iterator[None]:
        """Run the same weights in bf16 inside the block; formats are restored on exit."""
        names = list(self.sites) if fqns is None else list(fqns)
        # a delayed-scaling site's amax history is part of its state: it comes back as it was
        saved = {n: (self.site(n).format, self.sites[n].module.histories) for n in names}
        bf16 = get_format("bf16")
        try:
            for n in names:
                self.sites[n].module.set_format(bf16)
            yield
        finally:
            for n, (f, histories) in saved.items():
                module = self.sites[n].module
                module.set_format(f)
                module.histories = histories

    def scaling_state(self) -> dict:
        """What a forward and backward change in the sites besides their statistics: the
        delayed-scaling amax histories and the stochastic-rounding generators (copies, small:
        no parameters). `load_scaling_state` puts them back, so that the same step can run
        again from the same scales and random draws (replays, the LR probe)."""
        return {fqn: ({k: h.state_dict() for k, h in s.module.histories.items()},
                      s.module.generator.get_state() if hasattr(s.module, "generator") else None)
                for fqn, s in self.sites.items()}

    def load_scaling_state(self, saved: dict) -> None:
        """Put back a `scaling_state()`; a site now in a format without a history (switched
        to high precision meanwhile) keeps none."""
        for fqn, (histories, generator) in saved.items():
            m = self.sites[fqn].module
            for k, h in histories.items():
                if k in m.histories:
                    m.histories[k].load_state_dict(h)
            if generator is not None:
                m.generator.set_state(generator)

    def collect_stats(self, enabled: bool) -> None:
        for s in self.sites.values():
            s.module.collect_stats = enabled

    @contextlib.contextmanager
    def collecting_stats(self, enabled: bool = False) -> Iterator[None]:
        """Quantize with statistics on or off inside the block (a replay, a window's judgment,
        the LR probe, a profile); on exit every site collects as it did before and holds the
        statistics it held (what ran inside feeds no monitor)."""
        saved = {n: (s.module.collect_stats, dict(s.module.stats)) for n, s in self.sites.items()}
        try:
            self.collect_stats(enabled)
            yield
        finally:
            for n, (on, stats) in saved.items():
                module = self.sites[n].module
                module.collect_stats, module.stats = on, stats

    # ------------------------------------------------------------------ persistence
    def state_dict(self) -> dict:
        out = {}
        for fqn, s in self.sites.items():
            m = s.module
            out[fqn] = {"format": m.format.name,
                        "histories": {k: h.state_dict() for k, h in m.histories.items()}}
            if hasattr(m, "generator"):  # TE sites keep their own RNG and FP8 state
                out[fqn]["generator"] = m.generator.get_state()
                out[fqn]["seed"] = m.seed  # also fixes the Hadamard signs
            if hasattr(m, "fast_calls"):   # forwards by GEMM path so far: a resumed run counts the whole run
                out[fqn]["calls"] = [int(m.fast_calls), int(m.slow_calls)]
        return {"version": 1, "sites": out}

    def load_state_dict(self, state: dict) -> None:
        if state.get("version") != 1:
            raise ValueError(f"unknown PrecisionState version {state.get('version')!r}; expected 1")
        missing = set(self.sites) - set(state["sites"])
        extra = set(state["sites"]) - set(self.sites)
        if missing or extra:
            raise ValueError(f"precision state does not match this model: missing sites "
                             f"{sorted(missing)[:5]}, unknown sites {sorted(extra)[:5]}; prepare "
                             f"the model with the plan the checkpoint was written with")
        for fqn, st in state["sites"].items():
            get_format(st["format"])  # validate every name before changing anything
            seed = getattr(self.sites[fqn].module, "seed", None)
            if "seed" in st and seed is not None and int(st["seed"]) != seed:
                raise ValueError(
                    f"site {fqn!r} was saved with seed {int(st['seed'])} but is prepared with seed {seed}: "
                    f"its Hadamard signs and stochastic rounding would differ. Call prepare(..., seed=...) "
                    f"with the seed of the run that wrote the checkpoint")
        for fqn, st in state["sites"].items():
            m = self.sites[fqn].module
            m.set_format(get_format(st["format"]))
            for k, h in st["histories"].items():
                m.histories[k].load_state_dict(h)
            if "generator" in st:
                m.generator.set_state(st["generator"])
            if "calls" in st and hasattr(m, "restore_calls"):   # absent in checkpoints written before it
                m.restore_calls(*st["calls"])

    def __repr__(self) -> str:
        share = ", ".join(f"{k} {v:.0%}" for k, v in self.flops_share().items())
        return f"PrecisionState({len(self.sites)} sites, backend={self.backend.name}, FLOPs: {share})"


class StagedPrecisionMap:
    """The whole model's precision map as a pipeline rank reports it (tracking, summaries, the
    progress line): every site's format as `current()` records it (the controller's record, the
    same on every rank) and the FLOP shares those formats give over the whole model's `state`,
    whose layers this rank does not all hold. A PrecisionState serves where one rank holds
    every site; this has its `formats()` and `flops_share()`."""

    def __init__(self, state: PrecisionState, current: Callable[[], dict[str, str]]):
        self.state, self.current = state, current

    def formats(self) -> dict[str, str]:
        return dict(self.current())

    def flops_share(self) -> dict[str, float]:
        return self.state.flops_share(self.current())


def _set_submodule(model: nn.Module, fqn: str, new: nn.Module) -> None:
    parent_name, _, child = fqn.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    setattr(parent, child, new)


def prepare(model: nn.Module, plan, *, amax_group=None, seed: int = 0,
            layer_cls: type[PrecisionLinear] | None = None) -> PrecisionState:
    """Swap the plan's linear layers for the backend's sites (same parameters) in place, and make
    every expert of a grouped-experts module a site (lowprec.sites.experts: the module keeps its
    Parameters; expert e of `model.layers.0.mlp.experts` is the site `model.layers.0.mlp.experts.e`).

    amax_group: the data-parallel process group over which tensor-wise amaxes of
        activations and gradients are reduced (so that the numerics equal a single
        process's); None for a single process or when that is not wanted. Used when the
        plan's `amax_scope` is `group`; with `local` each rank scales by its own amaxes.
    seed: base seed of each site's stochastic-rounding generator and Hadamard signs.
    layer_cls: a subclass of PrecisionLinear for the new layers (a framework's module protocol
        mixed in: `lowprec.integrations.torchtitan`), None for PrecisionLinear; the `te` and
        `torchao` backends make their own layers and refuse one.
    Every backend builds its sites through `Backend.make_site`.
    """
    from lowprec.sites.resolution import is_site, linear_shape, resolve  # imported here: keeps `import lowprec` light

    backend = get_backend(plan.backend)
    kind = BackendName(plan.backend)
    if kind is BackendName.TE:
        from lowprec.sites.backends.te import require_te
        require_te()
    if kind is BackendName.TORCHAO:
        from lowprec.sites.backends.torchao_backend import require_torchao
        require_torchao()
    if layer_cls is not None and kind in (BackendName.TE, BackendName.TORCHAO):
        raise ValueError(f"the {kind} backend makes its own layers; layer_cls={layer_cls.__name__} needs the "
                         f"emulated or torch backend")
    experts = _wrap_experts(model, backend, kind, plan, seed, amax_group)
    try:
        resolved = resolve(model, plan, supported=backend.supports, site_filter=is_site)
    except Exception:
        for fqn in experts:
            unwrap_experts(model.get_submodule(fqn))
        raise
    scope = getattr(plan, "amax_scope", DEFAULT_AMAX_SCOPE)
    shared = SharedAmax()   # one per model: the sites reading one SP input reduce its amax once
    sites, kept = [], []
    for i, sp in enumerate(resolved):
        if sp.reason.kept_high_precision:
            if expert_index_of(sp.module) is None:
                kept.append((sp.fqn, sp.reason))
                continue   # an expert kept high stays a site (its module is swapped already), in bf16 for good
        if expert_index_of(sp.module) is not None:
            sp.module.set_format(sp.format)
            sites.append(Site(sp.fqn, sp.module, tuple(sp.ladder), sp.reason))
            continue
        layer = backend.make_site(sp.module, sp.format, name=sp.fqn, seed=seed * 1_000_003 + i,
                                  amax_group=amax_group, amax_scope=scope, fused=plan.fused, gemm=plan.gemm,
                                  layer_cls=layer_cls, shared_amax=shared)
        _set_submodule(model, sp.fqn, layer)
        sites.append(Site(sp.fqn, layer, tuple(sp.ladder), sp.reason))
    kept_shapes = [(sp.fqn, linear_shape(sp.module)) for sp in resolved
                   if sp.reason.kept_high_precision and expert_index_of(sp.module) is None]
    unwrapped = {f: n for f, n in find_experts(model).items() if f not in experts}
    other = other_gemms(model, kept_shapes, unwrapped, {f: experts_top_k(model, f) for f in unwrapped})
    return PrecisionState(sites, backend, kept, other)


def _wrap_experts(model: nn.Module, backend, kind: BackendName, plan, seed: int, amax_group) -> dict[str, tuple]:
    """Make every grouped-experts module's experts sites (in bf16 until the plan is resolved), on
    the backends whose GEMMs lowprec runs (emulated, torch); the te and torchao backends leave
    them as they are, counted in the FLOP shares as high precision. FQN -> projections wrapped."""
    if kind not in (BackendName.EMULATED, BackendName.TORCH):
        return {}
    found = find_experts(model)
    for n, (fqn, names) in enumerate(found.items()):
        m = model.get_submodule(fqn)
        e = getattr(m, names[0]).shape[0]
        wrap_experts(m, fqn, names, [BF16] * e, backend, top_k=experts_top_k(model, fqn), amax_group=amax_group,
                     seeds=[seed * 1_000_003 + 700_001 + 1_000 * n + i for i in range(e)],
                     amax_scope=getattr(plan, "amax_scope", DEFAULT_AMAX_SCOPE), fused=plan.fused,
                     gemm=getattr(plan, "gemm", None))
    return found
