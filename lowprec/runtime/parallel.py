"""Sharding the small GPT for `experiments/train_parallel.py`: DP x TP, and pipeline stages.

(FSDP2, the third mode, needs nothing GPT-specific: `lowprec.runtime.fsdp.FullyShardedDP`.)

Two engines, each with `forward_backward(x, y) -> loss` and `clip_grad_norm(max_norm)`,
that give every rank the global batch-mean loss and the global gradient norm:

* `DataTensorParallel`: a 2-D DeviceMesh ("dp", "tp"). In every block attn.qkv and
  mlp.fc are ColwiseParallel, attn.proj and mlp.proj RowwiseParallel (DTensor), and
  attention runs on each tp rank's heads (qkv's rows are regrouped so that rank r's
  colwise shard is [q_r | k_r | v_r]: the same numbers in another order). Embeddings,
  LayerNorms and the output head are replicated. Data parallel is one bucketed SUM
  all-reduce of the local gradients over the dp group after backward (what DDP does;
  DDP itself refuses DTensor parameters). Each dp rank's loss is divided by dp, so the
  summed gradients are those of the global batch mean.
* `Pipeline`: `torch.distributed.pipelining` with one `GPTStage` per rank (stage 0 the
  embeddings and the first blocks, the last stage the last blocks, ln_f, lm_head and the
  loss) and a GPipe schedule over the config's microbatches. The loss lives on the last
  stage and is broadcast to every rank.

The gradient norm is computed as `torch.nn.utils.clip_grad_norm_` computes it on one
process: the norm of the vector of per-parameter norms, in the model's parameter order;
a sharded parameter's norm comes from its shards' summed squares (`lowprec.runtime.gradnorm`).
"""

from __future__ import annotations

import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from lowprec.runtime.engine import forward_backward
from lowprec.tracking.phases import NULL_CLOCK, Phase
from lowprec.runtime.gradnorm import clip_, grad_norm, local_grad

__all__ = ["ParallelConfig", "DataTensorParallel", "Pipeline", "GPTStage", "stage_bounds",
           "local_state", "grad_norm", "clip_"]


@dataclass(frozen=True)
class ParallelConfig:
    """Ranks per dimension: data x tensor parallel, pipeline stages, or FSDP2 (not combined here)."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    fsdp: int = 1

    def __post_init__(self) -> None:
        if min(self.dp, self.tp, self.pp, self.fsdp) < 1:
            raise ValueError(f"--dp, --tp, --pp and --fsdp must be >= 1, got {self.dp}, {self.tp}, {self.pp}, "
                             f"{self.fsdp}")
        if self.pp > 1 and self.dp * self.tp > 1:
            raise ValueError(f"pipeline parallel (--pp {self.pp}) runs alone here; --dp/--tp must be 1, "
                             f"got --dp {self.dp} --tp {self.tp}")
        if self.fsdp > 1 and self.dp * self.tp * self.pp > 1:
            raise ValueError(f"FSDP2 (--fsdp {self.fsdp}) runs alone here; --dp/--tp/--pp must be 1, "
                             f"got --dp {self.dp} --tp {self.tp} --pp {self.pp}")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.fsdp

    @property
    def data_ranks(self) -> int:
        """Ranks that each read their own rows of the global batch."""
        return self.dp * self.fsdp

    @property
    def mode(self) -> str:
        if self.fsdp > 1:
            return f"fsdp{self.fsdp}"
        return f"pp{self.pp}" if self.pp > 1 else f"dp{self.dp}xtp{self.tp}"


def local_state(state, fqns):
    """A PrecisionState over this rank's sites only (the same Site objects)."""
    from lowprec.sites.precision_state import PrecisionState
    keep = set(fqns)
    return PrecisionState([s for f, s in state.sites.items() if f in keep], state.backend,
                          state.kept_high_precision.items())


# ----------------------------------------------------------------------------- gradients

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


# ----------------------------------------------------------------------------- tensor parallel

def qkv_rank_order(rows: int, tp: int) -> torch.Tensor:
    """Row order of qkv that puts [q_r, k_r, v_r] (whole heads) in rank r's colwise shard."""
    c = rows // 3
    per = c // tp
    return torch.cat([torch.arange(j * c + r * per, j * c + (r + 1) * per) for r in range(tp) for j in range(3)])


def _tp_attention_forward(self, x: torch.Tensor) -> torch.Tensor:
    """Causal attention on this rank's heads: qkv's local output is [q_r | k_r | v_r]."""
    b, t, _ = x.shape
    qkv = self.qkv(x)
    c = qkv.shape[-1] // 3
    heads = self.n_head // self.tp_size
    q, k, v = (z.view(b, t, heads, c // heads).transpose(1, 2) for z in qkv.split(c, dim=-1))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.proj(y.transpose(1, 2).reshape(b, t, c))


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """Shard every block's linear layers over `tp_mesh` (after `prepare`: the styles hook
    the PrecisionLinear modules themselves)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp = tp_mesh.size()
    cfg = model.cfg
    if cfg.n_head % tp or (cfg.mlp_ratio * cfg.d_model) % tp:
        raise ValueError(f"--tp {tp} must divide n_head ({cfg.n_head}) and the MLP width "
                         f"({cfg.mlp_ratio * cfg.d_model})")
    for block in model.blocks:
        perm = qkv_rank_order(block.attn.qkv.weight.shape[0], tp)
        with torch.no_grad():
            block.attn.qkv.weight.copy_(block.attn.qkv.weight[perm])
            block.attn.qkv.bias.copy_(block.attn.qkv.bias[perm])
        block.attn.tp_size = tp
        block.attn.forward = types.MethodType(_tp_attention_forward, block.attn)
        parallelize_module(block, tp_mesh, {"attn.qkv": ColwiseParallel(), "attn.proj": RowwiseParallel(),
                                            "mlp.fc": ColwiseParallel(), "mlp.proj": RowwiseParallel()})


class DataTensorParallel:
    """DP x TP on a 2-D mesh; see the module docstring."""

    def __init__(self, model: nn.Module, mesh, microbatches: int):
        self.model, self.mesh, self.microbatches = model, mesh, microbatches
        self.module = model
        self.dp, self.tp = mesh["dp"].size(), mesh["tp"].size()
        self.dp_group = mesh.get_group("dp")
        self.tp_group = mesh.get_group("tp")
        if self.tp > 1:
            apply_tensor_parallel(model, mesh["tp"])
        self.params = list(model.parameters())
        self.tp_rank = mesh.get_local_rank("tp")
        self.clock = NULL_CLOCK   # the loop sets its telemetry's clock

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


# ----------------------------------------------------------------------------- pipeline

def stage_bounds(n_layer: int, pp: int) -> list[tuple[int, int]]:
    """Blocks [first, last) of each of `pp` stages, as even as they come."""
    if pp > n_layer:
        raise ValueError(f"--pp {pp} needs at least {pp} blocks; the model has n_layer={n_layer}")
    edges = [round(i * n_layer / pp) for i in range(pp + 1)]
    return list(zip(edges[:-1], edges[1:]))


class GPTStage(nn.Module):
    """One pipeline stage of the GPT, holding the full model's modules under their names
    (`blocks.3.mlp.fc` stays `blocks.3.mlp.fc`): blocks [first, last); the first stage
    also embeds, the last one also applies ln_f and lm_head (it returns the logits)."""

    def __init__(self, model: nn.Module, first: int, last: int, is_first: bool, is_last: bool):
        super().__init__()
        self.is_first, self.is_last = is_first, is_last
        if is_first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in range(first, last)})
        if is_last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.is_first:   # x: token ids, as GPT.forward embeds them
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.lm_head(self.ln_f(x)) if self.is_last else x


class Pipeline:
    """This rank's stage of a GPipe schedule over `microbatches`; see the module docstring."""

    def __init__(self, model: nn.Module, rank: int, pp: int, microbatches: int, group=None):
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        self.rank, self.pp, self.microbatches, self.group = rank, pp, microbatches, group
        first, last = stage_bounds(len(model.blocks), pp)[rank]
        self.module = GPTStage(model, first, last, rank == 0, rank == pp - 1)
        self.names = [n for n, _ in model.named_parameters()]   # the whole model's order
        self.params = list(self.module.parameters())
        self.stage = PipelineStage(self.module, rank, pp, torch.device("cpu"), group=group)
        self.schedule = ScheduleGPipe(self.stage, n_microbatches=microbatches, loss_fn=self._loss,
                                      scale_grads=False)

    def _loss(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """A microbatch's share of the batch-mean loss (GPT.forward's loss / microbatches)."""
        loss = F.cross_entropy(logits.flatten(0, 1), target.flatten())
        return loss / self.microbatches if self.microbatches > 1 else loss

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """x, y: the whole batch on every rank. Returns the batch-mean loss on every rank."""
        loss = torch.zeros((), dtype=torch.float32)
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
        dist.broadcast(loss, group_src=self.pp - 1, group=self.group)
        return loss

    def clip_grad_norm(self, max_norm: float) -> torch.Tensor:
        mine = dict(self.module.named_parameters())
        grads = [mine[n].grad if n in mine else None for n in self.names]
        total = grad_norm(grads, [True] * len(grads), self.group or dist.group.WORLD)
        clip_([g for g in grads if g is not None], total, max_norm)
        return total
