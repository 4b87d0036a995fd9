"""The precision-switchable linear layer.

`PrecisionLinear` replaces an `nn.Linear` (or a Hugging Face GPT-2 `Conv1D`, whose
weight is stored transposed) and holds the *same* Parameter objects, so an optimizer
built before the swap keeps working and switching format never allocates parameters.
It subclasses `nn.Linear` so that tensor-parallel styles (ColwiseParallel /
RowwiseParallel) and FSDP2 treat it as the linear layer it is.

Its format can change at any step (`set_format`). In a low-precision format, the
forward and backward run as Transformer Engine runs them, three GEMMs each with
quantized operands and FP32 accumulation (`lowprec.sites.quantized_gemms` runs them with
the `OperandQuantizer` this layer hands it for the call, `lowprec.sites.operand_quantizer`):

    fprop  y  = x  @ w^T      operands (input, weight)
    dgrad  dx = dy @ w        operands (grad_output, weight^T)
    wgrad  dw = dy^T @ x      operands (grad_output_wgrad, input_wgrad), K = tokens

Every operand is quantized along the GEMM's reduction dimension (the last dimension
of the 2-D view), so 1x128, MX and NVFP4 blocks follow the right axis in each GEMM.
The statistics of input, weight and grad_output are kept as device tensors in
`layer.stats` for the monitors. In `bf16`, operands are rounded to BF16 and the GEMM
accumulates in FP32 (BF16 arithmetic is emulated; on a BF16 model it is a no-op).

Distributed (`amax_scope`, `lowprec.sites.amax_scope`): with `group`, a tensor-wise amax
is the amax of the whole tensor: a DTensor shard's is all-reduced (MAX) over the mesh
dimensions it is sharded on, and activations/gradients are also reduced over `amax_group`
(the data-parallel group) when one is given, so the numerics equal a single process's;
with `local` (the default) each rank scales its own shards, and a sequence-parallel input
gathered in FP8 has its amax reduced once for all the sites reading it (`shared_amax`, the
model's `lowprec.sites.shared_amax.SharedAmax`). In the `torch` backend's FP8 formats both
run the fast path (`lowprec.sites.fp8_parallel`); `fast_calls` / `slow_calls` count the
eager forward calls on the fast path and on `QuantizedLinearFn`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.numerics.delayed import AmaxHistory, static_address
from lowprec.numerics.formats import Format, Scaling
from lowprec.numerics.hadamard import RandomHadamard
from lowprec.numerics.quant_stats import QuantStats
from lowprec.sites.amax_scope import DEFAULT_AMAX_SCOPE, AmaxScope
from lowprec.sites.shared_amax import SharedAmax
from lowprec.sites.fp8_allgather import FP8GatheredWeight, unwrap
from lowprec.sites.fp8_parallel import parallel_fast_linear
from lowprec.sites.fp8_linear import (NO_HISTORY, DelayedTensors, FastRecipe, FP8LinearFn, InputForms, WeightForms,
                                      cast_input_and_weight, cast_weight, delayed_state, fast_recipe, step_recipes)
from lowprec.sites.gemm_config import LinearGemmConfig
from lowprec.sites.operand_quantizer import OPERAND_OF, OPERANDS, OperandQuantizer, bf16_round
from lowprec.sites.quantized_gemms import QuantizedLinearFn
from lowprec.sites.weight_cache import WeightCache

__all__ = ["PrecisionLinear", "linear_weight_view"]

_FAST_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def linear_weight_view(module: nn.Module) -> torch.Tensor:
    """The (out, in) weight of an nn.Linear or a transformers Conv1D (stored (in, out))."""
    return module.weight.t() if type(module).__name__ == "Conv1D" else module.weight


def _generator(device: torch.device, seed: int) -> torch.Generator:
    """The stochastic-rounding generator of a layer on `device`; a CPU one for a layer on the
    meta device (it is replaced when the layer is materialized, `PrecisionLinear._apply`)."""
    return torch.Generator(device="cpu" if device.type == "meta" else device).manual_seed(seed)


class PrecisionLinear(nn.Linear):
    """A linear layer whose GEMMs run in a switchable `Format` on a given backend."""

    def __init__(self, weight: nn.Parameter, bias: nn.Parameter | None, fmt: Format, backend, *,
                 fqn: str = "", transposed_weight: bool = False, seed: int = 0,
                 amax_group=None, emulate_bf16: bool = True, fused: bool = False,
                 cache_weights: bool = True, amax_scope: AmaxScope = DEFAULT_AMAX_SCOPE,
                 gemm: LinearGemmConfig | None = None, shared_amax: SharedAmax | None = None):
        nn.Module.__init__(self)
        out_f, in_f = (weight.shape[1], weight.shape[0]) if transposed_weight else weight.shape
        self.in_features, self.out_features = int(in_f), int(out_f)
        self.weight = weight  # the same Parameter objects: no copy, no new allocation
        self.bias = bias
        self.fqn = fqn
        self.transposed_weight = transposed_weight
        self.backend = backend
        self.amax_group = amax_group
        self.amax_scope = amax_scope
        # the model's one SharedAmax (lowprec.sites.shared_amax): an SP input's amax reduced once
        # for all the sites that read that input; None: each site reduces its own
        self.shared_amax = shared_amax
        # eager forward calls on the FP8 fast path / on QuantizedLinearFn in a low-precision format
        self.fast_calls = 0
        self.slow_calls = 0
        self.emulate_bf16 = emulate_bf16
        self.fused = fused
        self.collect_stats = True
        # the weight's quantizations, reused until the weight changes (lowprec.sites.weight_cache)
        self.weight_cache = WeightCache(cache_weights)
        self.seed = int(seed)
        self.generator = _generator(weight.device, self.seed)
        self.hadamard = RandomHadamard(self.seed)
        self.stats: dict[str, QuantStats] = {}
        # steps, since the monitor last read them, in which a delayed-scaling operand (input,
        # weight, grad_output) saturated past twice the format's max while full statistics
        # were off: one tiny device op
        # per such operand, so a one-step overflow between checks is not missed
        self.overflow_steps = static_address(torch.zeros(len(OPERANDS), dtype=torch.float64, device=weight.device))
        self.histories: dict[str, AmaxHistory] = {}
        self.gemm = gemm or LinearGemmConfig()   # the fast path's three GEMMs (lowprec.sites.gemm_config)
        self.format = fmt
        self._fast = self._fast_recipes(fmt)
        self._reset_histories()

    def _fast_recipes(self, fmt: Format) -> tuple[FastRecipe, FastRecipe] | None:
        """The fast-path recipes (without statistics, check step) when the backend has a fast
        path and `fmt` is one of its formats: decided here, once per format, not per call."""
        recipe = fast_recipe(fmt, self.gemm) if getattr(self.backend, "fast_path", False) else None
        return None if recipe is None else step_recipes(recipe)

    def restore_calls(self, fast: int, slow: int) -> None:
        """Set the forward counters to a checkpoint's (`PrecisionState.load_state_dict`): a
        resumed run's counts are the whole run's (lowprec.runtime.trainer.site_paths)."""
        self.fast_calls, self.slow_calls = int(fast), int(slow)

    @classmethod
    def from_module(cls, module: nn.Module, fmt: Format, backend, **kw) -> "PrecisionLinear":
        transposed = type(module).__name__ == "Conv1D"
        return cls(module.weight, module.bias, fmt, backend, transposed_weight=transposed, **kw)

    def _apply(self, fn, recurse=True):
        """`.to(device)`, `.cuda()`, `to_empty(device=...)`: the layer's device-side state (the
        between-check overflow counts, the delayed-scaling histories, the stochastic-rounding
        generator) follows the weight. A layer built on the meta device (a model built before
        its weights exist, as torchtitan does) starts that state fresh when it is materialized."""
        super()._apply(fn, recurse)
        self.weight_cache.clear()
        dev, old = self.weight.device, self.overflow_steps.device
        if dev != old:
            if old.type == "meta":
                self.overflow_steps = static_address(torch.zeros_like(self.overflow_steps, device=dev))
                self._reset_histories()
            else:
                self.overflow_steps = static_address(self.overflow_steps.to(dev))
                for h in self.histories.values():
                    h.to(dev)
            self.generator = _generator(dev, self.seed)   # a generator cannot change device: reseeded
        return self

    # ------------------------------------------------------------------ format switching
    def set_format(self, fmt: Format) -> None:
        """Switch to `fmt`. Parameters are untouched; a delayed-scaling history starts fresh."""
        if fmt is self.format:
            return
        self.format = fmt
        self._fast = self._fast_recipes(fmt)
        self.stats = {}
        self.weight_cache.clear()
        self._reset_histories()

    def _reset_histories(self) -> None:
        self.histories = {}
        cfg = self.format.delayed
        if cfg is None:
            return
        for role, spec in self.format.specs().items():
            key = OPERAND_OF[role]
            if spec.scaling is Scaling.DELAYED and key not in self.histories:
                self.histories[key] = AmaxHistory(cfg, spec.element, self.weight.device)

    # ------------------------------------------------------------------ forward
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # a weight FSDP2 gathered in high precision (lowprec.sites.fp8_allgather) as the plain tensor it holds
        w = self.weight.t() if self.transposed_weight else unwrap(self.weight)
        if self.format.is_high_precision:
            if self.emulate_bf16 and x.dtype == torch.float32:
                b = None if self.bias is None else bf16_round(self.bias)
                return F.linear(bf16_round(x), bf16_round(w), b)
            return F.linear(x, w, self.bias)
        counted = not torch.compiler.is_compiling()   # a compiled graph keeps no host counter
        # the counters are plain ints: updated in the instance dict, not through Module.__setattr__'s
        # parameter/buffer/module checks (about 1.3 us a call)
        counters = self.__dict__
        if self._fast is not None and self._on_fast_path(x, w):
            counters["fast_calls"] += counted
            return _fast_linear(self, x, w, self._fast[1 if self.collect_stats else 0])
        if self._fast is not None and x.dtype in _FAST_DTYPES and w.dtype in _FAST_DTYPES:
            counters["fast_calls"] += counted
            return parallel_fast_linear(self, x, w, self._fast[1 if self.collect_stats else 0], _weight_casts,
                                        _delayed)
        counters["slow_calls"] += counted
        return QuantizedLinearFn.apply(x, w, self.bias, self.format, self.operand_quantizer())

    def _on_fast_path(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        """Plain tensors with no amax reduction over a group (lowprec.sites.fp8_linear); DTensor
        shards and data-parallel amaxes take `lowprec.sites.fp8_parallel`."""
        local = self.amax_group is None or self.amax_scope is AmaxScope.LOCAL
        if local and type(x) is torch.Tensor and type(w) is nn.Parameter:
            return x.dtype in _FAST_DTYPES and w.dtype in _FAST_DTYPES   # the common case, in few checks
        return (local and not hasattr(x, "to_local") and not hasattr(w, "to_local")
                and x.dtype in _FAST_DTYPES and w.dtype in _FAST_DTYPES)

    def operand_quantizer(self) -> OperandQuantizer:
        """What `QuantizedLinearFn` needs of this layer for one call: its settings now, and the
        holders the quantizations update in place (this layer's own `stats`, `histories`,
        `overflow_steps` and `weight_cache`; lowprec.sites.operand_quantizer)."""
        return OperandQuantizer(self.fqn, self.backend, self.stats, self.histories, self.overflow_steps,
                                self.weight_cache, self.generator, self.hadamard, amax_group=self.amax_group,
                                amax_scope=self.amax_scope, collect_stats=self.collect_stats,
                                emulate_bf16=self.emulate_bf16, fused=self.fused)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={self.format.name}, "
                f"backend={getattr(self.backend, 'name', self.backend)}")


def _delayed(layer: PrecisionLinear, operand: str, recipe: FastRecipe) -> DelayedTensors:
    if not recipe.delayed:
        return NO_HISTORY
    h = layer.histories[operand]
    return DelayedTensors(h.history, h.count, h.scratch, h.ticket)


def _weight_forms(layer: PrecisionLinear, w: torch.Tensor, recipe: FastRecipe, x: torch.Tensor | None = None,
                  hist_x: DelayedTensors = NO_HISTORY) -> tuple[WeightForms, InputForms | None]:
    """The weight's FP8 casts (both layouts), from the layer's weight cache when the weight
    has not changed since (tensor-wise and row-wise; delayed scaling casts every time). Given
    the input `x` (and its delayed state `hist_x` under delayed scaling), a weight that must
    be cast is cast with it in one launch where the pair runs (`cast_input_and_weight`), and
    the input's casts come back too (else None)."""
    if isinstance(w, FP8GatheredWeight) and w.fp8:   # FSDP2 gathered its FP8 bytes (lowprec.sites.fp8_allgather)
        return w.forms(), None
    cache = layer.weight_cache
    # not under torch.compile (a graph casts in its own kernels) nor inside a CUDA-graph
    # capture: a replay runs no Python, so a hit at capture would replay stale casts
    use_cache = (cache.enabled and not recipe.delayed and not torch.compiler.is_compiling()
                 and not (w.is_cuda and torch.cuda.is_current_stream_capturing()))
    if use_cache:
        # one slot: the key holds the weight's shape and strides
        key = cache.key(w, layer.format.weight, True, tag="fast")
        hit = cache.get("fast", key, need_stats=recipe.stats)
        if hit is not None:
            return hit, None
    hist_w = _delayed(layer, "weight", recipe)
    # x's transpose exactly when FP8LinearFn's `needs_input_grad[1]` asks for it: that follows
    # w.requires_grad, under torch.no_grad too (where no backward runs, but the function checks)
    both = None if x is None else cast_input_and_weight(x, w, recipe, hist_x, hist_w, layer.overflow_steps,
                                                        w.requires_grad)
    if both is None:
        x_forms, forms = None, cast_weight(w, recipe, hist_w, layer.overflow_steps)
    else:
        x_forms, forms = both
    if use_cache:
        cache.put("fast", key, forms)
    return forms, x_forms


def _weight_casts(layer: PrecisionLinear, w: torch.Tensor, recipe: FastRecipe) -> WeightForms:
    """`_weight_forms` of the weight alone (what `parallel_fast_linear` asks for)."""
    return _weight_forms(layer, w, recipe)[0]


def _fast_linear(layer: PrecisionLinear, x: torch.Tensor, w: torch.Tensor, recipe: FastRecipe) -> torch.Tensor:
    """The layer's forward on the fast path (`FP8LinearFn` on tensors and the step's recipe,
    one of `step_recipes`); statistics into `layer.stats` on check steps."""
    stats = recipe.stats
    hist_x = _delayed(layer, "input", recipe)   # looked up once: the pair and FP8LinearFn's state both take it
    forms, x_forms = _weight_forms(layer, w, recipe, x, hist_x)
    # the output gradient's statistics are copied into this buffer by the backward; under
    # torch.compile AOTAutograd refuses a forward input written by the backward, so a compiled
    # check step reports the input's and the weight's statistics only
    grad_stats = (torch.zeros(len(QuantStats.FIELDS), dtype=torch.float64, device=x.device)
                  if stats and torch.is_grad_enabled() and not torch.compiler.is_compiling() else None)
    state = (delayed_state(layer.overflow_steps, hist_x, _delayed(layer, "grad_output", recipe))
             if recipe.delayed else ())
    y, stats_x = FP8LinearFn.apply(x, w, layer.bias, forms.q, forms.scale_inv, forms.q_t,
                                   forms.scale_inv_t if recipe.rowwise else None, grad_stats, recipe, x_forms, *state)
    if stats:
        layer.stats["input"] = QuantStats(stats_x if x_forms is None else x_forms.stats)
        layer.stats["weight"] = forms.stats
        if grad_stats is not None:
            layer.stats["grad_output"] = QuantStats(grad_stats)
    return y
