"""From a profile to a staged plan: which format each site ends in, and in which order it gets there.

1. Formats (`choose_formats`): widths are filled from the fewest bits up (FP4 before FP8).
   For each width, the sites with a format of that width within the budget take their
   least sensitive one, least sensitive per FLOP saved first, until the format's FLOP-share
   cap (`max_share`) is reached; a site that fits nowhere stays in BF16. Each site's
   ladder is its format, then one format per width with more bits (its own ladder's, else the first profiled one by
   name: lowprec.sites.plan allows one format per width), then BF16.
2. Stages (`order_stages`): from the most bits down (FP8 stages, then FP4), every site on
   its way to that format or below moves in the stage of that format; a format's sites are
   cut into stages of about equal FLOPs, least sensitive per FLOP saved first, none empty.
   `stages` is the total; each format gets one, the rest go where the most FLOPs per stage
   are (at most one stage per site).
3. Sections (`plan_sections`): `precision:` (one rule per ladder, by FQN, starting in BF16)
   and `rollout:` (the input config's, with these stages; None when no site leaves BF16)
   as plain dicts for the YAML.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from lowprec.numerics.formats import get_format
from lowprec.profile.measure import Profile, SiteCost

__all__ = ["SiteChoice", "StagePlan", "choose_formats", "order_stages", "plan_sections", "final_shares"]

BF16 = "bf16"


@dataclass(frozen=True)
class SiteChoice:
    """Where one site ends: its format, its fallback ladder, and why."""

    fqn: str
    format: str
    ladder: tuple[str, ...]
    flop_share: float
    reason: str


@dataclass(frozen=True)
class StagePlan:
    name: str
    format: str
    fqns: tuple[str, ...]
    flop_share: float


def _bits(fmt: str) -> int:
    return get_format(fmt).bits


def choose_formats(profile: Profile, ladders: Mapping[str, Sequence[str]], *, budget: float,
                   max_share: Mapping[str, float] | None = None) -> dict[str, SiteChoice]:
    """Each site's final format (see the module doc). ladders: every site's ladder in the
    config ({fqn: [format names]}), which the written ladders keep."""
    if not budget >= 0:
        raise ValueError(f"the sensitivity budget must be >= 0, found {budget}")
    caps = dict(max_share or {})
    for f, cap in caps.items():
        get_format(f)
        if not 0 <= cap <= 1:
            raise ValueError(f"--max-share {f}={cap}: a share of GEMM FLOPs is between 0 and 1")
    by_site: dict[str, dict[str, SiteCost]] = {}
    for e in profile.entries:
        by_site.setdefault(e.fqn, {})[e.format] = e
    share = {f: next(iter(c.values())).flop_share for f, c in by_site.items()}
    chosen: dict[str, SiteChoice] = {}
    used: dict[str, float] = {}
    for bits in sorted({_bits(f) for f in profile.formats()}):   # fewest bits first
        options = {f: sorted((e for fmt, e in c.items() if _bits(fmt) == bits and e.sensitivity <= budget),
                             key=lambda e: (e.sensitivity, e.format))
                   for f, c in by_site.items() if f not in chosen}
        order = sorted((f for f, opts in options.items() if opts), key=lambda f: (options[f][0].per_flop_saved, f))
        for f in order:   # least sensitive per FLOP saved first; each site its least sensitive format that fits
            for e in options[f]:
                if used.get(e.format, 0.0) + e.flop_share > caps.get(e.format, 1.0) + 1e-9:
                    continue
                used[e.format] = used.get(e.format, 0.0) + e.flop_share
                chosen[f] = SiteChoice(f, e.format, _ladder(e.format, ladders.get(f, ()), profile.formats()),
                                       e.flop_share, f"sensitivity {e.sensitivity:.3g} <= budget {budget:g}")
                break
    for f in ladders:
        if f in chosen:
            continue
        costs = by_site.get(f, {})
        if costs:
            best = min(costs.values(), key=lambda e: e.sensitivity)
            why = (f"above the budget {budget:g} in every profiled format (least: {best.format} "
                   f"{best.sensitivity:.3g})")
            if any(e.sensitivity <= budget for e in costs.values()):
                why = "within the budget, but the share caps were full"
        else:
            why = "not profiled"
        chosen[f] = SiteChoice(f, BF16, (BF16,), share.get(f, 0.0), why)
    return chosen


def _ladder(fmt: str, own: Sequence[str], profiled: Sequence[str]) -> tuple[str, ...]:
    """fmt, then one format per width with more bits (fewest first; the site's own ladder's,
    else the first profiled one by name), then bf16: lowprec.sites.plan refuses a ladder with two
    formats of one width (e.g. fp8_tensorwise and mxfp8 both profiled)."""
    width: dict[int, str] = {}
    for f in (*own, *sorted(profiled)):
        if f != BF16 and _bits(f) > _bits(fmt):
            width.setdefault(_bits(f), f)
    return (fmt, *(width[b] for b in sorted(width)), BF16)


def order_stages(choices: Mapping[str, SiteChoice], profile: Profile, stages: int = 3) -> list[StagePlan]:
    """The rollout's stages (see the module doc)."""
    if stages < 1:
        raise ValueError(f"stages must be >= 1, found {stages}")
    levels = sorted({f for c in choices.values() for f in c.ladder if f != BF16}, key=lambda f: (-_bits(f), f))
    members: dict[str, list[SiteChoice]] = {
        lv: [c for c in choices.values() if lv in c.ladder and _bits(c.format) <= _bits(lv)] for lv in levels}
    levels = [lv for lv in levels if members[lv]]
    if not levels:
        return []
    count = {lv: 1 for lv in levels}
    flops = {lv: math.fsum(c.flop_share for c in members[lv]) for lv in levels}
    for _ in range(max(0, stages - len(levels))):
        lv = max((lv for lv in levels if count[lv] < len(members[lv])), key=lambda lv: flops[lv] / count[lv],
                 default=None)
        if lv is None:
            break
        count[lv] += 1
    out = []
    for lv in levels:
        def order(c: SiteChoice) -> tuple[float, str]:
            e = profile.entry(c.fqn, lv) or profile.entry(c.fqn, c.format)
            return (e.per_flop_saved if e is not None else math.inf, c.fqn)
        ranked = sorted(members[lv], key=order)
        k = count[lv]
        groups: list[list[SiteChoice]] = [[] for _ in range(k)]
        done, i, n = 0.0, 0, len(ranked)
        for j, c in enumerate(ranked):   # equal FLOPs per stage, in ranking order, no stage empty
            want = min(k - 1, int(done / flops[lv] * k + 1e-9)) if flops[lv] > 0 else 0
            i = 0 if j == 0 else max(k - (n - j), min(want, i + 1), i)
            groups[i].append(c)
            done += c.flop_share
        groups = [g for g in groups if g]
        for i, g in enumerate(groups):
            name = lv if len(groups) == 1 else f"{lv}_{i + 1}of{len(groups)}"
            out.append(StagePlan(name, lv, tuple(c.fqn for c in g), math.fsum(c.flop_share for c in g)))
    return out


def final_shares(choices: Mapping[str, SiteChoice]) -> dict[str, float]:
    """Share of the sites' GEMM FLOPs per final format (sums without rounding noise: `math.fsum`)."""
    total = math.fsum(c.flop_share for c in choices.values()) or 1.0
    shares: dict[str, list[float]] = {}
    for c in choices.values():
        shares.setdefault(c.format, []).append(c.flop_share)
    out = {f: math.fsum(v) / total for f, v in shares.items()}
    return dict(sorted(out.items(), key=lambda kv: _bits(kv[0])))


def plan_sections(precision: Mapping, rollout: Mapping | None, choices: Mapping[str, SiteChoice],
                  stages: Sequence[StagePlan], order: Sequence[str]) -> dict:
    """`precision:` and `rollout:` for the written config. precision/rollout: the input
    config's sections (dicts; rollout may be None); order: the sites in model order."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for f in order:
        if f in choices:
            groups.setdefault(choices[f].ladder, []).append(f)
    rules, names = [], set()
    for ladder, fqns in sorted(groups.items(), key=lambda kv: -_bits(kv[0][0])):
        name = "kept_bf16" if ladder == (BF16,) else f"to_{ladder[0]}"
        if name in names:   # two ladders from one format (sites with their own fallbacks)
            name = f"{name}_via_{'_'.join(ladder[1:-1]) or 'none'}"
        names.add(name)
        rules.append({"name": name, "select": {"fqns": list(fqns)}, "format": BF16, "ladder": list(ladder)})
    prec = {k: v for k, v in precision.items() if k != "rules"}
    prec["default"] = prec.get("default", BF16)
    prec["rules"] = rules
    if not stages:   # every site stays in BF16: nothing to roll out (a rollout needs a stage)
        return {"precision": prec, "rollout": None}
    roll = dict(rollout or {})
    roll["stages"] = [{"name": s.name, "select": {"fqns": list(s.fqns)}, "format": s.format} for s in stages]
    return {"precision": prec, "rollout": roll}

