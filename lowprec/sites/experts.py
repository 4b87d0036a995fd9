"""Grouped experts as sites: each expert of a fused-experts module is its own switchable site.

Two layouts are found (`find_experts`), both with 3-D parameters holding every expert:

* transformers 5's fused experts (Qwen3-MoE, Mixtral, what shares their layout):
  `gate_up_proj` (E, 2I, H) and `down_proj` (E, H, I), called as
  `experts(hidden_states, top_k_index, top_k_weights)`;
* torchtitan 0.3's `GroupedExperts` (deepseek_v3, qwen3): `w1_EFD`, `w3_EFD` (E, F, D) and
  `w2_EDF` (E, D, F), called with the routed tokens grouped by expert and their counts.

`wrap_experts` keeps the module object and its Parameters (nothing is reallocated, the
state_dict keys do not change): it swaps the module's class for a subclass whose forward runs
every projection through `GroupedQuantizedFn` (lowprec.sites.grouped_gemms), one grouped GEMM
per format group, and adds one `ExpertSite` child per expert, named by its index: the site of
expert 3 of `model.layers.0.mlp.experts` is `model.layers.0.mlp.experts.3`. An `ExpertSite`
is what `PrecisionState` switches and the monitors read (`SiteModule`): its format, its
statistics (the operands of all its GEMMs, merged as a check window merges steps), its
delayed-scaling histories, `tokens`, the tokens routed to it in the last forward, and
`fast_calls` / `slow_calls`, its projections' forwards in a low-precision format that ran the
grouped FP8 kernel on a GPU (the `torch` backend, lowprec.sites.grouped_scaled_mm) or the
emulated grouped GEMM, as a linear site counts its forwards.
`unwrap_experts` restores the module as it was.
"""

from __future__ import annotations

from fractions import Fraction

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.numerics.delayed import AmaxHistory
from lowprec.numerics.formats import Format, Scaling
from lowprec.numerics.hadamard import RandomHadamard
from lowprec.numerics.quant_stats import QuantStats
from lowprec.sites.amax_scope import DEFAULT_AMAX_SCOPE, AmaxScope
from lowprec.sites.gemm_config import LinearGemmConfig
from lowprec.sites.grouped_gemms import GroupedQuantizedFn
from lowprec.sites.grouped_scaled_mm import kernel_for, on_kernel
from lowprec.sites.operand_quantizer import OPERAND_OF, OPERANDS, OperandQuantizer
from lowprec.sites.weight_cache import OptimizerSteps, WeightCache

__all__ = ["ExpertSite", "MergedStats", "find_experts", "wrap_experts", "unwrap_experts", "experts_top_k"]

HF_PROJECTIONS = ("gate_up_proj", "down_proj")
TITAN_PROJECTIONS = ("w1_EFD", "w3_EFD", "w2_EDF")


class MergedStats(dict):
    """role -> QuantStats where a second write of a role merges with the first (max amax, summed
    counts), as a check window merges steps: an expert's input is the input of each of its GEMMs."""

    def __setitem__(self, role: str, st: QuantStats) -> None:
        old = self.get(role)
        if old is not None:
            p = old.packed.clone()
            p[:1] = torch.maximum(p[:1], st.packed[:1])
            p[1:] += st.packed[1:]
            st = QuantStats(p)
        super().__setitem__(role, st)


class GeneratorGroup:
    """The stochastic-rounding generators of an expert's GEMMs as one: `get_state` / `set_state`."""

    def __init__(self, generators: list[torch.Generator]):
        self.generators = generators

    def get_state(self) -> torch.Tensor:
        return torch.stack([g.get_state() for g in self.generators])

    def set_state(self, state: torch.Tensor) -> None:
        for g, s in zip(self.generators, state):
            g.set_state(s.clone())


class ExpertSite(nn.Module):
    """One expert of a grouped-experts module (see the module docstring). Holds no parameter."""

    def __init__(self, index: int, shapes: dict[str, tuple[int, int]], fmt: Format, backend, *, fqn: str,
                 seed: int = 0, top_k: int = 1, num_experts: int = 1, device=None, amax_group=None,
                 amax_scope: AmaxScope = DEFAULT_AMAX_SCOPE, fused: bool = False,
                 gemm: LinearGemmConfig | None = None):
        super().__init__()
        self.expert_index, self.fqn, self.backend, self.seed = int(index), fqn, backend, int(seed)
        self.shapes = dict(shapes)                       # projection -> (out, in) of its weight
        self.in_features = next(iter(shapes.values()))[1]
        self.out_features = sum(o * i for o, i in shapes.values()) // self.in_features
        self.routed_fraction = Fraction(top_k, num_experts)
        self.amax_group, self.amax_scope, self.fused = amax_group, amax_scope, fused
        self.collect_stats, self.tokens, self._window_tokens = True, 0, 0
        self.gemm = gemm or LinearGemmConfig()   # the grouped kernel's use_fast_accum per GEMM
        self.fast_calls = self.slow_calls = 0
        self.stats = MergedStats()
        device = device if device is not None and torch.device(device).type != "meta" else "cpu"
        # a plain attribute, not a buffer: `model.to(torch.bfloat16)` must not change its dtype
        self.overflow_steps = torch.zeros(len(OPERANDS), dtype=torch.float64, device=device)
        gens = [torch.Generator(device=device).manual_seed(self.seed * 8 + i) for i in range(len(shapes))]
        self.generator = GeneratorGroup(gens)
        self._gens = dict(zip(shapes, gens))
        self._hadamard = {p: RandomHadamard(self.seed * 8 + i) for i, p in enumerate(shapes)}
        steps = OptimizerSteps()   # one counter for the module's caches
        self._caches = {p: WeightCache(True, steps) for p in shapes}
        self._histories: dict[str, dict[str, AmaxHistory]] = {}
        self.format = fmt
        self._reset_histories()

    def _apply(self, fn, recurse=True):
        """`.to(device)`, `to_empty(device=...)`: the overflow counters move with the model (dtype
        kept), the delayed-scaling histories start fresh there and the stochastic-rounding generators are reseeded on its device
        (a generator cannot change device), as `PrecisionLinear` does."""
        old = self.overflow_steps.device
        super()._apply(fn, recurse)
        dev = fn(torch.zeros(0, device=old)).device   # where the model's tensors went
        if dev != old:
            self.overflow_steps = torch.zeros_like(self.overflow_steps, device=dev)
            gens = [torch.Generator(device=dev).manual_seed(self.seed * 8 + i) for i in range(len(self.shapes))]
            self.generator, self._gens = GeneratorGroup(gens), dict(zip(self.shapes, gens))
            for c in self._caches.values():
                c.clear()
            self._reset_histories()
        return self

    @property
    def flops_per_token(self) -> Fraction:
        """The expert's three GEMMs per token of the model: 6 * out * in per projection, times the
        share of tokens an expert receives when routing is even (top_k / experts)."""
        return 6 * sum(o * i for o, i in self.shapes.values()) * self.routed_fraction

    @property
    def gemm_shapes(self) -> list[tuple[int, int]]:
        return list(self.shapes.values())

    @property
    def histories(self) -> dict[str, AmaxHistory]:
        """`projection.operand` -> AmaxHistory over all its GEMMs (delayed scaling only)."""
        return {f"{p}.{k}": h for p, hs in self._histories.items() for k, h in hs.items()}

    @histories.setter
    def histories(self, value: dict[str, AmaxHistory]) -> None:
        self._histories = {p: {} for p in self.shapes}
        for key, h in value.items():
            p, _, k = key.rpartition(".")
            self._histories[p][k] = h

    def _reset_histories(self) -> None:
        self._histories = {p: {} for p in self.shapes}
        cfg = self.format.delayed
        if cfg is None:
            return
        for p in self.shapes:
            for role, spec in self.format.specs().items():
                if spec.scaling is Scaling.DELAYED and OPERAND_OF[role] not in self._histories[p]:
                    self._histories[p][OPERAND_OF[role]] = AmaxHistory(cfg, spec.element, self.overflow_steps.device)

    def routed(self, count: int) -> None:
        """`count` tokens were routed to this expert in this forward; on check steps (statistics
        on) they add to the check window's count that `take_tokens` hands the monitor."""
        self.tokens = int(count)
        if self.collect_stats:
            self._window_tokens += int(count)

    def restore_calls(self, fast: int, slow: int) -> None:
        """Set the forward counters to a checkpoint's, as `PrecisionLinear.restore_calls`."""
        self.fast_calls, self.slow_calls = int(fast), int(slow)

    def take_tokens(self) -> int:
        """The tokens routed to this expert since the last call (statistics steps only); resets."""
        n, self._window_tokens = self._window_tokens, 0
        return n

    def set_format(self, fmt: Format) -> None:
        """Switch to `fmt`; the parent's Parameters are untouched, a delayed history starts fresh."""
        if fmt is self.format:
            return
        self.format = fmt
        self.stats = MergedStats()
        for c in self._caches.values():
            c.clear()
        self._reset_histories()

    def operand_quantizer(self, projection: str) -> OperandQuantizer:
        """The quantizer of this expert's `projection` GEMMs for one call: its own holders."""
        return OperandQuantizer(f"{self.fqn}.{projection}", self.backend, self.stats, self._histories[projection],
                                self.overflow_steps, self._caches[projection], self._gens[projection],
                                self._hadamard[projection], amax_group=self.amax_group, amax_scope=self.amax_scope,
                                collect_stats=self.collect_stats, emulate_bf16=True, fused=self.fused)

    def forward(self, y: torch.Tensor) -> torch.Tensor:
        """The expert's output rows (its last projection's, before the routing weights), unchanged:
        its grouped-experts module passes them through here when hooks are registered on the
        site (the monitor's non-finite count, an injected fault), so hooks see the expert alone."""
        return y

    def extra_repr(self) -> str:
        return f"expert={self.expert_index}, format={self.format.name}, shapes={self.shapes}"


def _projections(module: nn.Module) -> tuple[str, ...] | None:
    """The layout of a fused-experts module: its projections' names, or None if it is none."""
    for names in (HF_PROJECTIONS, TITAN_PROJECTIONS):
        ps = [getattr(module, n, None) for n in names]
        if all(isinstance(p, nn.Parameter) and p.dim() == 3 for p in ps) and len({p.shape[0] for p in ps}) == 1:
            if names == HF_PROJECTIONS and (getattr(module, "gate_up_proj_bias", None) is not None
                                            or getattr(module, "is_transposed", False)):
                return None   # gpt-oss's transposed, biased layout: not switchable (docs/moe.md)
            return names
    return None


def find_experts(model: nn.Module) -> dict[str, tuple[str, ...]]:
    """FQN -> projection names of every fused-experts module (both layouts) in `model`."""
    return {fqn: names for fqn, m in model.named_modules() if (names := _projections(m)) is not None}


def experts_top_k(model: nn.Module, fqn: str) -> int:
    """Experts per token of the experts at `fqn`: the `top_k` of a router beside them (HF's
    `gate`, torchtitan's `router`), else the model config's `num_experts_per_tok`, else 1."""
    parts = fqn.split(".")
    for depth in range(len(parts) - 1, 0, -1):
        for m in model.get_submodule(".".join(parts[:depth])).modules():
            if isinstance(getattr(m, "top_k", None), int):
                return m.top_k
    return int(getattr(getattr(model, "config", None), "num_experts_per_tok", 1) or 1)


class _Experts:
    """The forward every wrapped experts module shares: each projection through the grouped GEMMs."""

    _lowprec_names: tuple[str, ...] = ()

    def _local_sites(self) -> list[ExpertSite]:
        """The sites of the experts this rank holds, in order. Under expert parallelism the 3-D
        weights are DTensors sharded along the experts (torchtitan's EP: `Shard(0)` over the `ep`
        mesh): the rank runs experts [offset, offset + local) of the global E, so the sites of
        those global indices; every rank keeps every expert's site (the plan's, the same on every
        rank), and the others' stay idle there (no tokens, no statistics: zero rows in the
        monitor's all-gather)."""
        sites = self._lowprec_sites
        w = getattr(self, self._lowprec_names[0])
        if not hasattr(w, "to_local") or w.to_local().shape[0] == len(sites):
            return sites
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
        shape, offset = compute_local_shape_and_global_offset(w.shape, w.device_mesh, w.placements)
        return sites[offset[0]:offset[0] + shape[0]]

    def _project(self, name: str, x: torch.Tensor, counts: tuple[int, ...], sites: list[ExpertSite]) -> torch.Tensor:
        w = getattr(self, name)
        w = w.to_local() if hasattr(w, "to_local") else w
        kernel = kernel_for(sites[0].backend, w.device)
        if not torch.compiler.is_compiling():   # a compiled graph keeps no host counter
            for s, c in zip(sites, counts):
                if c and not s.format.is_high_precision:
                    s.__dict__["fast_calls" if on_kernel(kernel, s.format, "fprop", w.shape) else "slow_calls"] += 1
        # one quantization call per operand for a format group's experts where launches cost (a GPU);
        # expert by expert on a CPU, the same numbers and faster there (cache locality, docs/moe.md)
        one_call = w.device.type != "cpu"
        return GroupedQuantizedFn.apply(x.reshape(-1, x.shape[-1]), w, counts, tuple(s.format for s in sites),
                                        tuple(s.operand_quantizer(name) for s in sites), one_call, kernel,
                                        sites[0].gemm.fast_accum())

    @staticmethod
    def _routed(counts: tuple[int, ...], sites: list[ExpertSite]) -> None:
        for s, c in zip(sites, counts):
            s.routed(c)

    @staticmethod
    def _through_sites(y: torch.Tensor, counts: tuple[int, ...], sites: list[ExpertSite]) -> torch.Tensor:
        """The last projection's rows through each expert site's hooks (`ExpertSite.forward`);
        `y` itself when no site has a hook (no call per expert)."""
        if not any(s._forward_hooks or s._forward_pre_hooks for s in sites):
            return y
        parts, start = [], 0
        for s, c in zip(sites, counts):
            if c:
                parts.append(s(y[start:start + c]))
            start += c
        return torch.cat(parts) if parts else y

    @property
    def _lowprec_sites(self) -> list[ExpertSite]:
        return [m for m in self.children() if isinstance(m, ExpertSite)]


class _HFExperts(_Experts):
    """transformers 5's fused experts: route, group the tokens by expert, run, weight, combine."""

    _lowprec_names = HF_PROJECTIONS

    def forward(self, hidden_states, top_k_index, top_k_weights):
        sites = self._local_sites()
        n = self.gate_up_proj.shape[0]
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        order = order[flat[order] < n]                   # index n: a token dropped (expert parallelism)
        token = order // top_k_index.shape[-1]
        counts = tuple(torch.bincount(flat[order], minlength=n).tolist())
        self._routed(counts, sites)
        x = hidden_states[token]
        gate, up = self._project("gate_up_proj", x, counts, sites).chunk(2, dim=-1)
        y = self._through_sites(self._project("down_proj", self.act_fn(gate) * up, counts, sites), counts, sites)
        y = y * top_k_weights.reshape(-1)[order, None].to(y.dtype)
        return torch.zeros_like(hidden_states).index_add_(0, token, y.to(hidden_states.dtype))


class _TitanExperts(_Experts):
    """torchtitan's GroupedExperts: tokens arrive grouped by expert with their counts (under expert
    parallelism: the tokens of every rank for this rank's experts, `_local_sites`)."""

    _lowprec_names = TITAN_PROJECTIONS

    def forward(self, x_RD, num_tokens_per_expert_E):
        sites = self._local_sites()
        counts = tuple(int(c) for c in num_tokens_per_expert_E.tolist())
        self._routed(counts, sites)
        h = F.silu(self._project("w1_EFD", x_RD, counts, sites)) * self._project("w3_EFD", x_RD, counts, sites)
        return self._through_sites(self._project("w2_EDF", h, counts, sites), counts, sites).type_as(x_RD)


_CLASSES: dict[type, type] = {}


def wrap_experts(module: nn.Module, fqn: str, names: tuple[str, ...], formats: list[Format], backend, *,
                 seeds: list[int], top_k: int, amax_group=None, amax_scope: AmaxScope = DEFAULT_AMAX_SCOPE,
                 fused: bool = False, gemm: LinearGemmConfig | None = None) -> list[ExpertSite]:
    """Make `module` (at `fqn`, with projections `names`) run its experts as sites, in place."""
    base = type(module)
    mixin = _HFExperts if names == HF_PROJECTIONS else _TitanExperts
    cls = _CLASSES.setdefault(base, type(f"Precision{base.__name__}", (mixin, base), {"_lowprec_base": base}))
    first = getattr(module, names[0])
    shapes = {n: tuple(getattr(module, n).shape[1:]) for n in names}
    sites = [ExpertSite(e, shapes, formats[e], backend, fqn=f"{fqn}.{e}", seed=seeds[e], top_k=top_k,
                        num_experts=first.shape[0], device=first.device, amax_group=amax_group,
                        amax_scope=amax_scope, fused=fused, gemm=gemm) for e in range(first.shape[0])]
    for s in sites:
        module.add_module(str(s.expert_index), s)
    module.__class__ = cls
    return sites


def unwrap_experts(module: nn.Module) -> None:
    """Undo `wrap_experts`: the original class, no site children."""
    base = getattr(type(module), "_lowprec_base", None)
    if base is None:
        return
    for name in [n for n, m in module.named_children() if isinstance(m, ExpertSite)]:
        delattr(module, name)
    module.__class__ = base
