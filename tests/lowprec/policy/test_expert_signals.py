"""Per-expert signals (lowprec.policy.monitor with expert sites) and the routers' load balance
(lowprec.policy.router_signals): tokens routed per expert in a check window, an expert with
insufficient tokens not judged by the site thresholds, router collapse told from an even router,
and a collapsed router as the controller's signal (rule 0: a router fault, nothing demoted)."""

import math

import torch

from lowprec.policy.monitor import Monitor, MonitorConfig
from lowprec.policy.events import EventKind
from lowprec.policy.router_signals import router_balance, router_windows
from lowprec.sites.plan import PrecisionPlan
from lowprec.tracking.records import signal_metrics
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
    # the window's routing per layer, as the controller and MLflow see it
    assert set(sig.routers) == {"model.layers.0.mlp.experts", "model.layers.1.mlp.experts"}
    assert sig.routers["model.layers.0.mlp.experts"].tokens == 2 * 12 * 2
    assert signal_metrics(sig)["router/model.layers.0.mlp.experts/collapse"] == sig.routers[
        "model.layers.0.mlp.experts"].collapse
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


def test_router_windows_measure_collapse_from_even_to_every_token_on_the_same_top_k():
    layer = "blocks.1.mlp"
    fqns = [f"{layer}.{e}" for e in range(4)]
    half = {f: 0.5 for f in fqns}   # top 2 of 4
    even = router_windows(dict(zip(fqns, (50.0, 50.0, 50.0, 50.0))), half)[layer]
    assert even.collapse == 0.0 and even.cv == 0.0 and even.tokens == 200.0
    one_hot = router_windows(dict(zip(fqns, (0.0, 100.0, 0.0, 100.0))), half)[layer]
    assert one_hot.collapse == 1.0 and one_hot.busiest == "blocks.1.mlp.1" and one_hot.max_over_mean == 2.0
    skewed = router_windows(dict(zip(fqns, (100.0, 50.0, 30.0, 20.0))), half)[layer]
    assert math.isclose(skewed.collapse, 0.5)   # the top 2 take 75% of the pairs: half way from 50% to 100%
    assert router_windows(dict(zip(fqns, (0.0,) * 4)), half) == {}


def test_a_collapsed_router_is_a_router_fault_and_its_experts_are_not_judged():
    """blocks.1.mlp.fc stands for an expert of layer `blocks.1.mlp` (its router's window collapsed):
    its crossed thresholds demote nothing while the router is collapsed, one ROUTER_FAULT event
    names the layer when it collapses (not again while it stays so), and once the routing is even
    again the same statistics demote it."""
    expert, layer = "blocks.1.mlp.fc", "blocks.1.mlp"
    collapsed = router_windows({expert: 400.0, "blocks.1.mlp.x": 0.0}, {expert: 0.5, "blocks.1.mlp.x": 0.5})
    even = router_windows({expert: 200.0, "blocks.1.mlp.x": 200.0}, {expert: 0.5, "blocks.1.mlp.x": 0.5})
    assert collapsed[layer].collapse == 1.0 and even[layer].collapse == 0.0
    ctl = make(thresholds={"site_patience": 1})
    run(ctl, [(s, signals(s)) for s in range(9, 200, 10)])
    bad = {s: healthy_site() for s in SITES}
    bad[expert] = healthy_site(sat=0.05)
    bad[expert].tokens = 400.0
    events, changes = [], {}
    for step in (209, 219):
        sig = signals(step, sites=bad)
        sig.routers = collapsed
        d = feed(ctl, step, sig)
        events += d.events
        changes.update(d.changes)
    faults = [e for e in events if e.kind == EventKind.ROUTER_FAULT]
    assert [(e.step, e.evidence["layer"]) for e in faults] == [(209, layer)] and not changes, events
    assert "router fault" in faults[0].reason and faults[0].evidence["router/collapse"] == 1.0
    sig = signals(229, sites=bad)
    sig.routers = even
    assert expert in feed(ctl, 229, sig).changes   # routing even again: its own statistics judge it
    off = make(thresholds={"site_patience": 1, "router_collapse": None})
    run(off, [(s, signals(s)) for s in range(9, 200, 10)])
    sig = signals(209, sites=bad)
    sig.routers = collapsed
    assert expert in feed(off, 209, sig).changes   # router_collapse: null: no router rule
