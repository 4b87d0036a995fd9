"""FP8 all-gather of weights under FSDP2: each rank sends its weight shard's FP8 bytes.

FSDP2 all-gathers a parameter's shards before the module that holds it runs; a sharded
tensor with `fsdp_pre_all_gather` / `fsdp_post_all_gather` decides what is sent and what
the module receives (the protocol of `torch.distributed.fsdp.fully_shard`; torchao's
float8 all-gather is built on it). `FP8AllGatherWeight` is such a shard for a
`PrecisionLinear` whose format runs the fast path with tensor-wise scales:

* pre-all-gather: the shard is cast to FP8 with the scale of the *whole* weight (its
  amax all-reduced over the shard group), so the gathered bytes are exactly one
  process's cast of the whole weight; the scale goes along as metadata. On a check step
  (`collect_stats`) the shard's statistics go along too (the monitor sums them over ranks).
* post-all-gather: the module gets `FP8GatheredWeight`, a tensor of the weight's shape
  and dtype holding the FP8 bytes and the scale; the layer's fast path uses them as its
  weight forms (`forms()`), and the weight's gradient is an ordinary high-precision tensor
  that FSDP2 reduce-scatters as usual.
* the amaxes: `refresh(model)` takes every FP8-gathered weight's amax in one all-reduce
  (over the weight's amax group: the shard group under FSDP2, every rank of the mesh under
  FSDP2 x TP and HSDP, so each rank's scale is the whole weight's) once the weights have changed (after the optimizer step; torchao's
  `precompute_float8_dynamic_scale_for_fsdp` is the model; the engine runs it before
  every forward of the root, and it skips weights whose version has not changed); a
  pre-all-gather that finds no amax takes its own all-reduce.
* a site whose format is not tensor-wise FP8 on the fast path (a fallback to BF16, a
  replay in high precision, row-wise or delayed scaling) gathers the high-precision shard;
  `refresh` switches a weight between the two when its site's format changes (FSDP2 keeps
  its gather buffers per parameter, so they are dropped and made again).

Under FSDP2 x TP the weight is a DTensor sharded over tp whose local tensor is the
`FP8AllGatherWeight`; FSDP2 shards that local tensor over dp and gathers it back, and wraps
the `FP8GatheredWeight` (the tp shard's bytes) in the tp DTensor again, which
`lowprec.sites.fp8_parallel` unwraps to run the local GEMM on those bytes.

The optimizer, `state_dict` and checkpoints see the high-precision shard: every op other
than the layout ones FSDP2 uses runs on the plain tensor inside (and returns plain
tensors). `lowprec.runtime.fsdp_fp8` swaps the weights in before `fully_shard` and runs
`refresh` as a forward pre-hook of the root (`FullyShardedDP(fp8_all_gather=True)`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor, nn

from lowprec.numerics.formats import QuantSpec, Scaling
from lowprec.numerics.fp8_ops import ELEMENTS
from lowprec.numerics.quant_stats import QuantStats
from lowprec.numerics.quantize import quantize
from lowprec.sites.fp8_linear import WeightForms

__all__ = ["FP8AllGatherWeight", "FP8GatheredWeight", "gathers_fp8", "fp8_gather_dtype"]

# the ops FSDP2 builds and moves shards with keep the wrapper; everything else (the optimizer's
# arithmetic, `zeros_like` for its state) works on, and returns, plain tensors
_LAYOUT_OPS = {torch.ops.aten.new_zeros.default, torch.ops.aten.slice.Tensor,
               torch.ops.aten.copy_.default, torch.ops.aten.view.default, torch.ops.aten.as_strided.default,
               torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default, torch.ops.aten.split.Tensor,
               torch.ops.aten.clone.default, torch.ops.aten.detach.default, torch.ops.aten.alias.default}


def gathers_fp8(site) -> bool:
    """Whether `site` (a PrecisionLinear) gathers its weight in FP8: tensor-wise FP8 on the fast path."""
    fast = getattr(site, "_fast", None)
    return fast is not None and fast[0].scaling is Scaling.TENSOR and not site.transposed_weight


def fp8_gather_dtype(site) -> torch.dtype | None:
    """The FP8 dtype `site`'s weight is all-gathered in under `fp8_all_gather` (None: its high-precision dtype)."""
    return ELEMENTS[site._fast[0].fwd].torch_dtype if gathers_fp8(site) else None


def _wrapper(cls, t: Tensor):
    return Tensor._make_wrapper_subclass(cls, t.size(), strides=t.stride(), storage_offset=t.storage_offset(),
                                         dtype=t.dtype, layout=t.layout, device=t.device,
                                         requires_grad=t.requires_grad)


class FP8AllGatherWeight(Tensor):
    """A weight shard that FSDP2 all-gathers as FP8 when its site runs tensor-wise FP8."""

    @staticmethod
    def __new__(cls, tensor: Tensor, site, group=None):
        return _wrapper(cls, tensor)

    def __init__(self, tensor: Tensor, site, group=None):
        self._tensor = tensor
        self._site = site
        self._group = group                   # the amax all-reduce's group; None: FSDP2's shard group
        self._amax: Tensor | None = None      # the whole weight's amax, from `refresh`
        self._amax_version = None             # the parameter's versions it was taken at
        self._fp8 = gathers_fp8(site)         # the mode FSDP2's gather buffers are set up for

    def set_mode(self, fp8: bool) -> bool:
        """Gather FP8 (True) or high precision from the next gather; True when the mode changed."""
        changed, self._fp8 = fp8 != self._fp8, fp8
        return changed

    def amax_stale(self, version) -> bool:
        """Whether this shard's weight changed (`version`) since its amax was last taken."""
        return self._amax is None or self._amax_version != version

    def local_amax(self) -> Tensor:
        """This shard's finite amax (FP32), to be all-reduced into the whole weight's."""
        return torch.where(torch.isfinite(self._tensor), self._tensor.abs(), 0.0).amax().float()

    def set_amax(self, amax: Tensor, version) -> None:
        """The whole weight's amax, taken at the parameter's `version`."""
        self._amax, self._amax_version = amax, version

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        first = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _LAYOUT_OPS:
            return out
        return pytree.tree_map_only(Tensor, lambda t: cls(t, first._site, first._group), out)

    def __tensor_flatten__(self):
        return ["_tensor"], {"site": self._site, "group": self._group}

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return FP8AllGatherWeight(inner["_tensor"], ctx["site"], ctx["group"])

    def __repr__(self):
        return f"FP8AllGatherWeight({self._site.fqn!r}, fp8={self._fp8}, shape={tuple(self.shape)})"

    def _whole_amax(self, mesh) -> Tensor:
        if self._amax is not None:   # `refresh` took it after the weights last changed
            return self._amax
        amax = self.local_amax()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group() if self._group is None else self._group)
        return amax

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        if not self._fp8:
            dt = mp_policy.param_dtype or self._tensor.dtype
            return (self._tensor.to(dt),), None
        site = self._site
        spec = QuantSpec(ELEMENTS[site._fast[0].fwd], Scaling.TENSOR)
        q = quantize(self._tensor, spec, amax=self._whole_amax(mesh), stats=site.collect_stats, validate=False)
        stats = q.stats.packed if site.collect_stats else None
        return (q.to_storage().contiguous(),), (q.scale_inv.reshape(()).clone(), stats)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (data,) = outputs
        if metadata is None:
            if out is not None:
                return None
            return data, (data,)
        scale_inv, stats = metadata
        if out is not None:   # FSDP2's unsharded parameter: the gathered weight, or a tp DTensor of it
            inner = getattr(out, "_local_tensor", out)
            inner.rescale(scale_inv, stats)
            return None
        return FP8GatheredWeight(data, scale_inv, stats, param_dtype), (data,)


class FP8GatheredWeight(Tensor):
    """A whole weight as FSDP2 gathered it: FP8 bytes (out, in) and their scale_inv, in the
    shape and dtype of the high-precision weight. The layer's fast path reads `forms()`;
    any other op sees the dequantized weight."""

    @staticmethod
    def __new__(cls, data: Tensor, scale_inv: Tensor, stats, dtype: torch.dtype):
        return Tensor._make_wrapper_subclass(cls, data.size(), strides=data.stride(),
                                             storage_offset=data.storage_offset(), dtype=dtype,
                                             device=data.device, requires_grad=False)

    def __init__(self, data: Tensor, scale_inv: Tensor, stats, dtype: torch.dtype):
        self._data, self._scale_inv, self._stats = data, scale_inv, stats

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        first = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        if func in _LAYOUT_OPS and func is not torch.ops.aten.copy_.default:
            inner = pytree.tree_map_only(cls, lambda t: t._data, (args, kwargs or {}))
            out = func(*inner[0], **inner[1])
            return pytree.tree_map_only(Tensor, lambda t: cls(t, first._scale_inv, first._stats, first.dtype), out)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.dequantize(), (args, kwargs or {}))
        return func(*args, **kwargs)

    def __tensor_flatten__(self):
        return ["_data", "_scale_inv"], {"stats": self._stats, "dtype": self.dtype}

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return FP8GatheredWeight(inner["_data"], inner["_scale_inv"], ctx["stats"], ctx["dtype"])

    def __repr__(self):
        return f"FP8GatheredWeight(shape={tuple(self.shape)}, fp8={self._data.dtype})"

    def dequantize(self) -> Tensor:
        return (self._data.float() * self._scale_inv).to(self.dtype)

    def rescale(self, scale_inv: Tensor, stats) -> None:
        """This step's scale and statistics for the bytes FSDP2 gathered into this buffer in place."""
        self._scale_inv, self._stats = scale_inv, stats

    def forms(self):
        """The fast path's `WeightForms`: the bytes, their transpose (one scale), the statistics."""
        stats = None if self._stats is None else QuantStats(self._stats)
        return WeightForms(self._data, self._scale_inv, self._data.t().contiguous(), self._scale_inv, stats)

