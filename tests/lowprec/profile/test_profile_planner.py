"""The planner on hand-built profiles: formats by budget and share caps, stages, sections."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowprec.numerics.formats import get_format
from lowprec.sites.plan import PrecisionPlan
from lowprec.profile.measure import Profile, SiteCost
from lowprec.profile.planner import choose_formats, final_shares, order_stages, plan_sections
from lowprec.policy.rollout import parse_rollout

FP8, FP4, BF16 = "fp8_tensorwise", "nvfp4", "bf16"
BITS = {f: get_format(f).bits for f in (FP8, FP4, BF16, "mxfp8", "mxfp4", "fp8_rowwise")}


def cost(fqn, fmt, share, sens):
    """A SiteCost whose sensitivity is `sens` (all in the loss change, cosine 1)."""
    return SiteCost(fqn=fqn, format=fmt, flop_share=share, loss_delta=sens, grad_cosine=1.0)


def profile(entries):
    return Profile(entries=list(entries), reference_loss=3.0, batches=2, tokens_per_batch=64,
                   passes_per_rank=2 * (1 + len(entries)), world=1, seconds=0.0)


LADDER = [FP4, FP8, BF16]


def test_budget_keeps_sites_in_bf16():
    p = profile([cost("a", FP8, 0.5, 0.001), cost("a", FP4, 0.5, 0.02),
                 cost("b", FP8, 0.5, 0.2), cost("b", FP4, 0.5, 0.5)])
    ch = choose_formats(p, {"a": LADDER, "b": LADDER}, budget=0.01)
    assert ch["a"].format == FP8 and ch["a"].ladder == (FP8, BF16)
    assert ch["b"].format == BF16 and ch["b"].ladder == (BF16,) and "above the budget" in ch["b"].reason
    assert final_shares(ch) == pytest.approx({FP8: 0.5, BF16: 0.5})
    everything = choose_formats(p, {"a": LADDER, "b": LADDER}, budget=1.0)
    assert {f: c.format for f, c in everything.items()} == {"a": FP4, "b": FP4}   # fewer bits first
    assert everything["a"].ladder == (FP4, FP8, BF16)
    with pytest.raises(ValueError, match="budget"):
        choose_formats(p, {}, budget=-1)


def test_max_share_cap_least_sensitive_per_flop_first():
    # 4 sites of 25 % each; nvfp4 capped at 0.5: the two least sensitive per FLOP saved get it
    sens4 = {"a": 0.004, "b": 0.001, "c": 0.003, "d": 0.002}
    entries = [cost(f, FP4, 0.25, s) for f, s in sens4.items()] + [cost(f, FP8, 0.25, 0.0001) for f in sens4]
    ch = choose_formats(profile(entries), {f: LADDER for f in sens4}, budget=0.01, max_share={FP4: 0.5})
    assert {f for f, c in ch.items() if c.format == FP4} == {"b", "d"}
    assert {f for f, c in ch.items() if c.format == FP8} == {"a", "c"}
    none = choose_formats(profile(entries), {f: LADDER for f in sens4}, budget=0.01, max_share={FP4: 0, FP8: 0.3})
    assert sum(c.format == FP8 for c in none.values()) == 1
    assert [c.reason for c in none.values() if c.format == BF16][0] == "within the budget, but the share caps were full"
    with pytest.raises(ValueError, match="between 0 and 1"):
        choose_formats(profile(entries), {}, budget=0.01, max_share={FP4: 2})


# ---------------------------------------------------------------- random profiles
FORMATS = [FP4, "mxfp4", FP8, "mxfp8", "fp8_rowwise"]


@st.composite
def random_profiles(draw):
    n = draw(st.integers(1, 7))
    weights = draw(st.lists(st.floats(0.05, 1.0), min_size=n, max_size=n))
    shares = [w / sum(weights) for w in weights]
    entries, ladders = [], {}
    for i in range(n):
        fqn = f"blocks.{i}.fc"
        own = draw(st.lists(st.sampled_from(FORMATS), min_size=1, max_size=3, unique=True))
        by_bits = {}
        for f in own:   # a valid ladder: one format per width, rising
            by_bits.setdefault(BITS[f], f)
        ladders[fqn] = sorted(by_bits.values(), key=lambda f: BITS[f]) + [BF16]
        for f in ladders[fqn][:-1]:
            entries.append(SiteCost(fqn=fqn, format=f, flop_share=shares[i],
                                    loss_delta=draw(st.floats(-0.01, 0.05)),
                                    grad_cosine=draw(st.floats(0.95, 1.0)),
                                    grad_cosine_tensors=draw(st.floats(0.95, 1.0))))
    budget = draw(st.floats(0.0, 0.06))
    caps = draw(st.dictionaries(st.sampled_from(FORMATS), st.floats(0.0, 1.0), max_size=3))
    stages = draw(st.integers(1, 8))
    return profile(entries), ladders, budget, caps, stages


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(random_profiles())
def test_choices_and_stages_properties(case):
    prof, ladders, budget, caps, n_stages = case
    ch = choose_formats(prof, ladders, budget=budget, max_share=caps)
    assert set(ch) == set(ladders)   # every site chosen exactly once
    used = {}
    for f, c in ch.items():
        assert c.ladder[0] == c.format and c.ladder[-1] == BF16
        bits = [BITS[x] for x in c.ladder]
        assert bits == sorted(set(bits)), c.ladder   # strictly rising: a ladder lowprec.sites.plan accepts
        if c.format != BF16:
            assert prof.entry(f, c.format).sensitivity <= budget
            used[c.format] = used.get(c.format, 0.0) + c.flop_share
    for fmt, share in used.items():
        assert share <= caps.get(fmt, 1.0) + 1e-9

    stages = order_stages(ch, prof, n_stages)
    levels = []
    for s in stages:
        if s.format not in levels:
            levels.append(s.format)
        for f in s.fqns:
            assert s.format in ch[f].ladder
            assert BITS[ch[f].format] <= BITS[s.format]
    assert [BITS[lv] for lv in levels] == sorted((BITS[lv] for lv in levels), reverse=True)   # FP8 before FP4
    for lv in levels:   # a level's stages are contiguous, least sensitive per FLOP saved first
        idx = [i for i, s in enumerate(stages) if s.format == lv]
        assert idx == list(range(idx[0], idx[-1] + 1))
        order = [f for i in idx for f in stages[i].fqns]
        key = [(prof.entry(f, lv) or prof.entry(f, ch[f].format)).per_flop_saved for f in order]
        assert key == sorted(key)
        members = [f for f, c in ch.items() if lv in c.ladder and BITS[c.format] <= BITS[lv]]
        assert sorted(order) == sorted(members)   # each moving site exactly once per level
    possible = sum(len([f for f, c in ch.items() if lv in c.ladder and BITS[c.format] <= BITS[lv]])
                   for lv in levels)
    if levels:
        assert len(stages) == max(len(levels), min(n_stages, possible))

    sections = plan_sections({"backend": "emulated", "default": BF16}, {"check_every": 2}, ch, stages,
                             sorted(ch))
    plan = PrecisionPlan.from_dict(sections["precision"])
    assert sum(len(r.select.fqns) for r in plan.rules) == len(ch)
    if stages:
        roll = parse_rollout(sections["rollout"])
        assert [s.name for s in roll.stages] == [s.name for s in stages]
    else:   # every site kept in BF16: no rollout to write
        assert sections["rollout"] is None and all(c.format == BF16 for c in ch.values())


def test_stages_fp8_then_fp4_and_count():
    entries = []
    ladders = {}
    for i, (s8, s4) in enumerate([(0.001, 0.002), (0.0005, 0.008), (0.002, 0.001), (0.003, 0.5)]):
        f = f"s{i}"
        entries += [cost(f, FP8, 0.25, s8), cost(f, FP4, 0.25, s4)]
        ladders[f] = LADDER
    prof = profile(entries)
    ch = choose_formats(prof, ladders, budget=0.01)
    assert {f: c.format for f, c in ch.items()} == {"s0": FP4, "s1": FP4, "s2": FP4, "s3": FP8}
    stages = order_stages(ch, prof, 4)
    assert [s.format for s in stages] == [FP8, FP8, FP4, FP4][:len(stages)]
    assert len(stages) == 4
    fp8_order = [f for s in stages if s.format == FP8 for f in s.fqns]
    assert fp8_order == ["s1", "s0", "s2", "s3"]   # by sensitivity in fp8 (equal shares)
    fp4_order = [f for s in stages if s.format == FP4 for f in s.fqns]
    assert fp4_order == ["s2", "s0", "s1"]
    assert [s.name for s in stages] == ["fp8_tensorwise_1of2", "fp8_tensorwise_2of2", "nvfp4_1of2", "nvfp4_2of2"]
    assert order_stages(ch, prof, 1) and len(order_stages(ch, prof, 1)) == 2   # one per format at least
    with pytest.raises(ValueError, match="stages"):
        order_stages(ch, prof, 0)
    assert math.isclose(sum(s.flop_share for s in stages if s.format == FP8), 1.0)


def test_profiling_two_fp8_formats_gives_a_valid_plan():
    """`--formats fp8_tensorwise,mxfp8,nvfp4`: a site ending in nvfp4 may fall back to one
    8-bit format, not two (lowprec.sites.plan refuses a ladder with two formats of one width)."""
    entries = [cost("a", FP8, 0.5, 0.001), cost("a", "mxfp8", 0.5, 0.001), cost("a", FP4, 0.5, 0.002),
               cost("b", FP8, 0.5, 0.001), cost("b", "mxfp8", 0.5, 0.001), cost("b", FP4, 0.5, 0.002)]
    prof = profile(entries)
    ladders = {"a": [FP4, "mxfp8", BF16], "b": [FP4, FP8, BF16]}
    ch = choose_formats(prof, ladders, budget=0.01)
    assert ch["a"].ladder == (FP4, "mxfp8", BF16) and ch["b"].ladder == (FP4, FP8, BF16)
    stages = order_stages(ch, prof, 3)
    sections = plan_sections({"backend": "emulated"}, None, ch, stages, ["a", "b"])
    PrecisionPlan.from_dict(sections["precision"])
    parse_rollout(sections["rollout"])


def test_a_site_takes_its_least_sensitive_format_of_a_width():
    entries = [cost("a", FP8, 0.5, 0.004), cost("a", "mxfp8", 0.5, 0.001),
               cost("b", FP8, 0.5, 0.001), cost("b", "mxfp8", 0.5, 0.003)]
    ch = choose_formats(profile(entries), {"a": [FP8, BF16], "b": [FP8, BF16]}, budget=0.01)
    assert (ch["a"].format, ch["b"].format) == ("mxfp8", FP8)
    capped = choose_formats(profile(entries), {"a": [FP8, BF16], "b": [FP8, BF16]}, budget=0.01,
                            max_share={"mxfp8": 0.0})
    assert (capped["a"].format, capped["b"].format) == (FP8, FP8)   # the cap sends a to its other FP8


def test_shares_are_summed_without_rounding_noise():
    """16 FP8 sites of 6% each: a running sum gives 0.9600000000000004, the plan says 0.96."""
    from lowprec.profile.planner import SiteChoice
    ch = {f"s{i}": SiteChoice(f"s{i}", FP8, (FP8, BF16), 0.06, "") for i in range(16)}
    ch["t"] = SiteChoice("t", BF16, (BF16,), 0.04, "")
    assert sum([0.06] * 16) == 0.9600000000000004
    assert final_shares(ch) == {FP8: 0.96, BF16: 0.04}
    p = profile([cost(f, FP8, 0.06, 0.001) for f in ch])
    stages = order_stages({f: c for f, c in ch.items() if c.format == FP8}, p, stages=1)
    assert [s.flop_share for s in stages] == [0.96]
