"""Per-expert signals (lowprec.policy.monitor with expert sites) and the routers' load balance
(lowprec.policy.router_signals): tokens routed per expert in a check window, an expert with
insufficient tokens not judged by the site thresholds, router collapse told from an even router."""

import math

import torch

from lowprec.policy.monitor import Monitor, MonitorConfig
from lowprec.policy.router_signals import router_balance
from lowprec.sites.plan import PrecisionPlan
from lowprec.sites.precision_state import prepare
from tests.lowprec.moe_models import tiny_qwen3_moe
from tests.lowprec.policy.test_controller import SITES, feed, healthy_site, make, run, signals


def test_a_check_gives_each_expert_its_statistics_and_tokens():
    model = tiny_qwen3_moe()
    state = prepare(model, PrecisionPlan.from_dict({"rules": [{"select": {"kind": "experts"}, "format": "fp8_tensorwise"}]}))
    mon = Monitor(state, MonitorConfig(check_every=1))
    ids = torch.randint(0, 64, (2, 12))
    mon.before_step(0)
    out = model(ids, labels=ids)
    out.loss.backward()
    mon.record(0, out.loss, torch.tensor(1.0))
    sig = mon.check(0)
    layer0 = [sig.sites[f"model.layers.0.mlp.experts.{e}"] for e in range(4)]
    assert sum(s.tokens for s in layer0) == 2 * 12 * 2            # every token to top_k = 2 experts
    for e, s in enumerate(layer0):
        assert s.tokens == state.sites[f"model.layers.0.mlp.experts.{e}"].module.tokens
        if s.tokens:
            assert {"input", "weight", "grad_output"} <= set(s.sqnr_db) and s.amax["weight"] > 0
            assert math.isfinite(s.sqnr_db["input"]) and s.flat()["routed/tokens"] == s.tokens
    assert sig.sites["model.layers.0.self_attn.q_proj"].tokens is None   # no expert: no count
    mon.close()


def test_an_expert_with_insufficient_tokens_is_not_judged():
    expert = "blocks.1.mlp.fc"
    for tokens, falls in ((5.0, False), (500.0, True)):
        ctl = make(thresholds={"min_expert_tokens": 32})
        run(ctl, [(s, signals(s)) for s in range(9, 200, 10)])
        bad = {s: healthy_site() for s in SITES}
        bad[expert] = healthy_site(sat=0.05)
        bad[expert].tokens = tokens
        changes = {}
        for step in (209, 219, 229):
            changes.update(feed(ctl, step, signals(step, sites=bad)).changes)
        assert (expert in changes) is falls, (tokens, changes)


def test_router_balance_tells_collapse_from_an_even_router():
    state = prepare(tiny_qwen3_moe(), PrecisionPlan.from_dict({}))
    experts = [state.sites[f"model.layers.0.mlp.experts.{e}"].module for e in range(4)]
    for s, n in zip(experts, (12, 12, 12, 12)):
        s.routed(n)
    even = router_balance(state.sites)
    assert even["router/model.layers.0.mlp.experts/cv"] == 0.0
    assert even["router/model.layers.0.mlp.experts/max_over_mean"] == 1.0
    for s, n in zip(experts, (48, 0, 0, 0)):
        s.routed(n)
    collapsed = router_balance(state.sites)
    assert collapsed["router/model.layers.0.mlp.experts/max_over_mean"] == 4.0
    assert math.isclose(collapsed["router/model.layers.0.mlp.experts/cv"], math.sqrt(3))
    assert "router/model.layers.1.mlp.experts/cv" not in collapsed   # no forward yet: no tokens there
