"""A tiny Qwen3-MoE (transformers, random init) for the tests of grouped experts as sites."""

import torch
from torch import nn


def tiny_qwen3_moe(seed: int = 0, *, layers: int = 2, experts: int = 4, top_k: int = 2, vocab: int = 64) -> nn.Module:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3MoeConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, moe_intermediate_size=32,
                         num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                         num_experts=experts, num_experts_per_tok=top_k, max_position_embeddings=64,
                         router_aux_loss_coef=0.0)
    model = Qwen3MoeForCausalLM(cfg)
    with torch.no_grad():   # HF leaves the router at zeros: random, so that tokens spread unevenly
        for layer in model.model.layers:
            layer.mlp.gate.weight.normal_(0, 0.5)
    return model
