"""Grouped experts are sites (lowprec.sites.experts): a tiny Qwen3-MoE (transformers 5's fused
experts) prepared by a plan that selects experts by layer, kind and index; FLOP shares that count
every GEMM of the model."""

import pytest
import torch

from lowprec.sites.flop_count import describe_shares, kind_shares
from lowprec.sites.plan import PlanError, PrecisionPlan
from lowprec.sites.precision_state import prepare
from tests.lowprec.moe_models import tiny_qwen3_moe

LINEAR_FP8 = {"rules": [{"select": {"module_type": "Linear"}, "format": "fp8_tensorwise"}]}


def test_a_linear_rule_does_not_claim_the_whole_moe_model():
    """Fails on d588cb5: 9 sites, flops_share() == {'fp8_tensorwise': 1.0} with every expert in BF16."""
    model = tiny_qwen3_moe()
    state = prepare(model, PrecisionPlan.from_dict(LINEAR_FP8))
    share = state.flops_share()
    assert 0 < share["fp8_tensorwise"] < 1 and share["bf16"] > 0.3, share
    assert "model.layers.1.mlp.experts.3" in state.sites and len(state.sites) == 9 + 2 * 4
    assert {state.sites[f"model.layers.{i}.mlp.experts.{e}"].format.name for i in (0, 1) for e in range(4)} == {"bf16"}
    assert set(state.other_gemms) == {"model.layers.0.mlp.gate", "model.layers.1.mlp.gate"}   # HF's routers
    modules = dict(model.named_modules())
    text = describe_shares(state, modules)
    assert "GEMM FLOPs by kind: dense" in text and "experts" in text and "router" in text, text
    kinds = kind_shares(state.sites, state.other_gemms, modules)
    assert abs(sum(kinds.values()) - 1) < 1e-12 and 0.2 < kinds["experts"] < 0.6, kinds


def test_experts_selected_by_layer_kind_and_index_keep_their_parameters():
    model = tiny_qwen3_moe()
    experts = model.model.layers[1].mlp.experts
    params, keys = {n: p for n, p in experts.named_parameters()}, set(model.state_dict())
    ids = torch.randint(0, 64, (2, 12))
    plan = PrecisionPlan.from_dict({"rules": [
        {"name": "experts", "select": {"kind": "experts"}, "format": "fp8_tensorwise"},
        {"name": "l1", "select": {"kind": "experts", "layers": [1], "experts": [0, 2]}, "format": "mxfp8"}]})
    state = prepare(model, plan)
    got = {f: s.format.name for f, s in state.sites.items() if ".experts." in f}
    assert got["model.layers.1.mlp.experts.0"] == got["model.layers.1.mlp.experts.2"] == "mxfp8"
    assert got["model.layers.1.mlp.experts.1"] == got["model.layers.0.mlp.experts.2"] == "fp8_tensorwise"
    assert all(s.format.name == "bf16" for f, s in state.sites.items() if ".experts." not in f)
    assert {n: p for n, p in experts.named_parameters()} == params    # the same Parameter objects
    assert set(model.state_dict()) == keys                              # checkpoints keep their keys
    model(ids).logits.sum().backward()
    assert experts.gate_up_proj.grad is not None and experts.gate_up_proj.grad[0].abs().sum() > 0
    assert state.sites["model.layers.1.mlp.experts.0"].module.tokens >= 0
    assert sum(state.sites[f"model.layers.1.mlp.experts.{e}"].module.tokens for e in range(4)) == 2 * 12 * 2


def test_bf16_experts_follow_transformers_own_forward():
    model = tiny_qwen3_moe()
    ids = torch.randint(0, 64, (2, 12))
    ref = model(ids).logits
    prepare(model, PrecisionPlan.from_dict({}))
    torch.testing.assert_close(model(ids).logits, ref, atol=0.05, rtol=0.05)   # BF16 grid on every operand


def test_a_router_is_switched_only_by_a_rule_that_names_it_and_bad_selectors_say_why():
    # the plan's one parser (lowprec.base.parse) names the key, what it found, what is allowed and the likely fix
    with pytest.raises(PlanError, match=r"select\.kind: expected one of .*found the string 'expert'\. Did you mean 'experts'"):
        PrecisionPlan.from_dict({"rules": [{"select": {"kind": "expert"}, "format": "fp8_tensorwise"}]})
    with pytest.raises(PlanError, match=r"select\.experts: expected a list of integers or null, found the integer 3"):
        PrecisionPlan.from_dict({"rules": [{"select": {"experts": 3}, "format": "fp8_tensorwise"}]})
    with pytest.raises(PlanError, match="matches no linear layer or expert"):
        prepare(tiny_qwen3_moe(), PrecisionPlan.from_dict(
            {"rules": [{"select": {"kind": "experts", "experts": [9]}, "format": "fp8_tensorwise"}]}))


def test_expert_state_resumes_exactly(tmp_path):
    """formats, delayed-scaling histories and stochastic-rounding generators of every expert go
    through a checkpoint (weights_only) and the next step is bit for bit the uninterrupted one's."""
    plan = PrecisionPlan.from_dict({"rules": [
        {"select": {"kind": "experts"}, "format": "fp8_delayed"},
        {"select": {"kind": "experts", "experts": [1]}, "format": "nvfp4"}]})
    ids = torch.randint(0, 64, (2, 32))

    def step(model):
        model.zero_grad(set_to_none=True)
        out = model(ids, labels=ids)
        out.loss.backward()
        return out.loss.detach(), model.model.layers[0].mlp.experts.down_proj.grad.clone()

    a = tiny_qwen3_moe()
    sa = prepare(a, plan)
    step(a)
    step(a)
    sa.set_format("model.layers.0.mlp.experts.2", "bf16")
    torch.save({"model": a.state_dict(), "lowprec": sa.state_dict()}, tmp_path / "ckpt.pt")
    saved = {f: (s.module.fast_calls, s.module.slow_calls) for f, s in sa.sites.items() if ".experts." in f}
    want = step(a)
    b = tiny_qwen3_moe(seed=1)
    sb = prepare(b, plan)
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=True)
    b.load_state_dict(ckpt["model"])
    sb.load_state_dict(ckpt["lowprec"])
    assert sb.formats() == sa.formats() and sb.formats()["model.layers.0.mlp.experts.1"] == "nvfp4"
    # each projection's low-precision forwards by path, carried by the checkpoint (on the CPU: the
    # emulated grouped GEMM, never the GPU's grouped FP8 kernel; BF16 forwards are not counted)
    calls = {f: (s.module.fast_calls, s.module.slow_calls) for f, s in sb.sites.items() if ".experts." in f}
    assert calls["model.layers.0.mlp.experts.2"] == (0, 4) and calls["model.layers.0.mlp.experts.1"] == (0, 4)
    assert calls == saved
    got = step(b)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_torchtitan_grouped_experts_are_sites_too():
    """torchtitan 0.3's GroupedExperts (w1/w3 (E, F, D), w2 (E, D, F), tokens grouped by expert with
    their counts): its experts are sites; in BF16 the wrapped forward follows torchtitan's own."""
    moe = pytest.importorskip("torchtitan.models.common.moe")
    from torch import nn

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.experts = moe.GroupedExperts(moe.GroupedExperts.Config(dim=32, hidden_dim=32, num_experts=4))
            for p in self.experts.parameters():
                nn.init.normal_(p, std=0.1)
            self.proj = nn.Linear(32, 32)

    torch.manual_seed(0)
    model = nn.Module()
    model.layers = nn.ModuleList([Block(), Block()])
    experts = model.layers[0].experts
    x, counts = torch.randn(20, 32), torch.tensor([5, 0, 9, 6])
    ref = experts(x, counts)
    state = prepare(model, PrecisionPlan.from_dict(
        {"rules": [{"select": {"kind": "experts", "layers": [0]}, "format": "fp8_rowwise"}]}))
    assert isinstance(experts, moe.GroupedExperts)     # still one: torchtitan's parallelize finds it
    assert {f: s.format.name for f, s in state.sites.items() if ".experts." in f} == {
        **{f"layers.0.experts.{e}": "fp8_rowwise" for e in range(4)},
        **{f"layers.1.experts.{e}": "bf16" for e in range(4)}}
    with state.high_precision():
        torch.testing.assert_close(experts(x, counts), ref, atol=5e-3, rtol=2e-2)
    experts(x, counts).sum().backward()
    assert experts.w1_EFD.grad[1].abs().sum() == 0 and experts.w1_EFD.grad[2].abs().sum() > 0   # 0 tokens: 0
    assert [s.module.tokens for f, s in state.sites.items() if f.startswith("layers.0.experts.")] == [5, 0, 9, 6]
