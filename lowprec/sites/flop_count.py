"""GEMM FLOPs of a model, sites or not: the shares the plan, the progress line, the summary and
MLflow show (`flops_share`), the experts' share against the rest (`lowprec plan`), the GEMMs
that run no site (`other_gemms`), and a MoE transformer's shares from its shapes alone
(`moe_block_flops`, for docs/moe.md's DeepSeek-V3 and Qwen3-30B-A3B figures).

Per token of the model, a linear layer's three GEMMs (fprop, dgrad, wgrad) cost 6 * in * out;
an expert's cost its projections' 6 * out * in times top_k / experts (the share of tokens an
expert receives when routing is even): the experts of a layer together cost top_k experts' worth.
Sums are exact (integers and fractions); each share is rounded once. What runs no site (a kept
layer, HF's router, experts a backend cannot switch) runs in high precision and counts as `bf16`:
a share is never 100% for part of a model.
"""

from __future__ import annotations

from fractions import Fraction

from torch import nn

from lowprec.sites.site_kinds import SiteKind, kind_of

__all__ = ["flops_share", "kind_shares", "other_gemms", "moe_block_flops", "describe_shares", "HIGH_PRECISION"]

HIGH_PRECISION = "bf16"   # what the GEMMs that are no site are counted as


def flops_share(sites: dict, other: dict[str, int | Fraction], formats: dict[str, str] | None = None
                ) -> dict[str, float]:
    """Format name -> share of all GEMM FLOPs. sites: fqn -> Site (its `format` and
    `flops_per_token`); other: fqn -> FLOPs of GEMMs that are no site; formats: fqn -> format
    name to count instead of the sites' own."""
    flops: dict[str, int | Fraction] = {}
    for fqn, s in sites.items():
        name = s.format.name if formats is None else formats[fqn]
        flops[name] = flops.get(name, 0) + s.flops_per_token
    for f in other.values():
        flops[HIGH_PRECISION] = flops.get(HIGH_PRECISION, 0) + f
    total = sum(flops.values()) or 1
    return {name: float(Fraction(f) / total) for name, f in flops.items()}


def kind_shares(sites: dict, other: dict[str, int | Fraction], modules: dict[str, nn.Module] | None = None
                ) -> dict[str, float]:
    """Share of all GEMM FLOPs per site kind (`experts`, `shared_experts`, `router`, `dense`),
    sites and GEMMs that are no site alike: what `lowprec plan` prints."""
    modules = modules or {}
    flops: dict[str, int | Fraction] = {}
    for fqn, s in sites.items():
        k = kind_of(fqn, s.module, modules).value
        flops[k] = flops.get(k, 0) + s.flops_per_token
    for fqn, f in other.items():
        k = kind_of(fqn, None, modules).value
        flops[k] = flops.get(k, 0) + f
    total = sum(flops.values()) or 1
    return {k: float(Fraction(flops[k]) / total) for k in (v.value for v in SiteKind) if k in flops}


def other_gemms(model: nn.Module, kept: list[tuple[str, tuple[int, int]]], unwrapped: dict[str, tuple[str, ...]],
                top_k: dict[str, int]) -> dict[str, int | Fraction]:
    """FQN -> FLOPs per token of the GEMMs that run no site: kept linear layers (fqn, (out, in)),
    experts modules left as they are (`unwrapped`: fqn -> projection names; `top_k` each), and
    routers that are no linear layer (HF's `gate` with a 2-D weight beside the experts)."""
    out: dict[str, int | Fraction] = {fqn: 6 * o * i for fqn, (o, i) in kept}
    for fqn, names in unwrapped.items():
        m = model.get_submodule(fqn)
        out[fqn] = 6 * top_k[fqn] * sum(getattr(m, n).shape[1] * getattr(m, n).shape[2] for n in names)
    modules = dict(model.named_modules())
    for fqn, m in modules.items():
        w = getattr(m, "weight", None)
        if (not isinstance(m, nn.Linear) and isinstance(w, nn.Parameter) and w.dim() == 2
                and kind_of(fqn, m, modules) is SiteKind.ROUTER):
            out[fqn] = 6 * w.shape[0] * w.shape[1]
    return out


def moe_block_flops(*, hidden: int, q_heads: int, kv_heads: int, head_dim: int, experts: int, top_k: int,
                    expert_width: int, shared_width: int = 0, q_lora: int = 0, kv_lora: int = 0,
                    rope_dim: int = 0) -> dict[str, int]:
    """GEMM FLOPs per token of one MoE transformer block by kind (attention projections as plain
    or, with `kv_lora`, DeepSeek's MLA low-rank projections; SwiGLU experts of `expert_width`, top_k
    of them active; a shared expert of `shared_width`; the router)."""
    if kv_lora:
        qk = head_dim + rope_dim
        attn = (hidden * q_lora + q_lora * q_heads * qk + hidden * (kv_lora + rope_dim)
                + kv_lora * q_heads * (head_dim + head_dim) + q_heads * head_dim * hidden)
    else:
        attn = hidden * (q_heads + 2 * kv_heads) * head_dim + q_heads * head_dim * hidden
    return {"dense": 6 * attn, "experts": 6 * top_k * 3 * hidden * expert_width,
            "shared_experts": 6 * 3 * hidden * shared_width, "router": 6 * hidden * experts}


def describe_shares(state, modules: dict[str, nn.Module]) -> str:
    """Two lines for `lowprec plan`: the GEMM FLOP shares by kind (experts against the rest) and
    by format, every GEMM of the model counted."""
    kinds = kind_shares(state.sites, state.other_gemms, modules)
    fmts = state.flops_share()
    return ("GEMM FLOPs by kind: " + ", ".join(f"{k} {v:.1%}" for k, v in kinds.items())
            + "\nGEMM FLOPs by format: " + ", ".join(f"{k} {v:.1%}" for k, v in sorted(fmts.items(), key=lambda x: -x[1]))
            + (f" (what runs no site, {len(state.other_gemms)} layers, counts as {HIGH_PRECISION})"
               if state.other_gemms else ""))
