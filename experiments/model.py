"""A small GPT (nanoGPT-style) for the reference experiments and the tests, and a Llama-style
model (`build_llama`: RMSNorm, RoPE, SwiGLU) for the GPU main job (issue 15).

Pre-norm Transformer blocks with causal self-attention (`attn.qkv`, `attn.proj`) and a
GELU MLP (`mlp.fc`, `mlp.proj`), learned position embeddings and an untied output
head. Every linear layer is an `nn.Linear`, so `lowprec.prepare` can switch it; the
FQNs (`blocks.3.mlp.fc`) are what the precision plans in experiments/configs select.
`GPT.tensor_parallel` and `GPT.pipeline_stage` are its parallel plan (experiments/gpt_parallel.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 256
    block_size: int = 128
    n_layer: int = 4
    n_head: int = 4
    d_model: int = 128
    mlp_ratio: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "d_model", "mlp_ratio"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"dropout must be a number in [0, 1), got {self.dropout!r}")
        if self.d_model % self.n_head:
            raise ValueError(f"d_model {self.d_model} must be a multiple of n_head {self.n_head}")


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=-1)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, cfg.mlp_ratio * cfg.d_model)
        self.proj = nn.Linear(cfg.mlp_ratio * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.block_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, mean=0.0, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        t = idx.shape[1]
        if t > self.cfg.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than block_size {self.cfg.block_size}")
        x = self.tok_emb(idx) + self.pos_emb(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    # the parallel plan `lowprec run` asks for under a `parallel:` section (lowprec.runtime.engines.parallel)
    def tensor_parallel(self, tp_mesh) -> None:
        """Shard the blocks' linear layers over `tp_mesh` (experiments/gpt_parallel.py)."""
        from experiments.gpt_parallel import apply_tensor_parallel
        apply_tensor_parallel(self, tp_mesh)

    def check_parallel(self, tp: int, pp: int) -> None:
        """ValueError for degrees this GPT cannot take (checked before any process group starts)."""
        cfg = self.cfg
        if cfg.n_head % tp or (cfg.mlp_ratio * cfg.d_model) % tp:
            raise ValueError(f"parallel.tp {tp} must divide model.args.n_head ({cfg.n_head}) and the MLP width "
                             f"({cfg.mlp_ratio * cfg.d_model}); pick a divisor of {cfg.n_head}")
        if pp > cfg.n_layer:
            raise ValueError(f"parallel.pp {pp} needs at least {pp} blocks; model.args.n_layer is {cfg.n_layer}")

    def pipeline_stage(self, index: int, stages: int) -> nn.Module:
        """Stage `index` of `stages`: its blocks, with the embeddings first, ln_f and lm_head last."""
        from experiments.gpt_parallel import GPTStage
        from lowprec.runtime.engines.parallel import stage_bounds
        first, last = stage_bounds(len(self.blocks), stages)[index]
        return GPTStage(self, first, last, index == 0, index == stages - 1)


def build_gpt(**kwargs) -> GPT:
    """Factory named by configs (`model: {factory: experiments.model:build_gpt, ...}`)."""
    return GPT(GPTConfig(**kwargs))


# ---------------------------------------------------------------------- Llama-style model

class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)


class LlamaBlock(nn.Module):
    """Pre-norm block: RMSNorm, rotary causal attention (`attn.q/k/v/o`), RMSNorm, SwiGLU
    MLP (`mlp.gate/up/down`); no biases, as in Llama."""

    def __init__(self, d: int, n_head: int, hidden: int):
        super().__init__()
        self.n_head = n_head
        self.ln1, self.ln2 = RMSNorm(d), RMSNorm(d)
        self.attn = nn.ModuleDict({n: nn.Linear(d, d, bias=False) for n in ("q", "k", "v", "o")})
        self.mlp = nn.ModuleDict({"gate": nn.Linear(d, hidden, bias=False),
                                  "up": nn.Linear(d, hidden, bias=False),
                                  "down": nn.Linear(hidden, d, bias=False)})

    def forward(self, x, cos, sin):
        b, t, c = x.shape
        h = self.ln1(x)
        q, k, v = (self.attn[n](h).view(b, t, self.n_head, c // self.n_head).transpose(1, 2)
                   for n in ("q", "k", "v"))
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.attn["o"](y.transpose(1, 2).reshape(b, t, c))
        h = self.ln2(x)
        return x + self.mlp["down"](F.silu(self.mlp["gate"](h)) * self.mlp["up"](h))


class Llama(nn.Module):
    """A Llama-style decoder (RMSNorm, RoPE, SwiGLU, untied head) for the GPU main job.

    `device="auto"` builds it on CUDA when one is present (else CPU); its forward moves the
    batch to the model's device and, on CUDA, runs under BF16 autocast (FP32 master weights),
    so the trainer that feeds it CPU batches needs no device handling of its own."""

    def __init__(self, vocab_size=256, block_size=512, n_layer=12, n_head=16, d_model=1024,
                 hidden=2816, rope_base=10000.0):
        super().__init__()
        if d_model % n_head or (d_model // n_head) % 2:
            raise ValueError(f"d_model {d_model} must be n_head {n_head} times an even head size")
        self.block_size = block_size
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.blocks = nn.ModuleList(LlamaBlock(d_model, n_head, hidden) for _ in range(n_layer))
        self.ln_f = RMSNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab_size, bias=False)
        hd = d_model // n_head
        inv = 1.0 / rope_base ** (torch.arange(0, hd, 2).float() / hd)
        ang = torch.outer(torch.arange(block_size).float(), inv)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)
        self.apply(GPT._init)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        dev = self.tok_emb.weight.device
        idx = idx.to(dev)
        t = idx.shape[1]
        if t > self.block_size:
            raise ValueError(f"sequence of {t} tokens is longer than block_size {self.block_size}")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            x = self.tok_emb(idx)
            for block in self.blocks:
                x = block(x, self.cos[:t], self.sin[:t])
            logits = self.lm_head(self.ln_f(x))
        logits = logits.float()
        if targets is None:
            return logits
        return logits, F.cross_entropy(logits.flatten(0, 1), targets.to(dev).flatten())


def build_llama(device: str = "auto", compile_blocks: bool = False, **kwargs) -> Llama:
    """Factory for configs (`experiments.model:build_llama`); `device`: auto, cpu, cuda or meta
    (shapes only, no memory: what `lowprec plan` needs of a model too large for the machine).
    `compile_blocks`: each block compiled in place (`nn.Module.compile`, as torchtitan compiles
    per block: one compilation that every block shares), so its names stay those of the eager
    model and lowprec's sites, swapped in before the first forward, are traced inside it."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "meta":
        with torch.device("meta"):
            model = Llama(**kwargs)
    else:
        model = Llama(**kwargs).to(device)
    if compile_blocks:
        for block in model.blocks:
            block.compile()
    return model
