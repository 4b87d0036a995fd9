"""The weight-quantization cache of `PrecisionLinear`: quantize a weight once per update.

A linear layer's weight is quantized in the forward (operand `weight`, fprop) and, for
scalings whose quantization is not layout-invariant, again transposed in the backward
(dgrad). Between two optimizer steps the weight does not change, so with gradient
accumulation every micro-batch repeats the same quantizations. `WeightCache` keeps the
last `Quantized` of each layout and returns it while nothing that changes the result
has changed; the numerics are bit for bit those of quantizing again, because a hit is
only ever returned for the same inputs to a deterministic function.

The key (`cache_key`) holds everything the quantization reads:

* the weight tensor's `_version`: in-place updates bump it (SGD and foreach AdamW steps,
  `load_state_dict`, the snapshot rewind, which is a `load_state_dict`, `copy_` under
  `no_grad`), and views share their base's counter;
* the number of `torch.optim` steps taken since the cache was made (its `OptimizerSteps`,
  given at construction: a counter the cache owns, counted by torch's step post-hook for as
  long as the counter lives): fused AdamW (`_fused_adamw_`) updates the weights without
  bumping `_version` (seen on torch 2.13), so any optimizer step of any
  `torch.optim.Optimizer` invalidates every entry; between the steps of gradient
  accumulation nothing does. No count lives in the module: two models, or two tests, never
  share one;
* the storage (`data_ptr`, storage offset), shape, strides, dtype and device: a new
  tensor behind the Parameter (`.to()`, FSDP's unsharded gather) is a miss;
* the operand's `QuantSpec` and the `fused` flag.

What is never cached (`cacheable` says False and the layer quantizes the weight on every call):

* delayed scaling: the scale comes from an amax history that the layer's own forward
  records into, so the scale moves between the forward and the backward and between
  micro-batches; reusing a quantization would change the numerics (Transformer Engine
  caches here and accepts the change; lowprec does not);
* stochastic rounding (it draws from the layer's generator) and Hadamard transforms;
* a weight whose amax is all-reduced over a mesh (a sharded DTensor weight): the
  collective must run on every rank in step.

Under `torch.compile` the cache is bypassed (`torch.compiler.is_compiling()`): Dynamo
cannot guard on `_version` or `data_ptr`, and a compiled graph re-quantizes in its own
fused kernels anyway.

Writes behind autograd's back are invisible: `p.data.copy_(...)` bumps the counter of
the `.data` alias, not the Parameter's. Code that writes weights that way must call
`PrecisionLinear.weight_cache.clear()` (nothing in lowprec does).

Statistics: an entry made on a check step (statistics on) carries the weight's
`QuantStats`, and a hit on a later check step returns those (the statistics of exactly
this quantization of this weight). A check step that finds an entry made without
statistics quantizes again with them and replaces the entry, so statistics are never
missing and never stale. Memory: one entry per layout, the FP32 grid values (plus the
FP8 storage form for the `torch` backend) until the weight next changes.
"""

from __future__ import annotations

import weakref

import torch

from lowprec.numerics.formats import QuantSpec, Rounding, Scaling
from lowprec.numerics.quantize import Quantized

__all__ = ["WeightCache", "OptimizerSteps", "cache_key", "cacheable"]


def cacheable(spec: QuantSpec | None) -> bool:
    """Whether a weight quantized with `spec` is a pure function of the weight."""
    return (spec is not None and spec.scaling is not Scaling.DELAYED
            and spec.rounding is Rounding.NEAREST_EVEN and not spec.hadamard)


class OptimizerSteps:
    """How many `torch.optim` steps (of any Optimizer) were taken since this object was made.
    It counts through torch's global step post-hook, registered for this object alone and
    removed when it is collected; a copy (`copy.deepcopy`, pickling) counts on its own."""

    def __init__(self):
        from torch.optim.optimizer import register_optimizer_step_post_hook
        self.count = 0
        ref = weakref.ref(self)

        def bump(optimizer, args, kwargs) -> None:
            me = ref()
            if me is not None:
                me.count += 1
        weakref.finalize(self, register_optimizer_step_post_hook(bump).remove)

    def __reduce__(self):
        return OptimizerSteps, ()


def cache_key(w: torch.Tensor, spec: QuantSpec, fused: bool, tag: str = "", steps: int = 0) -> tuple:
    """Everything that decides `quantize(w, spec)` besides the values themselves; steps: the
    cache's `OptimizerSteps.count`."""
    return (tag, steps, w._version, w.data_ptr(), w.storage_offset(), tuple(w.shape), w.stride(),
            w.dtype, w.device, spec, bool(fused))


class WeightCache:
    """The last quantization of each weight layout of one layer (see the module docstring)."""

    def __init__(self, enabled: bool = True, steps: OptimizerSteps | None = None):
        """steps: the optimizer-step counter of the entries' keys (shared by the caches of one
        layer; default: one of its own), which the layer's FP8 all-gather also reads."""
        self.enabled = bool(enabled)
        self.steps = steps if steps is not None else OptimizerSteps()
        self._entries: dict[str, tuple[tuple, Quantized]] = {}
        self.hits = 0     # plain counters, for tests and benchmarks
        self.misses = 0

    def key(self, w: torch.Tensor, spec: QuantSpec, fused: bool, tag: str = "") -> tuple:
        """`cache_key` at this cache's optimizer step count."""
        return cache_key(w, spec, fused, tag, self.steps.count)

    def clear(self) -> None:
        """Drop every entry (a format switch, a device move, or a write behind autograd)."""
        self._entries.clear()

    def get(self, slot: str, key: tuple, need_stats: bool) -> Quantized | None:
        """The cached quantization under `key`, or None (a miss); statistics as documented."""
        entry = self._entries.get(slot)
        if entry is None or entry[0] != key or (need_stats and entry[1].stats is None):
            self.misses += 1
            return None
        self.hits += 1
        return entry[1]

    def put(self, slot: str, key: tuple, q: Quantized, storage: bool = False) -> Quantized:
        """Keep `q` under `key` (replacing the slot's entry); with `storage`, also its FP8
        storage form, contiguous, so the `torch` backend does not cast it again per GEMM."""
        if storage and q.spec.element.torch_dtype is not None and q.storage is None:
            q.storage = q.values.to(q.spec.element.torch_dtype).contiguous()
        self._entries[slot] = (key, q)
        return q

    def __len__(self) -> int:
        return len(self._entries)
