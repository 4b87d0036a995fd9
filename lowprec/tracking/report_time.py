"""Where a run's time went: `time_breakdown.png` of the report (`time_figure`).

Drawn from the training loop's telemetry (lowprec.tracking.report_sources keeps it in
`ReportData.metrics`):

* per log window (logged at the same steps as `train/loss`), the seconds spent in each phase,
  `time/<phase>_s` for the phases in `PHASES` (a phase not logged at a step counts as 0), the
  window's wall seconds `time/window_s` and the seconds whose work did not survive
  `time/wasted_s` (recovery: replays and restores; skipped and later-rewound passes, evals,
  checkpoints); older runs' `replay` and `restore` phases are drawn as they were logged;
  after a rewind the redone windows replace the abandoned ones (the final trajectory);
* at the last step, the run summary: `telemetry/bucket/<bucket>_s` for the buckets in
  `BUCKETS`, `telemetry/goodput`, `telemetry/tokens_per_s`, `telemetry/mfu`,
  `telemetry/energy_per_token_j` (the last ones when measured), `telemetry/wall_s`.

Top panel: each window a step-shaped column from the previous logged step to its own, its
phases stacked in fixed colours (`PHASE_COLORS`), the top `time/wasted_s` of the column
cross-hatched in black; the rewound (redone) steps hatched and the events numbered as on
the other pictures, evals (steps with `eval/...` results) dash-dotted. Bottom panel: one
horizontal bar of the run's buckets, goodput, tokens/s, MFU and energy per token in its
title. A run without `time/` metrics (older runs) gets no picture.
"""

from __future__ import annotations

from lowprec.policy.events import EventKind
from lowprec.tracking.phases import LEGACY_PHASES, Bucket, Phase
from lowprec.tracking.report_sources import WINDOW, ReportData, rewinds
from lowprec.tracking.report_timeline import EVENT_STYLE, fit_title, is_eval_metric, mark_events, new_figure

__all__ = ["time_figure", "window_phases", "run_buckets", "PHASES", "BUCKETS", "PHASE_COLORS", "BUCKET_COLORS",
           "WASTED_LABEL", "EVAL_COLOR"]

# as the telemetry logs them (lowprec.tracking.phases), and as older runs did
PHASES = tuple(p.value for p in Phase) + LEGACY_PHASES
BUCKETS = tuple(b.value for b in Bucket) + ("replay",)
# The training step in blues, lowprec's own checks in yellows, work that is thrown away in
# reds, evals and checkpoints in greens, the rest in greys; a bucket as its phase.
PHASE_COLORS = {"data": "#c6dbef", "forward": "#6baed6", "backward": "#2171b5", "optimizer": "#08306b",
                "collective": "#9e9ac8", "monitor": "#fec44f", "recovery": "#fd8d3c", "lr_probe": "#fee391",
                "checkpoint": "#74c476", "eval": "#238b45", "tracking": "#bdbdbd", "other": "#737373",
                "replay": "#fd8d3c", "restore": "#cb181d"}   # the last two: older runs
BUCKET_COLORS = {"productive": "#2171b5", "startup": "#d9d9d9", "redone": "#cb181d", "skipped": "#fcbba1",
                 **{b: PHASE_COLORS[b] for b in ("recovery", "replay", "eval", "checkpoint", "lr_probe", "tracking",
                                                 "other")}}
WASTED_LABEL = "wasted (work that did not survive)"
EVAL_COLOR = "#6a51a3"


def window_phases(data: ReportData) -> tuple[list[int], dict[str, list[float]], list[float]]:
    """(window steps, {phase: seconds per window} for the phases logged, wasted seconds per window),
    along the final trajectory; a phase or the waste not logged at a step is 0 there."""
    series = {p: dict(data.metrics.get(f"time/{p}_s", [])) for p in PHASES}
    series = {p: v for p, v in series.items() if v}
    wasted = dict(data.metrics.get("time/wasted_s", []))
    steps = sorted({s for v in series.values() for s in v} | set(dict(data.metrics.get(WINDOW, []))) | set(wasted))
    return steps, {p: [v.get(s, 0.0) for s in steps] for p, v in series.items()}, [wasted.get(s, 0.0) for s in steps]


def run_buckets(data: ReportData) -> dict[str, float]:
    """{bucket: seconds} of the run summary (the last value of each `telemetry/bucket/<b>_s`), in `BUCKETS` order."""
    last = {b: data.metrics.get(f"telemetry/bucket/{b}_s", [])[-1:] for b in BUCKETS}
    return {b: v[0][1] for b, v in last.items() if v}


def _summary(data: ReportData) -> str:
    def last(key):
        pts = data.metrics.get(f"telemetry/{key}")
        return pts[-1][1] if pts else None
    parts = []
    for key, fmt in (("goodput", "goodput {:.0%}"), ("tokens_per_s", "{:,.0f} tokens/s"), ("mfu", "MFU {:.1%}"),
                     ("energy_per_token_j", "{:.3g} J/token"), ("wall_s", "wall {:,.0f} s")):
        if (v := last(key)) is not None:
            parts.append(fmt.format(v))
    return ", ".join(parts)


def _mark_evals_and_rewinds(ax, data: ReportData) -> None:
    """Evals dash-dotted; rewinds known only from `train/rewound_to` (no REWIND event) dashed."""
    evals = sorted({s for k, pts in data.metrics.items() if is_eval_metric(k) for s, _ in pts})
    for i, s in enumerate(evals):
        ax.axvline(s, color=EVAL_COLOR, ls="-.", lw=1, label=None if i else "eval")
    evented = {e.step for e in data.events if e.kind == EventKind.REWIND}
    color, ls = EVENT_STYLE[EventKind.REWIND]
    for i, step in enumerate(sorted({s for s, _ in rewinds(data)} - evented)):
        ax.axvline(step, color=color, ls=ls, lw=1, label=None if i or evented else EventKind.REWIND)


def _windows_panel(ax, data: ReportData) -> None:
    steps, phases, wasted = window_phases(data)
    first = data.initial_step if data.initial_step < steps[0] else steps[0] - 1
    edges = [first] + steps
    bottom = [0.0] * len(steps)
    for p, secs in phases.items():   # one StepPatch per phase: a window spans (previous logged step, step]
        top = [b + v for b, v in zip(bottom, secs)]
        ax.stairs(top, edges, baseline=bottom, fill=True, color=PHASE_COLORS[p], lw=0, label=p)
        bottom = top
    if any(wasted):   # the top `wasted` seconds of each column, cross-hatched
        low = [max(0.0, t - w) for t, w in zip(bottom, wasted)]
        ax.stairs(bottom, edges, baseline=low, fill=False, hatch="xxx", edgecolor="black", lw=0.6,
                  label=WASTED_LABEL)
    mark_events(ax, data, labels=True)
    _mark_evals_and_rewinds(ax, data)
    ax.set_xlim(edges[0], edges[-1])
    ax.set_ylim(0, max(bottom, default=0.0) * 1.05 or 1.0)
    ax.set_ylabel("seconds in the log window", fontsize=9)
    ax.set_xlabel("step (each column: the window from the previous logged step)", fontsize=8)
    ax.tick_params(labelsize=8)
    # outside the axes, so that it hides no column
    ax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)


def _buckets_panel(bax, data: ReportData) -> None:
    buckets = run_buckets(data)
    total = sum(buckets.values())
    if total <= 0:
        bax.axis("off")
        bax.text(0, 0.5, "no run summary (telemetry/bucket/*_s) logged", fontsize=8, color="#636363",
                 transform=bax.transAxes, va="center")
        return
    left = 0.0
    for b, v in buckets.items():
        bax.barh([0], [v], left=left, height=0.6, color=BUCKET_COLORS[b], edgecolor="white", lw=0.8,
                 label=f"{b} {v:,.0f} s ({v / total:.0%})" if v >= 10 else f"{b} {v:.2g} s ({v / total:.0%})")
        if v / total >= 0.07:   # wide enough for its name
            dark = b in ("productive", "redone", "eval", "other")
            bax.text(left + v / 2, 0, f"{b}\n{v / total:.0%}", ha="center", va="center", fontsize=7.5,
                     color="white" if dark else "black")
        left += v
    bax.set_xlim(0, total)
    bax.set_ylim(-0.5, 0.5)
    bax.set_yticks([])
    bax.set_xlabel("seconds of the run, by what they bought", fontsize=8)
    bax.tick_params(labelsize=8)
    bax.legend(loc="upper left", bbox_to_anchor=(1.005, 1.15), fontsize=7, frameon=False, ncol=2)
    summary = _summary(data)
    bax.set_title(fit_title(f"run summary: {summary}" if summary else "run summary", 10, 9), loc="left",
                  fontsize=9)


def time_figure(data: ReportData):
    """"Where the time went", or None without `time/` metrics (an older run)."""
    if not window_phases(data)[0]:
        return None
    fig = new_figure(13, 6.8)
    ax, bax = fig.subplots(2, 1, height_ratios=[3.2, 1])
    _windows_panel(ax, data)
    _buckets_panel(bax, data)
    ax.set_title(fit_title(f"{data.run_name}: where the time went, seconds per log window by phase (hatched: "
                           f"wasted); events numbered as on the timeline", 10, 11), loc="left", fontsize=11, pad=14)
    return fig
