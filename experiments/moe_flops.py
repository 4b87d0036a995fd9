"""GEMM FLOP shares of whole MoE models by kind (experts, shared experts, router, dense), from their
published shapes, computed by lowprec's own count (lowprec.sites.flop_count.moe_block_flops): what
lowprec could move to FP8 before experts were sites (dense only) and after. docs/moe.md quotes it.

    python experiments/moe_flops.py
"""

from __future__ import annotations

from fractions import Fraction

from lowprec.sites.flop_count import moe_block_flops

# DeepSeek-V3 (https://huggingface.co/deepseek-ai/DeepSeek-V3/blob/main/config.json): 61 layers, the
# first 3 dense (SwiGLU 18432), MLA attention, 256 routed experts (top 8) of width 2048, one shared
MODELS = {
    "DeepSeek-V3": dict(layers=61, dense_layers=3, dense_width=18432, vocab=129280, block=dict(
        hidden=7168, q_heads=128, kv_heads=128, head_dim=128, experts=256, top_k=8, expert_width=2048,
        shared_width=2048, q_lora=1536, kv_lora=512, rope_dim=64)),
    # Qwen3-30B-A3B (https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json): 48 layers, all MoE
    "Qwen3-30B-A3B": dict(layers=48, dense_layers=0, dense_width=0, vocab=151936, block=dict(
        hidden=2048, q_heads=32, kv_heads=4, head_dim=128, experts=128, top_k=8, expert_width=768)),
}


def model_shares(layers: int, dense_layers: int, dense_width: int, vocab: int, block: dict) -> dict[str, Fraction]:
    """Share of a token's GEMM FLOPs by kind over the whole model (attention, MLPs, router, head)."""
    moe = moe_block_flops(**block)
    dense_block = dict(moe, experts=0, shared_experts=0, router=0)
    dense_block["dense"] += 6 * 3 * block["hidden"] * dense_width
    total: dict[str, int] = {}
    for kind in moe:
        total[kind] = moe[kind] * (layers - dense_layers) + dense_block[kind] * dense_layers
    total["dense"] += 6 * block["hidden"] * vocab   # the output head
    s = sum(total.values())
    return {k: Fraction(v, s) for k, v in total.items()}


def main() -> None:
    print("| model | routed experts | shared experts | router | dense (attention, dense layers, head) |\n"
          "|---|---:|---:|---:|---:|")
    for name, spec in MODELS.items():
        sh = model_shares(**spec)
        print(f"| {name} | " + " | ".join(f"{float(sh[k]):.1%}" for k in ("experts", "shared_experts", "router", "dense"))
              + " |")


if __name__ == "__main__":
    main()
