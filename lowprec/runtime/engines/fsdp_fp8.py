"""FP8 all-gather of weights under FSDP2, for any FSDP2 loop: wrap the weights, precompute their scales.

    from lowprec.runtime.engines.fsdp_fp8 import enable_fp8_all_gather, precompute_fp8_weight_scales
    state = lowprec.prepare(model, plan)        # the PrecisionLinear sites
    enable_fp8_all_gather(model)                # before fully_shard (and after, or before, TP)
    ... fully_shard(block) for each block; fully_shard(model); optimizer = AdamW(model.parameters())
    for batch in data:
        loss = model(batch); loss.backward(); optimizer.step()
        precompute_fp8_weight_scales(model)     # optional: one all-reduce for every weight's scale

`enable_fp8_all_gather` makes every PrecisionLinear weight an `FP8AllGatherWeight`
(`lowprec.sites.fp8_allgather` says what is gathered and why): sites in tensor-wise FP8 on
the fast path gather FP8 bytes and one scale, the others (and a site after a fallback, from
its next gather) their high-precision weight. `precompute_fp8_weight_scales` takes the
amaxes of the FP8-gathered weights that changed since the last call (the optimizer step, a
checkpoint load) in one all-reduce per amax group (torchao's
`precompute_float8_dynamic_scale_for_fsdp` is the model); without it each weight's first
gather after a change takes its own. `install` runs it before every forward of the root
(the engines of `lowprec run` and lowprec's torchtitan converter use it) and makes
state_dicts hold the plain high-precision shards (snapshots, DCP checkpoints).

Nothing here reads or writes FSDP2's own state: the shards are found as the module's
parameters (DTensors) and FSDP2 is reached only through its tensor extension point
(tests/test_object_boundaries.py holds every lowprec module to that).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from lowprec.sites.fp8_allgather import FP8AllGatherWeight, amax_groups, gathers_fp8
from lowprec.sites.layers import PrecisionLinear

__all__ = ["enable_fp8_all_gather", "precompute_fp8_weight_scales", "install", "plain_state_dict"]


def enable_fp8_all_gather(model: nn.Module, world: int | None = None, amax_group=None) -> list[str]:
    """Make the weight of every PrecisionLinear an `FP8AllGatherWeight` (before `fully_shard`;
    the optimizer is built after): the weight itself, or a tp DTensor weight's local tensor.
    world: the FSDP2 shard degree when known: weights whose (local) rows do not split evenly
    over it stay plain (FSDP2 pads those shards); when not known such a weight is refused at
    its first gather. amax_group: where the weights' amaxes are all-reduced (None: the mesh
    dimensions each is sharded over). Returns the sites wrapped."""
    from torch.distributed.tensor import DTensor
    done = []
    for m in model.modules():
        if not isinstance(m, PrecisionLinear) or m.transposed_weight:
            continue
        w = m.weight
        local = w.to_local() if isinstance(w, DTensor) else w.data
        if isinstance(local, FP8AllGatherWeight) or (world and local.shape[0] % world):
            continue
        wrapped = FP8AllGatherWeight(local.detach(), m, amax_group)
        if isinstance(w, DTensor):
            wrapped = DTensor.from_local(wrapped, w.device_mesh, w.placements, run_check=False, shape=w.shape,
                                         stride=w.stride())
        m.weight = nn.Parameter(wrapped, requires_grad=w.requires_grad)
        done.append(m.fqn)
    return done


def install(model: nn.Module) -> None:
    """`precompute_fp8_weight_scales` before each forward of `model`, and state_dicts with plain
    high-precision shards. Registered before `fully_shard` or after it; either way every
    gather checks that its weight's amax is the current one."""
    model.register_forward_pre_hook(_before_forward, prepend=True)
    model.register_state_dict_post_hook(plain_state_dict)


def _before_forward(module: nn.Module, args) -> None:
    precompute_fp8_weight_scales(module)   # (a pre-hook's return value would replace the inputs)


def _shards(model: nn.Module):
    """(sharded parameter, its FP8AllGatherWeight shard) for every wrapped parameter of `model`."""
    for p in model.parameters():
        local = p.to_local() if hasattr(p, "to_local") else p
        if isinstance(local, FP8AllGatherWeight):
            yield p, local


@torch.no_grad()
def precompute_fp8_weight_scales(model: nn.Module) -> int:
    """The amaxes of the FP8-gathered weights of `model` that changed since they were last
    taken, in one all-reduce (MAX) per amax group; call it between the optimizer step and the
    next forward, on every rank. Returns how many weights it took."""
    pending: dict = {}
    for p, w in _shards(model):
        version = w.version(p)
        if gathers_fp8(w._site) and w.amax_stale(version):
            pending.setdefault(amax_groups(p, w._group), []).append((w, version))
    for groups, ws in pending.items():
        local = torch.stack([w.local_amax() for w, _ in ws])
        for g in groups:
            dist.all_reduce(local, op=dist.ReduceOp.MAX, group=g)
        for (w, version), a in zip(ws, local):
            w.set_amax(a, version)
    return sum(len(ws) for ws in pending.values())


def plain_state_dict(module: nn.Module, state_dict: dict, prefix: str, local_metadata) -> None:
    """A state_dict post-hook: every wrapped shard as the plain high-precision DTensor shard it
    holds, so snapshots and DCP checkpoints hold high-precision weights and no subclass."""
    from torch.distributed.tensor import DTensor
    for k, v in state_dict.items():
        if isinstance(v, DTensor) and isinstance(local := v.to_local(), FP8AllGatherWeight):
            state_dict[k] = DTensor.from_local(local._tensor, v.device_mesh, v.placements, run_check=False,
                                               shape=v.shape, stride=v.stride())
