"""The engines of `lowprec run` under torchrun: data x tensor parallel (replicated or fully
sharded data parallel), and pipeline stages. Each has `forward_backward(x, y) -> loss` and
`clip_grad_norm(max_norm)` and gives every rank the global batch-mean loss and the global
gradient norm (`lowprec.runtime.engines.engine`'s protocol); `build_engine` picks one from the
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

The engines, on the job's one mesh (pp, dp_replicate, dp_shard, tp) from
`lowprec.runtime.engines.mesh.build_mesh`, are torch's own:

* data and tensor parallel (`data_parallel`): `model.tensor_parallel` on the tp sub-mesh,
  then FSDP2 (`lowprec.runtime.engines.fsdp.FullyShardedDP`) on the (dp_replicate, dp_shard)
  sub-mesh, as torchtitan composes them: HSDP, each parameter sharded over dp_shard and
  replicated over dp_replicate. `dp_replicate` alone is HSDP of shard degree 1, which is
  replicated data parallelism (FSDP2 all-reduces the gradients, as DDP would; DDP itself
  refuses DTensor parameters); `dp_shard` alone is FSDP2. Each data rank's loss is divided by
  the data ranks and FSDP2 reduces plain SUMs (`lowprec.runtime.engines.fsdp.plain_sums`), so the
  reduced gradients are the global batch mean's. With `fp8_all_gather` FSDP2 gathers each
  FP8 site's (tp-local) weight as FP8 bytes, scaled by the whole weight's amax (one
  all-reduce over every rank per step; lowprec.runtime.engines.fsdp_fp8).
* `Pipeline`: `torch.distributed.pipelining` with one stage per rank and a GPipe schedule
  over the config's microbatches; the loss (cross-entropy of the last stage's logits) lives
  on the last stage and is broadcast to every rank. Its forwards outside training (an eval
  suite's `logits`, the LR probe's held `loss`) run through the stages in order
  (`lowprec.runtime.engines.pipeline_forward`), their result broadcast from the last stage.

The gradient norm (`lowprec.runtime.engines.gradnorm`): torch's over the DTensor gradients under data
and tensor parallel; under pipeline stages the per-parameter norms in the whole model's
order, summed over the stages, as `torch.nn.utils.clip_grad_norm_` forms it on one process.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowprec.runtime.engines.fsdp import FullyShardedDP
from lowprec.runtime.engines.gradnorm import clip_stages
from lowprec.runtime.engines.mesh import build_mesh, data_group, data_rank
from lowprec.runtime.engines.pipeline_forward import chain_forward, from_last_stage, last_stage_tensor
from lowprec.tracking.phases import NULL_CLOCK, LapClock

__all__ = ["Pipeline", "build_engine", "data_parallel", "stage_bounds", "local_state", "check_model_plan", "Layout",
           "build_layout"]


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
    `prepare`d: the job's one mesh (`lowprec.runtime.engines.mesh.build_mesh`), the group tensor-wise
    amaxes of activations and gradients are reduced over (`prepare(..., amax_group=layout.amax_group)`:
    this rank's data-parallel ranks; None with one), this rank's data rank and the number of data ranks."""
    mesh: object
    amax_group: object
    data_rank: int
    data_ranks: int


def build_layout(par, device: torch.device) -> Layout:
    """The mesh `par` (a ParallelConfig) asks for on `device`'s type, on the initialised process group."""
    mesh = build_mesh(device, pp=par.pp, dp_replicate=par.dp_replicate, dp_shard=par.dp_shard, tp=par.tp)
    if par.pp > 1:
        return Layout(mesh, None, 0, 1)
    return Layout(mesh, data_group(mesh) if par.data_ranks > 1 else None, data_rank(mesh), par.data_ranks)


class Pipeline:
    """This rank's stage of a GPipe schedule over `microbatches`; see the module docstring."""

    def __init__(self, model: nn.Module, pp_mesh, microbatches: int, device: torch.device):
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        rank, pp, group = pp_mesh.get_local_rank(), pp_mesh.size(), pp_mesh.get_group()
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

    def clip_grad_norm(self, max_norm: float | None) -> torch.Tensor:
        """The global norm as one process forms it, over every stage (`gradnorm.clip_stages`)."""
        mine = dict(self.module.named_parameters())
        return clip_stages([mine.get(n) for n in self.names], self.group, max_norm)


def build_engine(model: nn.Module, par, layout: Layout, microbatches: int, device: torch.device,
                 clock: LapClock = NULL_CLOCK):
    """The engine for `par` (a ParallelConfig) on `layout` (`build_layout`), every stage on
    `device` (the model's: `lowprec.runtime.engines.rank_device`); the model was `prepare`d with
    `layout.amax_group`. clock: where the engine laps its phases (the run's telemetry's)."""
    if par.pp > 1:
        return Pipeline(model, layout.mesh["pp"], microbatches, device=device)
    return data_parallel(model, layout.mesh, microbatches, fp8_all_gather=par.fp8_all_gather, clock=clock)


def data_parallel(model: nn.Module, mesh, microbatches: int, fp8_all_gather: bool = False,
                  clock: LapClock = NULL_CLOCK) -> FullyShardedDP:
    """Tensor x data parallel on a `build_mesh` mesh, the model `prepare`d with the mesh's
    `data_group` as its amax group: `model.tensor_parallel` on the tp sub-mesh (tp > 1), then
    FSDP2 on the (dp_replicate, dp_shard) sub-mesh (HSDP; dp_shard 1: replicated)."""
    if mesh["tp"].size() > 1:
        model.tensor_parallel(mesh["tp"])
    return FullyShardedDP(model, mesh_or_group=mesh["dp_replicate", "dp_shard"], microbatches=microbatches,
                          reshard_after_forward=mesh["dp_shard"].size() > 1, fp8_all_gather=fp8_all_gather,
                          weight_amax_group=dist.group.WORLD, loss_group=data_group(mesh), clock=clock)
