"""FP8 all-gather of weights under FSDP2: each rank sends its weight shard's FP8 bytes.

FSDP2 all-gathers a parameter's shards before the module that holds it runs; a sharded
tensor with `fsdp_pre_all_gather` / `fsdp_post_all_gather` decides what is sent and what
the module receives (the public extension point of `torch.distributed.fsdp.fully_shard`;
torchao's `WeightWithDynamicFloat8CastTensor` is built on it). `FP8AllGatherWeight` is
such a shard for a `PrecisionLinear`; at every gather it asks its site's *current* format
(`gathers_fp8`) what to send, so a fallback gathers high precision from the next step and
a promotion FP8, with no write to FSDP2's state:

* FSDP2 keeps one gather buffer per parameter, of the dtype and size of the first gather,
  so both modes send the same thing through it: one uint8 tensor of the shard's shape.
* FP8 (tensor-wise FP8 on the fast path): those bytes are the shard cast to FP8 with the
  scale of the *whole* weight, so the gathered bytes are exactly one process's cast of the
  whole weight; the scale goes along as metadata (on a check step, `collect_stats`, this
  shard's statistics too: the monitor sums them over ranks).
* high precision (a fallback to BF16, a replay, row-wise or delayed scaling, an emulated
  format): those bytes are the first 1/k of the shard's high-precision bytes (k its item
  size); the other (k-1)/k go in one more all-gather over the same shard group, issued in
  the post-all-gather (every rank runs FSDP2's gathers in the same order), and the two are
  put back together: the high-precision gather, bit for bit, in as many bytes.
* post-all-gather: the module gets `FP8GatheredWeight`, a tensor of the weight's shape and
  dtype that holds the gathered bytes and, per gather, either their scale (the fast path
  reads `forms()`) or the high-precision weight (`unwrap`, which the layer calls, hands it
  on with its gradient). Its buffers are FSDP2's to allocate and free (`fsdp_post_all_gather`
  returns them): the high-precision one is released again at once while the site gathers FP8.
* the amaxes: `lowprec.runtime.engines.fsdp_fp8.precompute_fp8_weight_scales(model)` takes every
  FP8-gathered weight's amax in one all-reduce per amax group once the weights have changed
  (after the optimizer step; torchao's `precompute_float8_dynamic_scale_for_fsdp` is the
  model); a pre-all-gather that finds no amax for the weight's current version takes its own.
  The amax group: the one given (the engines of `lowprec run` give every rank of the mesh),
  else the mesh dimensions the parameter is sharded over (FSDP2's, and tp's under FSDP2 x
  TP), so each rank's scale is the whole weight's.

Under FSDP2 x TP the weight is a DTensor sharded over tp whose local tensor is the
`FP8AllGatherWeight`; FSDP2 shards that local tensor over dp and gathers it back, and wraps
the `FP8GatheredWeight` (the tp shard's bytes) in the tp DTensor again, which
`lowprec.sites.fp8_parallel` unwraps to run the local GEMM on those bytes.

The optimizer, `state_dict` and checkpoints see the high-precision shard: every op other
than the layout ones FSDP2 and DTensor use runs on the plain tensor inside (and returns plain
tensors). `lowprec.runtime.engines.fsdp_fp8` makes the weights such shards before `fully_shard`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import Tensor

from lowprec.numerics.formats import QuantSpec, Scaling
from lowprec.numerics.fp8_ops import ELEMENTS
from lowprec.numerics.quant_stats import QuantStats
from lowprec.numerics.quantize import quantize
from lowprec.sites.fp8_linear import WeightForms

__all__ = ["FP8AllGatherWeight", "FP8GatheredWeight", "gathers_fp8", "unwrap", "amax_groups", "fp8_gather_dtype"]

_A = torch.ops.aten
# the ops FSDP2, DTensor and torchtitan's meta-device build use to make, move and shard a
# shard keep the wrapper; everything else (the optimizer's arithmetic, `zeros_like` for its
# state) works on, and returns, plain tensors
_LAYOUT_OPS = {_A.new_zeros.default, _A.slice.Tensor, _A.copy_.default, _A.view.default, _A.as_strided.default,
               _A._to_copy.default, _A._pin_memory.default, _A.split.Tensor, _A.clone.default, _A.detach.default,
               _A.alias.default, _A.empty_like.default, _A.new_empty.default, _A.new_empty_strided.default,
               _A.narrow.default, _A.chunk.default, _A.contiguous.default, _A.split_with_sizes.default}
# a gathered weight keeps its wrapper through the ops FSDP2 and autograd apply to it whole
_SAME_SHAPE_OPS = {_A.as_strided.default, _A.view.default, _A.detach.default, _A.alias.default}


def gathers_fp8(site) -> bool:
    """Whether `site` (a PrecisionLinear) gathers its weight in FP8: tensor-wise FP8 on the fast path."""
    fast = getattr(site, "_fast", None)
    return fast is not None and fast[0].scaling is Scaling.TENSOR and not site.transposed_weight


def amax_groups(param, group=None) -> tuple:
    """The process groups a weight's amax is all-reduced over (MAX), in order: `group` when
    given, else every mesh dimension the (DTensor) parameter is sharded over: every placement
    that neither replicates nor holds partial sums. FSDP2 over a tp-sharded dim 0 (a column-wise
    TP weight) places `_StridedShard`, which is not a `Shard` (`is_shard()` is False on torch
    2.13): counted by `is_shard()` alone, those weights' amaxes were each dp rank's own."""
    if group is not None:
        return (group,)
    mesh = param.device_mesh
    return tuple(mesh.get_group(i) for i, p in enumerate(param.placements)
                 if not (p.is_replicate() or p.is_partial()))


def fp8_gather_dtype(site) -> torch.dtype | None:
    """The FP8 dtype `site`'s weight is all-gathered in under `fp8_all_gather` (None: its high-precision dtype)."""
    return ELEMENTS[site._fast[0].fwd].torch_dtype if gathers_fp8(site) else None


def _wrapper(cls, t: Tensor):
    return Tensor._make_wrapper_subclass(cls, t.size(), strides=t.stride(), storage_offset=t.storage_offset(),
                                         dtype=t.dtype, layout=t.layout, device=t.device,
                                         requires_grad=t.requires_grad)


class FP8AllGatherWeight(Tensor):
    """A weight shard that FSDP2 all-gathers as FP8 while its site runs tensor-wise FP8."""

    @staticmethod
    def __new__(cls, tensor: Tensor, site, group=None, taken=None):
        return _wrapper(cls, tensor)

    def __init__(self, tensor: Tensor, site, group=None, taken: list | None = None):
        self._tensor = tensor
        self._site = site
        self._group = group   # the amax all-reduce's group; None: the shard dims' groups
        # [the whole weight's amax, the parameter's versions it was taken at], shared with the
        # views FSDP2 and DTensor make of this shard (`to_local` of a Parameter is a new one)
        self._taken = [None, None] if taken is None else taken

    def version(self, param) -> tuple:
        """The parameter's versions: the optimizer steps its site's weight cache counted (fused
        AdamW updates a weight without bumping its version counter; `lowprec.sites.weight_cache`),
        the sharded DTensor's version (other in-place updates: they run below it, in DTensor's
        and this wrapper's dispatch) and the inner tensor's (writes straight into it: a DCP load
        into a plain state_dict shard)."""
        return (self._site.weight_cache.steps.count, param._version, self._tensor._version)

    def amax_stale(self, version) -> bool:
        """Whether this shard's weight changed (`version`) since its amax was last taken."""
        return self._taken[0] is None or self._taken[1] != version

    def local_amax(self) -> Tensor:
        """This shard's finite amax (FP32), to be all-reduced into the whole weight's."""
        return torch.where(torch.isfinite(self._tensor), self._tensor.abs(), 0.0).amax().float()

    def set_amax(self, amax: Tensor, version) -> None:
        """The whole weight's amax, taken at the parameter's `version`."""
        self._taken[:] = [amax, version]

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        first = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        args, kwargs = pytree.tree_map_only(cls, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*args, **kwargs)
        if func not in _LAYOUT_OPS:
            return out
        return pytree.tree_map_only(Tensor, lambda t: cls(t, first._site, first._group, first._taken), out)

    def __tensor_flatten__(self):
        return ["_tensor"], {"site": self._site, "group": self._group, "taken": self._taken}

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return FP8AllGatherWeight(inner["_tensor"], ctx["site"], ctx["group"], ctx["taken"])

    def __repr__(self):
        return f"FP8AllGatherWeight({self._site.fqn!r}, fp8={gathers_fp8(self._site)}, shape={tuple(self.shape)})"

    def _whole_amax(self) -> Tensor:
        param = self._site.weight   # the sharded parameter (FSDP2 gathers from its sharded state)
        version = self.version(param)
        if not self.amax_stale(version):   # taken after the weights last changed
            return self._taken[0]
        amax = self.local_amax()
        for g in amax_groups(param, self._group):
            dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=g)
        self.set_amax(amax, version)
        return amax

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        if outer_size[0] % mesh.size():
            raise ValueError(f"FP8 all-gather of {self._site.fqn}: its weight's {outer_size[0]} rows do not split "
                             f"evenly over {mesh.size()} shard ranks (FSDP2 would pad them). Fix: a data-parallel "
                             f"shard degree dividing {outer_size[0]}, or FP8 all-gather off")
        site = self._site
        if gathers_fp8(site):
            elem = ELEMENTS[site._fast[0].fwd]
            spec = QuantSpec(elem, Scaling.TENSOR)
            q = quantize(self._tensor, spec, amax=self._whole_amax(), stats=site.collect_stats, validate=False)
            stats = q.stats.packed if site.collect_stats else None
            data = q.to_storage().contiguous().view(torch.uint8)
            return (data,), ("fp8", elem.torch_dtype, q.scale_inv.reshape(()).clone(), stats)
        hp = self._tensor.to(mp_policy.param_dtype or self._tensor.dtype).contiguous()
        raw = hp.view(torch.uint8).reshape(-1)
        n = hp.numel()
        return (raw[:n].view(hp.shape),), ("hp", raw[n:].contiguous(), mesh.get_group())

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (data,) = outputs
        if out is None:   # the first gather: the buffers FSDP2 allocates and frees from now on
            hp = torch.empty(data.shape, dtype=param_dtype, device=data.device)
            out = FP8GatheredWeight(data, hp)
            inner = (data, hp)
        else:
            inner = None
        with torch.no_grad():   # under FSDP2 x TP a tp DTensor of it: its own local tensor, not a view
            gathered = out.to_local() if hasattr(out, "to_local") else out
        if metadata[0] == "fp8":
            _, dtype, scale_inv, stats = metadata
            gathered.hold_fp8(dtype, scale_inv, stats)
        else:
            _, rest, group = metadata
            gathered.hold_hp(rest, group)
        return None if inner is None else (out, inner)


class _Held:
    """What one gather of a weight holds: FP8 bytes of `fp8_dtype` and their scale (and
    statistics on a check step), or (fp8_dtype None) the high-precision weight."""

    __slots__ = ("fp8_dtype", "scale_inv", "stats")

    def __init__(self):
        self.fp8_dtype = self.scale_inv = self.stats = None


class FP8GatheredWeight(Tensor):
    """A whole weight as FSDP2 gathered it, in the shape and dtype of the high-precision weight:
    FP8 bytes (out, in) and their scale_inv (`fp8`; the fast path reads `forms()`, any other op
    sees the dequantized weight), or the high-precision weight itself (`unwrap` hands it on)."""

    @staticmethod
    def __new__(cls, data: Tensor, hp: Tensor, held: _Held | None = None):
        return Tensor._make_wrapper_subclass(cls, hp.size(), strides=hp.stride(), storage_offset=0,
                                             dtype=hp.dtype, device=hp.device, requires_grad=False)

    def __init__(self, data: Tensor, hp: Tensor, held: _Held | None = None):
        self._data, self._hp = data, hp   # uint8 bytes, the high-precision buffer (both FSDP2's to free)
        # what this gather holds, shared with the views FSDP2, DTensor and autograd make of it
        self._held = _Held() if held is None else held

    @property
    def fp8(self) -> bool:
        return self._held.fp8_dtype is not None

    def hold_fp8(self, dtype: torch.dtype, scale_inv: Tensor, stats) -> None:
        """This gather's bytes are FP8 of `dtype` with this scale; the high-precision buffer is let go."""
        self._held.fp8_dtype, self._held.scale_inv, self._held.stats = dtype, scale_inv, stats
        self._hp.untyped_storage().resize_(0)

    @torch.no_grad()
    def hold_hp(self, rest: Tensor, group) -> None:
        """This gather's bytes are the first 1/k of each rank's high-precision bytes: gather the
        rest of each rank's (`rest`, this rank's) over `group` and put the weight together."""
        self._held.fp8_dtype = self._held.scale_inv = self._held.stats = None
        world = dist.get_world_size(group)
        others = torch.empty(world * rest.numel(), dtype=torch.uint8, device=rest.device)
        _all_gather(others, rest, group=group)
        # through `.data`: the buffer's version counter stays, as FSDP2 keeps its own buffers'
        # (a forward's saved views of it are refilled for the backward, not modified)
        whole = self._hp.data.view(-1).view(torch.uint8).view(world, -1)
        first = self._data.reshape(world, -1)
        whole[:, :first.shape[1]].copy_(first)
        whole[:, first.shape[1]:].copy_(others.view(world, -1))

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        first = next(a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, cls))
        if func in _SAME_SHAPE_OPS and (len(args) < 2 or list(args[1]) == list(first.shape)):
            return cls(first._data, first._hp, first._held)
        args, kwargs = pytree.tree_map_only(cls, lambda t: t.materialize(), (args, kwargs or {}))
        return func(*args, **kwargs)

    def __tensor_flatten__(self):
        return ["_data", "_hp"], {"held": self._held}

    @staticmethod
    def __tensor_unflatten__(inner, ctx, outer_size, outer_stride):
        return FP8GatheredWeight(inner["_data"], inner["_hp"], ctx["held"])

    def __repr__(self):
        return f"FP8GatheredWeight(shape={tuple(self.shape)}, fp8={self._held.fp8_dtype})"

    def _bytes(self) -> Tensor:
        return self._data.view(self._held.fp8_dtype).view(self.shape)

    def materialize(self) -> Tensor:
        """The weight as a plain tensor: dequantized FP8 bytes, or the high-precision weight."""
        if self.fp8:
            return (self._bytes().float() * self._held.scale_inv).to(self.dtype)
        return self._hp

    def forms(self):
        """The fast path's `WeightForms`: the bytes, their transpose (one scale), the statistics."""
        held = self._held
        stats = None if held.stats is None else QuantStats(held.stats)
        q = self._bytes()
        return WeightForms(q, held.scale_inv, q.t().contiguous(), held.scale_inv, stats)


# torch 2.13 names it all_gather_single (all_gather_into_tensor, deprecated, before)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class _Unwrap(torch.autograd.Function):
    """The high-precision weight of a gathered one, its gradient passed back to the gathered one."""

    @staticmethod
    def forward(ctx, w):
        return w._hp.view(w._hp.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad


def unwrap(w: Tensor) -> Tensor:
    """`w` itself, or, for a weight FSDP2 gathered in high precision, that plain tensor (with its
    gradient flowing back to `w`): the layer then runs exactly as on a plain gathered weight."""
    if isinstance(w, FP8GatheredWeight) and not w.fp8:
        return _Unwrap.apply(w)
    return w
