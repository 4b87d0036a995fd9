"""A profile shown three ways: the ranked table, the picture, and an MLflow run.

`ranked_table(profile, choices)` is the terminal's (and `profile.txt`'s) table, most
sensitive per FLOP saved first; `draw(profile, choices, path, budget)` draws sensitivity
against FLOP share per site and format (matplotlib, imported only here); `log_to_mlflow`
records the profile as its own MLflow run: the summary as metrics, one sensitivity metric
per site and format, the files as artifacts.
"""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Mapping

from lowprec.numerics.formats import get_format
from lowprec.profile.measure import Profile
from lowprec.profile.planner import SiteChoice, StagePlan, final_shares

__all__ = ["ranked_table", "plan_lines", "write_csv", "draw", "log_to_mlflow"]

_OPERAND_SHORT = {"input": "x", "weight": "w", "grad_output": "dy"}


def _num(v: float, fmt: str) -> str:
    return ("inf" if v > 0 else "-inf") if isinstance(v, float) and math.isinf(v) else (
        "nan" if v != v else format(v, fmt))


def ranked_table(profile: Profile, choices: Mapping[str, SiteChoice] | None = None, limit: int | None = None) -> str:
    """One line per (site, format), most sensitive per FLOP saved first."""
    rows = profile.ranked()
    shown = rows if limit is None else rows[:limit]
    w = max([len("site"), *(len(e.fqn) for e in shown)])
    head = (f"{'site':<{w}} {'format':<15} {'FLOPs':>6} {'sens.':>8} {'/saved':>8} {'fwd noise':>9} {'dloss':>9} "
            f"{'grad cos':>9} {'per tensor':>10} {'SQNR x/w/dy dB':>17} {'uf E':>6}  plan")
    lines = [head, "-" * len(head)]
    for e in shown:
        sq = "/".join(_num(e.sqnr_db.get(r, math.nan), ".1f") for r in _OPERAND_SHORT)
        plan = ""
        if choices is not None and e.fqn in choices:
            plan = "<- final" if choices[e.fqn].format == e.format else ""
        est = f" ~{e.estimated_from}" if e.estimated_from else ""
        lines.append(f"{e.fqn:<{w}} {e.format:<15} {e.flop_share:>6.1%} {_num(e.sensitivity, '.2e'):>8} "
                     f"{_num(e.per_flop_saved, '.2e'):>8} {_num(e.forward_noise, '.2e'):>9} {_num(e.loss_delta, '+.2e'):>9} "
                     f"{_num(e.grad_cosine, '.5f'):>9} {_num(e.grad_cosine_tensors, '.5f'):>10} {sq:>17} {e.underflow_energy:>6.1%}  {plan}{est}")
    if limit is not None and len(rows) > limit:
        lines.append(f"... {len(rows) - limit} more in profile.csv")
    return "\n".join(lines)


def plan_lines(choices: Mapping[str, SiteChoice], stages: list[StagePlan], budget: float) -> list[str]:
    shares = final_shares(choices)
    kept = [c for c in choices.values() if get_format(c.format).is_high_precision]
    lines = [f"plan (sensitivity budget {budget:g}): final GEMM FLOPs " +
             ", ".join(f"{f} {s:.0%}" for f, s in shares.items())]
    for i, s in enumerate(stages):
        lines.append(f"  stage {i + 1} {s.name}: {len(s.fqns)} sites ({s.flop_share:.0%} of FLOPs) -> {s.format}")
    if kept:
        lines.append(f"  kept in bf16: {len(kept)} sites, e.g. " +
                     "; ".join(f"{c.fqn} ({c.reason})" for c in kept[:3]))
    return lines


def write_csv(profile: Profile, path: Path) -> None:
    with open(path, "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["site", "format", "flop_share", "sensitivity", "per_flop_saved", "forward_noise", "loss_delta", "grad_cosine",
                    "grad_cosine_tensors", "sqnr_input_db", "sqnr_weight_db", "sqnr_grad_output_db", "underflow_energy", "estimated_from"])
        for e in profile.ranked():
            w.writerow([e.fqn, e.format, f"{e.flop_share:.6g}", f"{e.sensitivity:.6g}", f"{e.per_flop_saved:.6g}",
                        f"{e.forward_noise:.6g}", f"{e.loss_delta:.6g}", f"{e.grad_cosine:.8g}", f"{e.grad_cosine_tensors:.8g}",
                        *(f"{e.sqnr_db.get(r, math.nan):.4g}" for r in _OPERAND_SHORT),
                        f"{e.underflow_energy:.4g}", e.estimated_from or ""])


def draw(profile: Profile, choices: Mapping[str, SiteChoice] | None, path: Path, budget: float) -> Path:
    """Sensitivity (log) against FLOP share, one marker per format, the final choices filled."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5))
    markers = "o^sDv<>p"
    finite = [e.sensitivity for e in profile.entries if math.isfinite(e.sensitivity) and e.sensitivity > 0]
    floor = min(finite) / 3 if finite else 1e-6
    ceil = max(finite) * 3 if finite else 1.0
    for i, fmt in enumerate(profile.formats()):
        es = [e for e in profile.entries if e.format == fmt]
        ys = [min(max(e.sensitivity, floor), ceil) for e in es]
        xs = [e.flop_share for e in es]
        picked = [choices is not None and e.fqn in choices and choices[e.fqn].format == fmt for e in es]
        m = markers[i % len(markers)]
        ax.scatter([x for x, p in zip(xs, picked) if not p], [y for y, p in zip(ys, picked) if not p],
                   marker=m, facecolors="none", edgecolors=f"C{i}", label=f"{fmt}")
        if any(picked):
            ax.scatter([x for x, p in zip(xs, picked) if p], [y for y, p in zip(ys, picked) if p],
                       marker=m, color=f"C{i}", label=f"{fmt} (in the plan)")
    ax.axhline(budget, color="grey", ls="--", lw=1, label=f"budget {budget:g}")
    for e in [e for e in profile.ranked() if e.estimated_from is None][:6]:   # the worst measured ones
        ax.annotate(e.fqn, (e.flop_share, min(max(e.sensitivity, floor), ceil)), fontsize=7,
                    xytext=(4, 2), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("share of GEMM FLOPs")
    ax.set_ylabel("sensitivity: forward noise + loss change + (1 - per-tensor gradient cosine)")
    ax.set_title(f"lowprec profile: {profile.batches} held batches, {profile.passes_per_rank} passes per rank")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def log_to_mlflow(tracker, profile: Profile, choices: Mapping[str, SiteChoice], stages: list[StagePlan],
                  files: list[Path], budget: float) -> None:
    """The profile as a run of `tracker` (a lowprec Tracker): summary, per-pair sensitivity, files."""
    metrics = {"profile/passes_per_rank": profile.passes_per_rank, "profile/seconds": profile.seconds,
               "profile/reference_loss": profile.reference_loss, "profile/pairs": len(profile.entries),
               "profile/budget": budget, "profile/stages": len(stages)}
    metrics.update({f"profile/plan_share/{f}": s for f, s in final_shares(choices).items()})
    for e in profile.entries:
        key = f"profile/{e.format}/{e.fqn}"
        for name, v in (("sensitivity", e.sensitivity), ("forward_noise", e.forward_noise),
                        ("loss_delta", e.loss_delta), ("grad_cosine", e.grad_cosine),
                        ("grad_cosine_tensors", e.grad_cosine_tensors),
                        ("sqnr_min_db", min(e.sqnr_db.values(), default=math.nan))):
            if math.isfinite(v):
                metrics[f"{key}/{name}"] = v
    tracker.log_metrics(0, metrics)
    tracker.log_tags({"lowprec.kind": "profile", "profile.world": str(profile.world),
                      "profile.sampled": str(profile.sampled) if profile.sampled is not None else "all"})
    for f in files:
        tracker.log_artifact(f, "profile")
