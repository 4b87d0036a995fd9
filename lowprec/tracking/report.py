"""Pictures of a rollout (matplotlib, Agg, no pyplot state): what ran in which format when, and why.

`render_report(data, out_dir)` writes, from a `lowprec.tracking.report_sources.ReportData`:

* `precision_timeline.png`: layers down, steps across, a colour per format; a triangle
  where a site fell back (numbered, the reasons listed under the plot), a cross where it
  was quarantined, dashed lines at rewinds and rollbacks, dotted lines at promotions,
  gate verdicts along the top; under it the share of GEMM FLOPs per format over time.
* `loss.png`: training loss of the run (the candidate) beside the baseline run's and their
  relative gap, with the stage changes, fallbacks and rewinds marked on the same step axis, the rewound (redone) steps hatched and the loss that caused each rewind
  (`train/loss_rewound`, never in `train/loss`) as a cross.
* `fallback_signals.png`: for each site that fell back, the signals that triggered it and
  nothing else (`fallback_signal_keys`: the site's signals the event's evidence names, else
  the training loss or gradient norm its global detector watched; at most `MAX_SIGNALS`) and
  the same series in the baseline run (dashed, where it logged one), the threshold and the
  moment of the fallback.
* `lr_sensitivity.png`: the learning-rate probe's sensitivity (`train/lr_sensitivity`, see
  `lowprec.runtime.session.lrprobe`) at each probe, the level above which a promotion is held
  (`rollout.lr_probe.hold_above`, or the median of the probes before plus `hold_rise`: the
  lower), the holds and the other stage events, and under it the learning rate.
* `evals.png`: eval results per checkpoint with 95% intervals (±1.96 stderr, or the
  logged `_ci_low`/`_ci_high`) beside the baseline run's (often only its final eval, also
  drawn as a dotted level), gate verdicts, stage changes, fallbacks and rewinds marked; eval
  results only (`is_eval_metric`: not how long an eval took, not `eval_mode/*`). Fast in-loop
  evals and full ones (`eval_mode/<prefix>`, `eval_modes`) are separate series: the fast ones
  joined by a line, the full ones larger markers joined to nothing. The same weights in high
  precision (`eval_hp/...`) in their own colour, hollow, drawn above the candidate.

The baseline run (`ReportData.baseline_name`, its curves in `baseline_metrics`) is the one
`lowprec report RUN --baseline RUN` names, else the loss-gap baseline the run recorded
(lowprec.tracking.report_baseline). Every curve picture has a legend (candidate and baseline
by name), axis labels with units, and the steps on its x axis.
* `time_breakdown.png` (lowprec.tracking.report_time): where the time went, seconds per log
  window stacked by phase (`time/<phase>_s`) with the wasted seconds (`time/wasted_s`)
  cross-hatched and the rewound steps, evals and events marked; under it the run's buckets
  (`telemetry/bucket/*_s`) with goodput, tokens/s, MFU and energy per token. Older runs
  without `time/` metrics get none.

Titles are wrapped to the width of what they stand over (`fit_title`): a long run name never
runs off the picture.

The timeline (lowprec.tracking.report_timeline) is built for a 30-layer model (120+ sites); the
events are numbered the same way on every picture. Pictures whose data is missing are
skipped.
"""

from __future__ import annotations

from pathlib import Path

from lowprec.policy.controller import LR_HISTORY, lr_hold_level
from lowprec.policy.events import EventKind
from lowprec.tracking.records import LR_SENSITIVITY
from lowprec.tracking.report_sources import ReportData, fallback_sites, rewinds, signals_of
from lowprec.tracking.report_evals import _eval_series, eval_modes, evals_figure
from lowprec.tracking.report_scales import at_step, clip_axis, finite
from lowprec.tracking.report_style import (BASELINE_COLOR, CANDIDATE_COLOR, HP_COLOR, NO_BASELINE, STEP_LABEL,
                                           baseline_label, candidate_label, panels, unit_label)
from lowprec.tracking.report_timeline import (EVENT_STYLE, FORMAT_COLORS, REWOUND_COLOR, fit_title, mark_events,
                                              new_figure, reason_text, timeline_figure)

__all__ = ["render_report", "report_figures", "timeline_figure", "loss_figure", "signals_figure", "lr_sensitivity_figure",
           "evals_figure", "eval_modes", "_eval_series", "FORMAT_COLORS", "hold_levels", "CANDIDATE_COLOR",
           "BASELINE_COLOR", "HP_COLOR", "baseline_label", "candidate_label", "unit_label"]


# ------------------------------------------------------------------ loss, signals
def loss_figure(data: ReportData):
    loss = data.metrics.get("train/loss")
    if not loss:
        return None
    fig = new_figure(11, 6)
    ax, gax = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1.4])
    ax.plot(*zip(*loss), lw=1, color=CANDIDATE_COLOR, label=candidate_label(data))
    if data.baseline:
        ax.plot(*zip(*data.baseline), lw=1, color=BASELINE_COLOR, ls="--", label=baseline_label(data))
        shift = batch_offsets(data)
        # each step against the baseline's step that trained on the same batch: after a rewind the
        # run's data goes on (the rewound and skipped batches are not drawn again), the baseline's
        # did not; batches differ by +-20-30% in loss, weights a few steps apart by far less
        # (a loss logged as a window's mean: the baseline read between its windows)
        gap = [(s, 100 * (v - b) / b) for s, v in loss if (b := at_step(data.baseline, s + shift(s)))]
        if gap:
            gax.plot(*zip(*gap), lw=1, color="#a50f15", label="gap to the baseline")
            clip_axis(gax, gap, [0.0])
        if gap and gap[-1][0] < loss[-1][0]:   # the rewinds' skipped batches ran the run past the baseline's data
            gax.text(0.99, 0.95, f"past step {gap[-1][0]} the baseline never trained on the batches this run did",
                     ha="right", va="top", transform=gax.transAxes, fontsize=7, color=BASELINE_COLOR)
        gax.axhline(0, color=BASELINE_COLOR, lw=0.8)
    else:
        gax.text(0.5, 0.5, NO_BASELINE, ha="center", va="center", transform=gax.transAxes, fontsize=8,
                 color=BASELINE_COLOR)
    gax.set_ylabel("gap to baseline\n(% of its loss on\nthe same batch)", fontsize=8)
    rewound = data.metrics.get("train/loss_rewound")
    if rewound:   # the loss that made the run rewind (never in train/loss: those steps were redone)
        ax.plot(*zip(*rewound), ls="", marker="X", ms=8, mfc=REWOUND_COLOR, mec="white",
                label="loss that caused a rewind", zorder=5)
    # the bulk of the loss sets the scale: a diverged step or a rewound loss of 9,000 is a
    # triangle on the edge with its value, not the axis that flattens a loss of 3
    clip_axis(ax, list(loss) + list(rewound or []), [v for _, v in data.baseline])
    mark_steps(ax, data, loss)
    mark_events(ax, data, labels=True)
    mark_events(gax, data)
    ax.set_ylabel("training loss (cross-entropy, nats/token)", fontsize=9)
    against = f"against {data.baseline_name}" if data.baseline_name else "against the baseline"
    ax.set_title(fit_title(f"{data.run_name}: training loss {against}; events numbered as on the timeline",
                           10.2, 11), loc="left", fontsize=11, pad=14)
    ax.legend(fontsize=8, ncol=3)
    gax.set_xlabel(STEP_LABEL)
    return fig


def batch_offsets(data: ReportData):
    """step -> how many batches later than the step's own index the run drew that step's batch:
    a rewind at step R back to B with `skip_batches` K (the REWIND event's evidence) moves every
    step from B on by R + 1 - B + K (each pass draws one batch; the data never goes back)."""
    skips = [int(e.evidence.get("skip_batches", 0) or 0) for e in data.events if e.kind == EventKind.REWIND]
    marks, off = [], 0
    for i, (step, back) in enumerate(rewinds(data)):
        off += step + 1 - back + (skips[i] if i < len(skips) else 0)
        marks.append((back, off))
    return lambda s: next((o for b, o in reversed(marks) if b <= s), 0)


def mark_steps(ax, data: ReportData, loss) -> None:
    """The skipped steps (no update: `skip_step`) and the accepted levels (`accept`: the step
    applied, the detectors rebased) as markers on the loss curve."""
    at = dict(loss)
    lo, hi = ax.get_ylim()
    for kind, marker, color, label in ((EventKind.SKIP_STEP, "o", "#cb181d", "skipped step (no update)"),
                                       (EventKind.ACCEPT, "D", "#737373", "new level accepted")):
        steps = sorted({e.step for e in data.events if e.kind == kind})
        if steps:
            ys = [min(max(at.get(s, lo), lo), hi) for s in steps]
            ax.plot(steps, ys, ls="", marker=marker, ms=7, mfc="none", mec=color, mew=1.5, zorder=5, label=label)


MAX_SIGNALS = 4   # series per fallback panel: the evidence's own signals, most relevant first
# the global signals a fallback's reason or evidence names (lowprec.policy.anomaly.AnomalyKind,
# the loss gap, the window's losses) -> the training curve that shows them
_GLOBAL_SIGNALS = {"loss": ("train/loss",), "losses": ("train/loss",), "loss_gap": ("train/loss",),
                   "loss_spike": ("train/loss",), "loss_large": ("train/loss",),
                   "grad_norm_spike": ("train/grad_norm",), "grad_norm_large": ("train/grad_norm",),
                   "nan_inf": ("train/loss", "train/grad_norm")}


def fallback_signal_keys(ev, site: str, data: ReportData) -> list[str]:
    """The logged series that show why `site` fell back at `ev`, at most `MAX_SIGNALS`: the
    site's `signal/<site>/<role>/<stat>` the evidence names (in its order), else the training
    curves of the global signals its reason or evidence names (`_GLOBAL_SIGNALS`); never the
    site's other series."""
    keys = [f"signal/{site}/{g['role']}/{g['signal']}" for g in signals_of(ev, site, data.thresholds)]
    if not any(k in data.metrics for k in keys):
        reason = str(ev.reason or "").replace(" ", "_")
        named = [n for n in _GLOBAL_SIGNALS if n in ev.evidence or n in reason]
        if any(n != "loss" and n != "losses" for n in named):   # a named detector: not the loss logged beside it
            named = [n for n in named if n not in ("loss", "losses")]
        keys = [k for n in named for k in _GLOBAL_SIGNALS[n]]
    return [k for k in dict.fromkeys(keys) if k in data.metrics][:MAX_SIGNALS]


def signals_figure(data: ReportData):
    import textwrap

    sites = fallback_sites(data.events)[:12]
    if not sites:
        return None
    fig, axes = panels(len(sites), 4.6, 3.1)
    drew_base = False
    for ax, site in zip(axes, sites):
        ev = next(e for e in data.events if e.kind == EventKind.FALLBACK and site in e.sites)
        sigs = signals_of(ev, site, data.thresholds)
        keys = fallback_signal_keys(ev, site, data)
        for k in keys:
            line, = ax.plot(*zip(*data.metrics[k]), lw=1, marker=".", ms=3, label="/".join(k.rsplit("/", 2)[-2:]))
            base = data.baseline_metrics.get(k) or (data.baseline if k == "train/loss" else None)
            if base:   # the same series in the baseline run
                drew_base = True
                ax.plot(*zip(*base), lw=0.9, ls="--", color=line.get_color(), alpha=0.6,
                        label=f"{'/'.join(k.rsplit('/', 2)[-2:])}, baseline")
        drawn = {k.rsplit("/", 1)[-1] for k in keys}
        for thr in sorted({float(g["threshold"]) for g in sigs if "threshold" in g and g["signal"] in drawn}):
            ax.axhline(thr, color="#a50f15", ls="--", lw=1, label="threshold")
        seen = set()
        for e in data.events:
            if (site in e.sites and e.kind in (EventKind.FALLBACK, EventKind.QUARANTINE, EventKind.RETRY,
                                               EventKind.ROLLBACK, EventKind.PROMOTE)) or e.kind == EventKind.REWIND:
                ax.axvline(e.step, color=EVENT_STYLE[e.kind][0], lw=1, ls=EVENT_STYLE[e.kind][1],
                           label=None if e.kind in seen else e.kind)
                seen.add(e.kind)
        stats = {k.rsplit("/", 1)[-1] for k in keys}
        ax.set_ylabel(unit_label(stats.pop()) if len(stats) == 1 else "value (see legend)", fontsize=7)
        ax.set_xlabel(STEP_LABEL, fontsize=7)
        title = fit_title(f"{site}: {ev.from_format.get(site, '?')} -> {ev.to_format.get(site, '?')} at step {ev.step}",
                          3.9, 8) + "\n" + textwrap.shorten(reason_text(ev, site, data.thresholds), 60)
        ax.set_title(title, fontsize=8, loc="left")
        ax.tick_params(labelsize=7)
        if not keys:
            ax.text(0.5, 0.5, "no logged signal named by the fallback's evidence", ha="center", va="center",
                    transform=ax.transAxes, fontsize=8)
    more = f" (first 12 of {len(fallback_sites(data.events))} sites)" if len(fallback_sites(data.events)) > 12 else ""
    # one legend under the panels (inside a panel it covered data, beside one it was cut off)
    seen: dict[str, object] = {}
    for ax in axes:
        for handle, text in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(text, handle)
    fig.legend(list(seen.values()), list(seen), loc="outside lower center", ncol=4, fontsize=7, frameon=False)
    # the baseline named only where its series are drawn
    base = (f"; dashed: {data.baseline_name}" if drew_base else
            f"; {data.baseline_name} logged none of these signals" if data.baseline_name else "")
    fig.suptitle(fit_title(f"{data.run_name}: the signals that triggered fallbacks{more}{base}",
                           4.4 * len(axes[:3]), 11), fontsize=11, x=0.01, ha="left")
    return fig


def hold_levels(points: list[tuple[int, float]], hold_rise: float | None,
                hold_above: float | None) -> list[tuple[int, float]]:
    """(step, level) at each probe that has one: above it, the controller holds a promotion
    (`lowprec.policy.controller.lr_hold_level`)."""
    out = []
    for i in range(len(points)):
        level, _ = lr_hold_level(points[:i + 1], hold_rise, hold_above)
        if level is not None:
            out.append((points[i][0], level))
    return out


def lr_sensitivity_figure(data: ReportData):
    points = data.metrics.get(LR_SENSITIVITY)
    if not points:
        return None
    fig = new_figure(11, 5.5)
    ax, lax = fig.subplots(2, 1, sharex=True, height_ratios=[3, 1.2])
    # a probe whose larger step diverged logs +inf (MLflow: 1.797e308, read back as inf by
    # report_sources): a triangle on the top edge, never a point that stretches the axis to it
    points, diverged = finite(points)
    if points:
        ax.plot(*zip(*points), "o-", ms=3, lw=1, color=CANDIDATE_COLOR, label="sensitivity (L_up - L_down) / |L0|")
    base_points, _ = finite(data.baseline_metrics.get(LR_SENSITIVITY, []))
    if base_points:
        ax.plot(*zip(*base_points), "s--", ms=3, lw=0.9, color=BASELINE_COLOR, label=baseline_label(data))
    ax.axhline(0, color=BASELINE_COLOR, lw=0.8)
    rise, above = data.thresholds.get("lr_hold_rise"), data.thresholds.get("lr_hold_above")
    if levels := hold_levels(points, rise, above):
        what = " or ".join(([f"{above:g}"] if above is not None else []) +
                           ([f"median of the {LR_HISTORY} probes before + {rise:g}"] if rise is not None else []))
        ax.plot(*zip(*levels), color="#d94801", ls="--", lw=0.8, marker="_", ms=12,
                label=f"hold level: {what} (the lower)" if " or " in what else f"hold level: {what}")
    if diverged:   # the larger virtual step's loss was not finite
        ax.plot([s for s, _ in diverged], [0.98] * len(diverged), ls="", marker="^", ms=8, color="#a50f15",
                transform=ax.get_xaxis_transform(), clip_on=False, label="larger step diverged (inf)")
    held = [e for e in data.events if e.kind == EventKind.HOLD]
    for i, e in enumerate(held):
        ax.axvline(e.step, color="#d94801", ls="-.", lw=1, label=None if i else "promotion held")
    mark_events(ax, data, (EventKind.PROMOTE, EventKind.FALLBACK, EventKind.ROLLBACK, EventKind.REWIND))
    ax.set_ylabel("LR sensitivity (relative loss change)", fontsize=9)
    ax.legend(fontsize=8)
    lr = data.metrics.get("train/lr")
    if lr:
        lax.plot(*zip(*lr), lw=1, color="#636363")
    else:
        lax.text(0.5, 0.5, "no train/lr logged", ha="center", va="center", transform=lax.transAxes, fontsize=8,
                 color="#636363")
    lax.set_ylabel("learning rate", fontsize=8)
    lax.set_xlabel(STEP_LABEL)
    ax.set_title(fit_title(f"{data.run_name}: sensitivity of the held loss to the learning rate (above 0: a "
                           f"larger step hurts more than a smaller one)", 10.2, 11), loc="left", fontsize=11)
    return fig


def report_figures(data: ReportData) -> dict[str, object]:
    """{name: matplotlib Figure} of every picture the data allows, in the order they are written
    (what `render_report` saves; a test reads the drawn lines back from these)."""
    from lowprec.tracking.report_time import time_figure  # it draws with this module's helpers
    from lowprec.tracking.report_experts import experts_figure
    out = {}
    for name, make in (("precision_timeline", timeline_figure), ("loss", loss_figure),
                       ("fallback_signals", signals_figure), ("lr_sensitivity", lr_sensitivity_figure),
                       ("evals", evals_figure), ("time_breakdown", time_figure), ("experts", experts_figure)):
        fig = make(data)
        if fig is not None:
            out[name] = fig
    return out


def render_report(data: ReportData, out_dir: str | Path) -> list[Path]:
    """Write every picture the data allows as PNG into `out_dir`; returns their paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in report_figures(data).items():
        path = out / f"{name}.png"
        fig.savefig(path)
        written.append(path)
    return written
