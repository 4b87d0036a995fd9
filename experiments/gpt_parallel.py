"""The reference GPT's parallel plan: its tensor-parallel sharding and its pipeline stages.

`lowprec run` with a `parallel:` section asks the model itself how it is split (see
`lowprec.runtime.engines.parallel`): `GPT.tensor_parallel(tp_mesh)` and
`GPT.pipeline_stage(index, stages)` (experiments/model.py) call the functions here, as
torchtitan keeps a per-model parallelize function next to each model.

Tensor parallel: in every block attn.qkv and mlp.fc are ColwiseParallel, attn.proj and
mlp.proj RowwiseParallel (DTensor), and attention runs on each tp rank's heads (qkv's rows
are regrouped so that rank r's colwise shard is [q_r | k_r | v_r]: the same numbers in
another order). Embeddings, LayerNorms and the output head are replicated.

Pipeline: `GPTStage` holds blocks [first, last) under their names in the whole model
(`blocks.3.mlp.fc` stays `blocks.3.mlp.fc`); the first stage also embeds, the last one also
applies ln_f and lm_head and returns the logits.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["qkv_rank_order", "apply_tensor_parallel", "GPTStage"]


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
        raise ValueError(f"parallel.tp {tp} must divide model.args.n_head ({cfg.n_head}) and the MLP width "
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


class GPTStage(nn.Module):
    """One pipeline stage of the GPT (see the module docstring)."""

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
