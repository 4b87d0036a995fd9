"""The engines of `lowprec run` under torchrun: data x tensor parallel (replicated or fully
sharded data parallel), and pipeline stages. Each has `forward_backward(x, y) -> loss` and
`clip_grad_norm(max_norm)` and gives every rank the global batch-mean loss and the global
gradient norm (`lowprec.runtime.engine`'s protocol); `build_engine` picks one from the
config's `parallel:` section (`lowprec.config.ParallelConfig`).

**The model says how it is split.** lowprec knows no model's layers, so a model that runs
tensor parallel or in pipeline stages carries its own plan, as torchtitan keeps a
parallelize function per model (the reference GPT: experiments/gpt_parallel.py):

    model.tensor_parallel(tp_mesh)          shard its layers over the 1-D tp mesh (DTensor,
                                            `parallelize_module`); called after `prepare`
    model.pipeline_stage(index, stages)     an nn.Module: stage `index` of `stages`, holding
                                            the model's modules under their own names; the
                                            first takes the token ids, the last returns logits
    model.check_parallel(tp, pp)            optional: raise ValueError for degrees it cannot
                                            take (checked before any process group starts)

The engines:

* `DataTensorParallel`: a 2-D mesh (`dp_replicate`, `tp`): `model.tensor_parallel` on the tp
  sub-mesh; data parallel is one bucketed SUM all-reduce of the local gradients over the dp
  group after backward (what DDP does; DDP itself refuses DTensor parameters). Each dp
  rank's loss is divided by dp, so the summed gradients are the global batch mean's.
* `ShardedTensorParallel`: a 2-D mesh (`dp_shard`, `tp`): `model.tensor_parallel` on the tp
  sub-mesh, then FSDP2 (`lowprec.runtime.fsdp.FullyShardedDP`) over the dp_shard sub-mesh,
  as torchtitan composes them; with tp 1 it is FSDP2 alone. The gradient norm counts a
  tensor-parallel shard on every rank and a tp-replicated parameter's FSDP shards on tp rank 0.
  With `fp8_all_gather` FSDP2 gathers each tp shard's FP8 bytes over dp_shard, scaled by
  the whole weight's amax (one all-reduce over every rank per step; lowprec.runtime.fsdp_fp8).
* `HybridShardedDP`: HSDP, FSDP2 on a 2-D mesh (`dp_replicate`, `dp_shard`): each
  parameter sharded over dp_shard and replicated over dp_replicate; FSDP2 reduce-scatters
  the gradients over dp_shard and all-reduces them over dp_replicate (plain SUMs of the
  loss / ranks gradients); `fp8_all_gather` as under FSDP2 (the amaxes over every rank). With
  tp, the 3-D mesh (`dp_replicate`, `dp_shard`, `tp`) as torchtitan composes it:
  `model.tensor_parallel` on the tp sub-mesh first, then HSDP on the (`dp_replicate`,
  `dp_shard`) sub-mesh (weights gathered in high precision there).
* `Pipeline`: `torch.distributed.pipelining` with one stage per rank and a GPipe schedule
  over the config's microbatches; the loss (cross-entropy of the last stage's logits) lives
  on the last stage and is broadcast to every rank. Its forwards outside training (an eval
  suite's `logits`, the LR probe's held `loss`) run through the stages in order
  (`lowprec.runtime.pipeline_forward`), their result broadcast from the last stage.

The gradient norm is formed as `torch.nn.utils.clip_grad_norm_` forms it on one process:
the norm of the vector of per-parameter norms, in the model's parameter order; a sharded
parameter's norm comes from its shards' summed squares (`lowprec.runtime.gradnorm`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowprec.runtime.engine import Clocked, forward_backward
from lowprec.runtime.gradnorm import clip_, grad_norm, local_grad
from lowprec.runtime.pipeline_forward import chain_forward, from_last_stage, last_stage_tensor
from lowprec.tracking.phases import NULL_CLOCK, LapClock, Phase

__all__ = ["DataTensorParallel", "ShardedTensorParallel", "HybridShardedDP", "Pipeline", "build_engine", "stage_bounds",
           "local_state", "check_model_plan", "Layout", "build_layout"]


def stage_bounds(n_layer: int, pp: int) -> list[tuple[int, int]]:
    """Blocks [first, last) of each of `pp` stages, as even as they come."""
    if pp > n_layer:
        raise ValueError(f"parallel.pp {pp} needs at least {pp} blocks; the model has {n_layer}")
    edges = [round(i * n_layer / pp) for i in range(pp + 1)]
    return list(zip(edges[:-1], edges[1:]))


def local_state(state, fqns):
    """A PrecisionState over this rank's sites only (the same Site objects)."""
    from lowprec.sites.precision_state import PrecisionState
    keep = set(fqns)
    return PrecisionState([s for f, s in state.sites.items() if f in keep], state.backend,
                          state.kept_high_precision.items())


def check_model_plan(model: nn.Module, tp: int, pp: int) -> None:
    """ValueError when the model cannot be split as asked (no plan method, or degrees it refuses)."""
    kind = type(model).__name__
    if tp > 1 and not callable(getattr(model, "tensor_parallel", None)):
        raise ValueError(f"parallel.tp {tp}: the model ({kind}) has no tensor_parallel(tp_mesh) method; give it "
                         f"one (docs/parallel.md), or set tp: 1")
    if pp > 1 and not callable(getattr(model, "pipeline_stage", None)):
        raise ValueError(f"parallel.pp {pp}: the model ({kind}) has no pipeline_stage(index, stages) method; give it "
                         f"one (docs/parallel.md), or set pp: 1")
    check = getattr(model, "check_parallel", None)
    if callable(check):
        check(tp, pp)


@dataclass(frozen=True)
class Layout:
    """Where this rank sits in the job, built once the process group is up and before the model is
    `prepare`d: the device mesh (None for pipeline stages), the group tensor-wise amaxes of
    activations and gradients are reduced over (`prepare(..., amax_group=layout.amax_group)`: the
    data-parallel ranks; None with one), this rank's data rank and the number of data ranks."""
    mesh: object
    amax_group: object
    data_rank: int
    data_ranks: int
    dp_group: object = None   # HSDP x TP: this tp rank's data ranks (the engine's loss reduction)


def build_layout(par, device: torch.device) -> Layout:
    """The mesh `par` (a ParallelConfig) asks for on `device`'s type, on the initialised process group."""
    from torch.distributed.device_mesh import init_device_mesh

    kind = torch.device(device).type
    if par.pp > 1:
        return Layout(None, None, 0, 1)
    if par.dp_replicate > 1 and par.dp_shard > 1:
        dims, names = (par.dp_replicate, par.dp_shard), ("dp_replicate", "dp_shard")
        if par.tp == 1:
            mesh = init_device_mesh(kind, dims, mesh_dim_names=names)
            return Layout(mesh, dist.group.WORLD, dist.get_rank(), par.world)
        mesh = init_device_mesh(kind, (*dims, par.tp), mesh_dim_names=(*names, "tp"))
        dp_group = mesh["dp_replicate", "dp_shard"]._flatten("dp").get_group()   # this tp rank's data ranks
        data_rank = mesh.get_local_rank("dp_replicate") * par.dp_shard + mesh.get_local_rank("dp_shard")
        return Layout(mesh, dp_group, data_rank, par.data_ranks, dp_group)
    dp_name = "dp_shard" if par.dp_shard > 1 else "dp_replicate"
    dp = par.dp_shard * par.dp_replicate
    mesh = init_device_mesh(kind, (dp, par.tp), mesh_dim_names=(dp_name, "tp"))
    return Layout(mesh, mesh.get_group(dp_name) if dp > 1 else None, mesh.get_local_rank(dp_name), dp)


@torch.no_grad()
def _all_reduce_grads(params: list[nn.Parameter], group) -> None:
    """SUM the local gradients over `group` in one flat bucket."""
    grads = [local_grad(p.grad) for p in params if p.grad is not None]
    if not grads:
        return
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, group=group)
    for g, chunk in zip(grads, flat.split([g.numel() for g in grads])):
        g.copy_(chunk.view_as(g))


class DataTensorParallel(Clocked):
    """Replicated data parallel x tensor parallel on a 2-D mesh (dp_replicate, tp); see the module docstring."""

    def __init__(self, model: nn.Module, mesh, microbatches: int, clock: LapClock = NULL_CLOCK):
        self.model, self.mesh, self.microbatches = model, mesh, microbatches
        self.clock = clock
        self.module = model
        self.dp, self.tp = mesh["dp_replicate"].size(), mesh["tp"].size()
        self.dp_group = mesh.get_group("dp_replicate")
        self.tp_group = mesh.get_group("tp")
        if self.tp > 1:
            model.tensor_parallel(mesh["tp"])
        self.params = list(model.parameters())
        self.tp_rank = mesh.get_local_rank("tp")

    @property
    def data_parallel_size(self) -> int:
        return self.dp

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x, y: this dp rank's rows of the global batch. Returns the global mean loss."""
        loss = forward_backward(self.model, x, y, self.microbatches, self.dp, clock=self.clock)
        if self.dp > 1:
            dist.all_reduce(loss, group=self.dp_group)
            _all_reduce_grads(self.params, self.dp_group)
            self.clock.lap(Phase.COLLECTIVE)
        return loss

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        # replicated over tp: counted once (tp rank 0); every dp rank holds the same gradients
        grads = [p.grad for p in self.params]
        total = grad_norm(grads, [self.tp_rank == 0] * len(grads), self.tp_group if self.tp > 1 else None)
        clip_([g for g in grads if g is not None], total, max_norm)
        return total


class ShardedTensorParallel(Clocked):
    """FSDP2 over tensor-parallel shards on a 2-D mesh (dp_shard, tp); see the module docstring."""

    def __init__(self, model: nn.Module, mesh, microbatches: int, fp8_all_gather: bool = False,
                 clock: LapClock = NULL_CLOCK):
        from lowprec.runtime.fsdp import FullyShardedDP

        self.mesh, self.clock = mesh, clock
        self.tp = mesh["tp"].size()
        self.tp_rank = mesh.get_local_rank("tp")
        if self.tp > 1:
            model.tensor_parallel(mesh["tp"])
        self.fsdp = FullyShardedDP(model, mesh_or_group=mesh["dp_shard"], microbatches=microbatches,
                                   fp8_all_gather=fp8_all_gather,
                                   weight_amax_group=dist.group.WORLD if self.tp > 1 else None, clock=clock)
        self.module, self.params = self.fsdp.module, self.fsdp.params
        self.fp8_gathered = self.fsdp.fp8_gathered
        self.world_group = dist.group.WORLD   # the mesh spans every rank

    @property
    def data_parallel_size(self) -> int:
        return self.fsdp.world

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x, y: this dp_shard rank's rows of the global batch. Returns the global mean loss."""
        return self.fsdp.forward_backward(x, y)

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """The global norm: per-parameter squared norms of the local shards, summed over every
        rank (a tp-replicated parameter's only from tp rank 0), as clip_grad_norm_ forms it."""
        if self.tp == 1:
            return self.fsdp.clip_grad_norm(max_norm)
        grads = [p.grad for p in self.params if p.grad is not None]
        if not grads:
            return torch.zeros((), device=self.mesh.device_type)
        norms = torch._foreach_norm([local_grad(g) for g in grads], 2.0)
        squares = torch.zeros(len(grads), dtype=torch.float32, device=norms[0].device)
        for i, (g, v) in enumerate(zip(grads, norms)):
            names = g.device_mesh.mesh_dim_names or ()
            tp_sharded = "tp" in names and g.placements[names.index("tp")].is_shard()
            if tp_sharded or self.tp_rank == 0:
                squares[i] = v.float() * v.float()
        dist.all_reduce(squares, group=self.world_group)
        total = torch.linalg.vector_norm(squares.sqrt(), 2.0)
        clip_(grads, total, max_norm)
        return total


class HybridShardedDP(Clocked):
    """HSDP: FSDP2 on a 2-D mesh (dp_replicate, dp_shard), over tensor-parallel shards when the
    mesh has a third dimension tp; see the module docstring."""

    def __init__(self, model: nn.Module, mesh, microbatches: int, dp_group=None,
                 fp8_all_gather: bool = False, clock: LapClock = NULL_CLOCK):
        """dp_group: the ranks of this rank's (dp_replicate, dp_shard) sub-mesh (default: every rank)."""
        self.clock = clock
        from torch.distributed.fsdp import fully_shard
        from lowprec.runtime.fsdp import block_modules, plain_sums
        from lowprec.runtime.fsdp_fp8 import enable_fp8_all_gather, install

        names = mesh.mesh_dim_names
        self.tp = mesh["tp"].size() if "tp" in names else 1
        self.tp_rank = mesh.get_local_rank("tp") if "tp" in names else 0
        if self.tp > 1:
            model.tensor_parallel(mesh["tp"])
        dp_mesh = mesh["dp_replicate", "dp_shard"] if "tp" in names else mesh
        self.mesh, self.microbatches, self.world = mesh, microbatches, dp_mesh.size()
        self.dp_group = dp_group
        self.fp8_gathered = (enable_fp8_all_gather(model, mesh["dp_shard"].size(), dist.group.WORLD)
                             if fp8_all_gather else [])
        for _, unit in reversed(block_modules(model)):   # inner units before the modules that hold them
            fully_shard(unit, mesh=dp_mesh)
        fully_shard(model, mesh=dp_mesh)
        plain_sums(model, dist.group.WORLD)   # a plain SUM of the loss/world gradients
        if self.fp8_gathered:
            install(model)
        self.module = model
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.replica = mesh.get_local_rank("dp_replicate")

    @property
    def data_parallel_size(self) -> int:
        return self.world

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x, y: this rank's rows of the global batch. Returns the global mean loss."""
        from lowprec.runtime.fsdp import sharded_forward_backward
        return sharded_forward_backward(self.module, x, y, self.microbatches, self.world, self.dp_group, self.clock)

    @torch.no_grad()
    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """The global norm from the shards of replica 0 (the other replicas hold the same); under
        tp a tp-replicated parameter counts only its tp rank 0's shards."""
        grads = [p.grad for p in self.params if p.grad is not None]
        norms = torch._foreach_norm([local_grad(g) for g in grads], 2.0)
        squares = torch.zeros(len(grads), device=norms[0].device if norms else self.mesh.device_type)
        if self.replica == 0:
            for i, (g, v) in enumerate(zip(grads, norms)):
                names = g.device_mesh.mesh_dim_names or ()
                if self.tp_rank == 0 or ("tp" in names and g.placements[names.index("tp")].is_shard()):
                    squares[i] = v.float() * v.float()
        dist.all_reduce(squares)
        total = torch.linalg.vector_norm(squares.sqrt(), 2.0)
        clip_(grads, total, max_norm)
        return total


class Pipeline:
    """This rank's stage of a GPipe schedule over `microbatches`; see the module docstring."""

    def __init__(self, model: nn.Module, rank: int, pp: int, microbatches: int, device: torch.device,
                 group=None):
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        self.rank, self.pp, self.microbatches, self.group = rank, pp, microbatches, group
        self.device = torch.device(device)
        self.module = model.pipeline_stage(rank, pp)
        self.names = [n for n, _ in model.named_parameters()]   # the whole model's order
        self.params = list(self.module.parameters())
        self.stage = PipelineStage(self.module, rank, pp, self.device, group=group)
        self.schedule = ScheduleGPipe(self.stage, n_microbatches=microbatches, loss_fn=self._loss,
                                      scale_grads=False)

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A microbatch's share of the batch-mean loss (the model's cross-entropy / microbatches)."""
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        return loss / self.microbatches if self.microbatches > 1 else loss

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x, y: the whole batch on every rank. Returns the batch-mean loss on every rank."""
        x, y = x.to(self.device), y.to(self.device)
        loss = torch.zeros((), dtype=torch.float32, device=self.device)
        if self.stage.is_first:
            self.schedule.step(x)
        elif self.stage.is_last:
            parts: list[torch.Tensor] = []
            self.schedule.step(target=y, losses=parts, return_outputs=False)
            loss = parts[0].detach()
            for p in parts[1:]:   # the order of forward_backward's accumulation
                loss = loss + p.detach()
        else:
            self.schedule.step()
        return from_last_stage(loss, self.group, self.pp)

    @torch.no_grad()
    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The batch-mean loss of a forward without gradients (the LR probe's held loss), on every
        rank: the same microbatches, loss and sum as `forward_backward`, each microbatch one
        `chain_forward` through the stages (no schedule step: the schedule's stages would
        re-initialise on every switch between training and evaluation)."""
        x, y = x.to(self.device), y.to(self.device)
        total = torch.zeros((), dtype=torch.float32, device=self.device)
        n = self.microbatches
        for k, (xc, yc) in enumerate(zip(x.tensor_split(n), y.tensor_split(n))):
            out = chain_forward(self.module, xc, self.rank, self.pp, self.group)
            if out is not None:
                part = self._loss(out, yc)
                total = part if k == 0 else total + part
        return from_last_stage(total.detach().float(), self.group, self.pp)

    @torch.no_grad()
    def logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """The whole model's logits [B, T, V] (float32) on token ids [B, T], on every rank: one
        `chain_forward` of the whole batch (any B, T), the last stage's logits broadcast."""
        out = chain_forward(self.module, tokens.to(self.device), self.rank, self.pp, self.group)
        return last_stage_tensor(out, self.group, self.pp, ndim=3, device=self.device)

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        mine = dict(self.module.named_parameters())
        grads = [mine[n].grad if n in mine else None for n in self.names]
        total = grad_norm(grads, [True] * len(grads), self.group or dist.group.WORLD)
        clip_([g for g in grads if g is not None], total, max_norm)
        return total


def build_engine(model: nn.Module, par, layout: Layout, microbatches: int, device: torch.device,
                 clock: LapClock = NULL_CLOCK):
    """The engine for `par` (a ParallelConfig) on `layout` (`build_layout`), every stage on
    `device` (the model's: `lowprec.runtime.rank_device`); the model was `prepare`d with
    `layout.amax_group`. clock: where the engine laps its phases (the run's telemetry's)."""
    mesh = layout.mesh
    if par.pp > 1:
        return Pipeline(model, dist.get_rank(), par.pp, microbatches, device=device)
    if par.dp_replicate > 1 and par.dp_shard > 1:
        if par.tp == 1:
            return HybridShardedDP(model, mesh, microbatches, fp8_all_gather=par.fp8_all_gather, clock=clock)
        return HybridShardedDP(model, mesh, microbatches, layout.dp_group, clock=clock)
    if par.dp_shard > 1:
        return ShardedTensorParallel(model, mesh, microbatches, fp8_all_gather=par.fp8_all_gather, clock=clock)
    return DataTensorParallel(model, mesh, microbatches, clock=clock)
