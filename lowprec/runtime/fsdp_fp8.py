"""FP8 all-gather of weights under FSDP2, the engine's side: wrap the weights, refresh the amaxes.

`wrap_weights` makes every PrecisionLinear weight an `FP8AllGatherWeight`
(`lowprec.sites.fp8_allgather` says what is gathered and why) before `fully_shard`;
`refresh`, run by `FullyShardedDP` as a forward pre-hook of the root, switches each
weight's gather mode to its site's current format and takes the amaxes of the weights
that changed since the last forward (the optimizer step) in one all-reduce (per amax
group; the engines give every weight the same one): a step with no change (another
micro-batch, a replay) issues none. Under FSDP2 x TP and HSDP that group is every rank
of the mesh, so each rank's scale is the whole weight's (with `amax_scope: local` too:
the weight's scale is one, wherever its shards are).
`plain_state_dict` (a state_dict hook) shows the shards as plain high-precision DTensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lowprec.sites.fp8_allgather import FP8AllGatherWeight, gathers_fp8
from lowprec.sites.layers import PrecisionLinear

__all__ = ["wrap_weights", "install", "refresh", "plain_state_dict"]


def wrap_weights(model: nn.Module, world: int, amax_group=None) -> list[str]:
    """Make the weight of every PrecisionLinear an `FP8AllGatherWeight` (before `fully_shard`;
    the optimizer is built after): the weight itself, or a DTensor weight's local tensor.
    Weights whose (local) rows do not split evenly over `world` shard ranks stay plain
    (FSDP2 pads those shards). amax_group: where the weights' amaxes are all-reduced (None:
    FSDP2's shard group; under TP or HSDP every rank of the mesh). Returns the sites wrapped."""
    from torch.distributed.tensor import DTensor
    done = []
    for m in model.modules():
        if not isinstance(m, PrecisionLinear) or m.transposed_weight:
            continue
        w = m.weight
        local = w._local_tensor if isinstance(w, DTensor) else w.data
        if local.shape[0] % world:
            continue
        wrapped = FP8AllGatherWeight(local.detach(), m, amax_group)
        if isinstance(w, DTensor):
            wrapped = DTensor.from_local(wrapped, w.device_mesh, w.placements, run_check=False, shape=w.shape,
                                         stride=w.stride())
        m.weight = nn.Parameter(wrapped, requires_grad=w.requires_grad)
        done.append(m.fqn)
    return done


def install(model: nn.Module) -> None:
    """After `fully_shard`: `refresh` before each forward of the root (before FSDP2's own
    pre-forward hook, which gathers), and state_dicts with plain high-precision shards."""
    model.register_forward_pre_hook(lambda m, args: refresh(m), prepend=True)
    model._register_state_dict_hook(plain_state_dict)


def _shards(model: nn.Module):
    """(FSDPParam, its FP8AllGatherWeight shard) for every wrapped parameter."""
    from torch.distributed.fsdp import FSDPModule
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        group = m._get_fsdp_state()._fsdp_param_group
        for fp in (group.fsdp_params if group is not None else ()):
            local = fp.sharded_param._local_tensor
            if isinstance(local, FP8AllGatherWeight):
                yield fp, local


@torch.no_grad()
def refresh(model: nn.Module) -> None:
    """Before a forward: switch each weight's gather mode to its site's format, and take the
    amaxes of the FP8-gathered weights that changed in one all-reduce (MAX) per amax group."""
    pending: dict = {}
    for fp, w in _shards(model):
        fp8 = gathers_fp8(w._site)
        if w.set_mode(fp8):   # FSDP2 keeps the gather buffers of the last mode: drop them
            fp.all_gather_outputs = []
            fp._unsharded_inner_tensors = []
            if hasattr(fp, "_unsharded_param"):
                del fp._unsharded_param
        # the sharded DTensor's version counter counts the optimizer's in-place updates (they
        # run below it, in DTensor's and the wrapper's dispatch, and do not count on the inner
        # tensor); the inner tensor's counts writes straight into it (a DCP load into a
        # `plain_state_dict` shard)
        version = (fp.sharded_param._version, w._tensor._version)
        if fp8 and w.amax_stale(version):
            group = fp.mesh_info.mesh.get_group() if w._group is None else w._group
            pending.setdefault(group, []).append((w, version))
    for group, ws in pending.items():
        local = torch.stack([w.local_amax() for w, _ in ws])
        dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
        for (w, version), a in zip(ws, local):
            w.set_amax(a, version)


def plain_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """A state_dict hook: every wrapped shard as the plain high-precision DTensor shard it
    holds, so snapshots and DCP checkpoints hold high-precision weights and no subclass."""
    from torch.distributed.tensor import DTensor
    for k, v in state_dict.items():
        if isinstance(v, DTensor) and isinstance(v._local_tensor, FP8AllGatherWeight):
            state_dict[k] = DTensor.from_local(v._local_tensor._tensor, v.device_mesh, v.placements,
                                               run_check=False, shape=v.shape, stride=v.stride())
