"""Fully sharded data parallel (FSDP2): an engine for the one training loop, for any model.

    state = prepare(model, plan, amax_group=group)      # first: it swaps nn.Linear, same Parameters
    engine = FullyShardedDP(model, mesh_or_group=group, microbatches=2)
    train(tc, engine, state, data, ...)                 # data: this rank's rows of the global batch

`FullyShardedDP` applies `torch.distributed.fsdp.fully_shard` to each block of the model
(default: every direct child, holding parameters, of a top-level `nn.ModuleList` or
`nn.ModuleDict`: `blocks.3`, `model.layers.3`; or the modules a `shard(fqn, module)`
predicate picks, innermost first), then to the root, which takes every parameter left
(embeddings, final norm, head). Each parameter becomes a DTensor sharded on dim 0 over the
data-parallel ranks, and so do its gradient and the optimizer's state.

Why prepare first: PrecisionLinear holds the nn.Linear's own Parameters; fully_shard then
replaces them with their shards on the same modules. In a block's forward FSDP2 has
gathered the whole weight, so a PrecisionLinear quantizes the same plain tensor as one
process (a DTensor weight would meet a plain input and be refused with a TypeError), and
the weight's statistics are the whole tensor's. Activations and gradients are this rank's
rows: with `precision.amax_scope: group`, `prepare(..., amax_group=<the dp group>)` reduces
their amaxes over the ranks, so each scale is the global batch's (the engine refuses such
sites without an amax group when there is more than one rank); with `local` each rank
scales its own rows. Either way a site in an FP8 fast-path format runs the fast path
(`lowprec.sites.fp8_parallel`).

Gradients: each rank's loss is divided by microbatches x ranks and FSDP2's reduce-scatter
is a plain SUM (divide factor 1; a SUM collective over gloo, which has neither AVG nor
PREMUL_SUM: `plain_sums`), so the summed
shards are the gradients of the global batch mean. Microbatches accumulate unsharded
gradients locally and reduce once, after the last one (chunk k of every rank together
is one process's chunk k: each rank holds rows rank::world). On a 2-D (replicate, shard)
mesh FSDP2 is HSDP: it reduce-scatters over the shard dimension and all-reduces over the
replicate one; with shard degree 1 that is replicated data parallelism (DDP's all-reduce),
which is how `lowprec run` runs `dp_replicate` (`lowprec.runtime.engines.parallel.build_engine`).
`clip_grad_norm` is torch's global norm over the DTensor gradients
(`lowprec.runtime.engines.gradnorm.clip_global`), a plain tensor, equal on every rank.

Snapshots and checkpoints see the sharded state: `model.state_dict()` holds DTensor shards
and `load_state_dict` copies into them in place, so each rank snapshots and restores its
own shards (`lowprec.runtime.session.snapshots`), and `lowprec.state.checkpoint` writes DCP checkpoints.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from lowprec.runtime.engines.engine import Clocked, loss_of
from lowprec.runtime.engines.fsdp_fp8 import enable_fp8_all_gather, install
from lowprec.runtime.engines.gradnorm import clip_global
from lowprec.runtime.engines.mesh import flat_group
from lowprec.tracking.phases import NULL_CLOCK, LapClock, Phase

__all__ = ["FullyShardedDP", "block_modules", "plain_sums"]

ShardSelector = Callable[[str, nn.Module], bool]


def _has_params(module: nn.Module) -> bool:
    return any(True for _ in module.parameters())


def block_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The default units: direct children, holding parameters, of every `nn.ModuleList` /
    `nn.ModuleDict` not nested inside another one (a Transformer's blocks)."""
    found: list[tuple[str, nn.Module]] = []

    def walk(prefix: str, module: nn.Module) -> None:
        for name, child in module.named_children():
            fqn = f"{prefix}{name}"
            if isinstance(child, (nn.ModuleList, nn.ModuleDict)):
                found.extend((f"{fqn}.{n}", c) for n, c in child.named_children() if _has_params(c))
            else:
                walk(f"{fqn}.", child)

    walk("", model)
    return found


def _mesh_of(mesh_or_group, model: nn.Module):
    from torch.distributed.device_mesh import DeviceMesh
    if isinstance(mesh_or_group, DeviceMesh):
        if mesh_or_group.ndim not in (1, 2):
            raise ValueError(f"FullyShardedDP takes a 1-D mesh (the data-parallel ranks) or a 2-D one (replicate, "
                             f"shard: HSDP), got a {mesh_or_group.ndim}-D one {mesh_or_group.mesh_dim_names}; "
                             f"pass mesh[\"dp_replicate\", \"dp_shard\"]")
        return mesh_or_group
    if mesh_or_group is None or isinstance(mesh_or_group, dist.ProcessGroup):
        if not dist.is_initialized():
            raise RuntimeError("FullyShardedDP needs an initialised process group "
                               "(torch.distributed.init_process_group, e.g. under torchrun)")
        group = mesh_or_group or dist.group.WORLD
        device = next(model.parameters()).device
        return DeviceMesh.from_group(group, device.type)
    raise TypeError(f"mesh_or_group must be a DeviceMesh or a ProcessGroup, got {type(mesh_or_group).__name__}")


def plain_sums(model: nn.Module, group) -> None:
    """Every FSDP2 unit of `model` reduces the loss/ranks gradients as a plain sum (divide
    factor 1); over gloo, which has neither AVG nor PREMUL_SUM, as a SUM collective (torch
    2.13's FSDP2 reduce-scatters with PREMUL_SUM(1/factor) for any factor but the shard degree,
    so gloo still needs it; NCCL takes FSDP2's own op)."""
    from torch.distributed.fsdp import FSDPModule
    gloo = dist.get_backend(group) == "gloo"
    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_gradient_divide_factor(1.0)
            if gloo:
                m.set_force_sum_reduction_for_comms(True)


class FullyShardedDP(Clocked):
    """FSDP2 (or HSDP, or replicated DP as HSDP of shard degree 1) over a mesh or process group;
    see the module docstring.

    mesh_or_group: a 1-D DeviceMesh or a ProcessGroup (default every rank): FSDP2 over it; a
        2-D DeviceMesh (replicate, shard): HSDP, sharded over the second dimension and
        replicated over the first (shard degree 1: replicated data parallel, gradients
        all-reduced). Parameters already DTensors over a tp mesh of the same root mesh
        (`model.tensor_parallel` first) are sharded on top, as torchtitan composes them.
    shard: a predicate `(fqn, module) -> bool` over `model.named_modules()` choosing the
        modules sharded as units before the root; default `block_modules`.
    reshard_after_forward: free the gathered weights of each unit after its forward and
        gather them again in backward (FSDP2's default; False keeps them, ZeRO-2 like).
    fp8_all_gather: gather the weights of tensor-wise FP8 sites as FP8 bytes and one scale
        (`lowprec.sites.fp8_allgather`); other sites, and a site after a fallback, gather
        their high-precision weights. The optimizer must be built after the engine.
    weight_amax_group: where the gathered weights' amaxes are all-reduced (one all-reduce
        per step for all of them); default the mesh dimensions each weight is sharded over.
        Under tp or replicas, every rank (`lowprec.runtime.engines.parallel.build_engine` passes it).
    loss_group: where the loss is summed (default: the ranks of the mesh, flattened).
    """

    def __init__(self, model: nn.Module, *, mesh_or_group=None, microbatches: int = 1,
                 shard: ShardSelector | None = None, reshard_after_forward: bool = True,
                 fp8_all_gather: bool = False, weight_amax_group=None, loss_group=None,
                 clock: LapClock = NULL_CLOCK):
        from torch.distributed.fsdp import FSDPModule, fully_shard

        self.clock = clock   # where FSDP2's forward, backward and loss all-reduce lap (the run's telemetry's)

        if microbatches < 1:
            raise ValueError(f"microbatches must be >= 1, got {microbatches}")
        if isinstance(model, FSDPModule):
            raise ValueError(f"{type(model).__name__} is already fully sharded; give FullyShardedDP the "
                             f"model after lowprec.prepare and before fully_shard")
        self.mesh = _mesh_of(mesh_or_group, model)
        self.group = flat_group(self.mesh) if loss_group is None else loss_group
        self.world = self.mesh.size()
        self.microbatches = microbatches
        self._check_amax_groups(model)
        if shard is None:
            units = block_modules(model)
        else:
            units = [(n, m) for n, m in model.named_modules() if n and shard(n, m) and _has_params(m)]
        self.units = [n for n, _ in units]
        self.fp8_gathered = (enable_fp8_all_gather(model, self.mesh.size(self.mesh.ndim - 1), weight_amax_group)
                             if fp8_all_gather else [])
        for _, unit in reversed(units):   # inner units before the modules that hold them
            fully_shard(unit, mesh=self.mesh, reshard_after_forward=reshard_after_forward)
        fully_shard(model, mesh=self.mesh, reshard_after_forward=reshard_after_forward)
        plain_sums(model, self.group)
        if self.fp8_gathered:   # before FSDP2's own pre-forward: modes and amaxes for this step's gathers
            install(model)
        self.module = model
        self.params = [p for p in model.parameters() if p.requires_grad]

    @property
    def data_parallel_size(self) -> int:
        return self.world

    def _check_amax_groups(self, model: nn.Module) -> None:
        from lowprec.sites.amax_scope import AmaxScope
        from lowprec.sites.layers import PrecisionLinear
        if self.world == 1:
            return
        bare = [m.fqn for m in model.modules() if isinstance(m, PrecisionLinear) and m.amax_group is None
                and m.amax_scope is AmaxScope.GROUP]
        if bare:
            raise ValueError(f"{len(bare)} PrecisionLinear sites ({', '.join(bare[:3])}, ...) have amax_scope "
                             f"'group' but no amax group; each of {self.world} ranks would scale its own rows. "
                             f"Prepare with lowprec.prepare(model, plan, amax_group=<the data-parallel group>), "
                             f"or set precision.amax_scope: local")

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x, y: this rank's rows of the global batch, in `microbatches` chunks, each chunk's
        loss / (microbatches x ranks). Returns the global batch-mean loss (detached), SUM-all-
        reduced, the same on every rank; the gradients are reduced and sharded. The laps: each
        chunk's forward (with the all-gathers FSDP2 issues in it) as FORWARD, its backward
        (with the reduce-scatters and all-reduces) as BACKWARD, the loss all-reduce as COLLECTIVE."""
        n, world = self.microbatches, self.world
        chunks = list(zip(x.tensor_split(n), y.tensor_split(n))) if n > 1 else [(x, y)]
        total = None
        for k, (xc, yc) in enumerate(chunks):
            if n > 1:   # accumulate locally; reduce after the last microbatch only
                self.module.set_requires_gradient_sync(k == n - 1)
            loss = loss_of(self.module(xc, yc))
            part = loss / (n * world) if n * world != 1 else loss
            self.clock.lap(Phase.FORWARD)
            part.backward()
            self.clock.lap(Phase.BACKWARD)
            total = part.detach() if total is None else total + part.detach()
        if world > 1:
            dist.all_reduce(total, group=self.group)
            self.clock.lap(Phase.COLLECTIVE)
        return total

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """Clip by the global gradient norm (`lowprec.runtime.engines.gradnorm.clip_global`: torch's over
        the DTensor gradients); returns the norm before clipping."""
        return clip_global(self.params, max_norm)
