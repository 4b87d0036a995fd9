"""`evals.png`: eval results per checkpoint beside the baseline run's, gate verdicts and events marked.

Fast in-loop evals and full ones (`eval_mode/<prefix>`, `eval_modes`) are separate series:
the fast ones joined by a line, the full ones larger markers joined to nothing; the same
weights in high precision (`eval_hp/...`) hollow, under the candidate. Intervals are 95%
(+-1.96 stderr, or the logged `_ci_low`/`_ci_high`). What a run can log that would make the
picture lie is drawn for what it is (lowprec.tracking.report_scales): perplexities on a log
axis with intervals cut at 1 (a perplexity is never below), tick labels of at most 4 digits,
an eval taken on weights a rewind abandoned (`abandoned/eval/...`) as a red cross beside its
gate verdict, a non-finite value as a triangle on the top edge, the run's final eval at the
run's last training step, an interval logged as 0 called so.
"""

from __future__ import annotations

import math

from lowprec.policy.events import EventKind
from lowprec.tracking.report_scales import clip_axis, compact_ticks, log_axis, stagger
from lowprec.tracking.report_sources import ReportData
from lowprec.tracking.report_style import (BASELINE_COLOR, CANDIDATE_COLOR, HP_COLOR, NO_BASELINE, STEP_LABEL,
                                           baseline_label, candidate_label, panels, unit_label)
from lowprec.tracking.report_timeline import fit_title, is_eval_metric, mark_events

__all__ = ["evals_figure", "eval_modes"]

def _eval_series(metrics: dict, prefix: str = "eval") -> dict[str, tuple[list, list, list]]:
    """{task/metric: (steps, values, [(below, above)] of the 95% interval)} of `<prefix>/...`."""
    out = {}
    for k, pts in metrics.items():
        if not k.startswith(prefix + "/") or not is_eval_metric("eval/" + k[len(prefix) + 1:]):
            continue
        se, lo, hi = dict(metrics.get(k + "_stderr", [])), dict(metrics.get(k + "_ci_low", [])), dict(metrics.get(k + "_ci_high", []))
        ys = [v for _, v in pts]
        low = [v - (v - lo[s] if s in lo else 1.96 * se.get(s, 0.0)) for s, v in pts]
        high = [v + (hi[s] - v if s in hi else 1.96 * se.get(s, 0.0)) for s, v in pts]
        out[k[len(prefix) + 1:]] = ([s for s, _ in pts], ys, [(y - a, b - y) for y, a, b in zip(ys, low, high)])
    return out


def eval_modes(metrics: dict, prefix: str, steps: list[int]) -> list[tuple[str, list[int], bool]]:
    """The steps of one eval series split by the kind of eval (`eval_mode/<prefix>`, 1 full, 0 fast,
    `Tracker.log_eval(mode=...)`): [(what, steps, full)], in-loop (fast) first; one unnamed group where
    the run logged no modes or only one kind."""
    mode = dict(metrics.get(f"eval_mode/{prefix}", []))
    full = [s for s in steps if mode.get(s) == 1.0]
    fast = [s for s in steps if s in mode and mode[s] != 1.0]
    rest = [s for s in steps if s not in mode]
    if not (full and (fast or rest)):
        return [("", steps, False)]
    return [("in-loop (fast) evals", fast + rest, False),
            ("final (full) eval" if len(full) == 1 else "full evals", full, True)]


def _draw_evals(ax, series, metrics: dict, prefix: str, color: str, label: str, marker: str, z: float,
                hollow: bool = False, last: int | None = None) -> None:
    """One eval series with its intervals: fast in-loop evals joined by a line, full evals as
    larger unjoined markers (the two kinds measure different things and are never one line).
    An eval after step `last` (the run's final one, logged at its step count) is drawn at `last`,
    the last step trained; a non-finite value as a triangle on the top edge."""
    steps, ys, err = series
    at = {s: (y, e) for s, y, e in zip(steps, ys, err)}
    x = (lambda s: s) if last is None else (lambda s: min(s, last))
    for what, group, full in eval_modes(metrics, prefix, steps):
        if not group:
            continue
        bad = [s for s in group if not math.isfinite(at[s][0])]
        group = [s for s in group if math.isfinite(at[s][0])]
        if bad:
            ax.plot([x(s) for s in bad], [0.97] * len(bad), ls="", marker="^", ms=8, color="#a50f15", zorder=z + 1,
                    transform=ax.get_xaxis_transform(), clip_on=False, label="not finite (inf or NaN)")
        gy, ge = [at[s][0] for s in group], [at[s][1] for s in group]
        if not group:
            continue
        ax.errorbar([x(s) for s in group], gy, yerr=list(zip(*ge)), fmt="none", lw=1, capsize=3, ecolor=color, zorder=z)
        # a hollow series is drawn wide and light under the others, its markers larger: where the
        # two coincide, the thin line and small dots of the other lie inside it and both are seen
        ms = (11 if full else 9) if hollow else (8 if full else 5)
        ax.plot([x(s) for s in group], gy, marker=marker, ls="" if full else "-", ms=ms, lw=4 if hollow else 1,
                color=color, alpha=0.45 if hollow else 1.0, mfc="none" if hollow else color, mew=1.6 if hollow else 1,
                zorder=z + 0.5, label=f"{label}, {what}" if what else label)


def _interval_note(metrics: dict, name: str, err) -> str:
    """The panel title's word on the interval: drawn, logged as 0, or not logged."""
    if any(a or b for a, b in err):
        return "95% interval"
    logged = any(f"eval/{name}{end}" in metrics for end in ("_stderr", "_ci_low", "_ci_high"))
    return "interval logged as 0" if logged else "no interval logged"


def _perplexity(name: str, series):
    """A perplexity's interval cut at 1 (exp of a cross-entropy: never below)."""
    steps, ys, err = series
    return steps, ys, [(min(a, y - 1.0) if y >= 1 else 0.0, b) for y, (a, b) in zip(ys, err)]


def _abandoned(ax, data: ReportData, name: str, last: int) -> None:
    """Evals taken on weights a rewind then abandoned (their gate verdicts are drawn too)."""
    pts = data.metrics.get(f"abandoned/eval/{name}") or []
    for i, (s, v) in enumerate(pts):
        kw = dict(ls="", marker="X", ms=8, color="#a50f15", mec="white", zorder=6,
                  label=None if i else "eval on weights a rewind abandoned")
        if math.isfinite(v):
            ax.plot([min(s, last)], [v], **kw)
        else:
            ax.plot([min(s, last)], [0.97], transform=ax.get_xaxis_transform(), clip_on=False, **kw)


def evals_figure(data: ReportData):
    series = _eval_series(data.metrics)
    if not series:
        return None
    base_series = _eval_series(data.baseline_metrics)
    hp_series = _eval_series(data.metrics, "eval_hp")
    base_last = data.baseline[-1][0] if data.baseline else None
    last = data.last_step
    fig, axes = panels(len(series), 4.3, 3.2)
    for ax, (name, s3) in zip(axes, sorted(series.items())):
        ppl = name.rsplit("/", 1)[-1].endswith("perplexity")
        fix = (lambda v: _perplexity(name, v)) if ppl else (lambda v: v)
        note = _interval_note(data.metrics, name, s3[2])
        _draw_evals(ax, fix(s3), data.metrics, "eval", CANDIDATE_COLOR, candidate_label(data), "o", 3, last=last)
        if name in base_series:   # the baseline run's evals (a baseline often has only its final one)
            bys = [v for v in base_series[name][1] if math.isfinite(v)]
            _draw_evals(ax, fix(base_series[name]), data.baseline_metrics, "eval", BASELINE_COLOR,
                        baseline_label(data), "D", 2, last=base_last)
            if bys:
                ax.axhline(bys[-1], color=BASELINE_COLOR, ls=":", lw=0.8)
        hp = hp_series.get(name)
        if hp:   # the same weights in high precision, under the candidate: the gap is what precision costs
            _draw_evals(ax, fix(hp), data.metrics, "eval_hp", HP_COLOR, "same weights, high precision", "s", 1,
                        hollow=True, last=last)
        _abandoned(ax, data, name, last)
        verdicts = []
        for e in data.events:
            if e.kind == EventKind.GATE:
                v = str(e.evidence.get("verdict", e.reason))
                color = "#006d2c" if v == "pass" else "#a50f15"
                ax.axvline(e.step, color=color, ls="-.", lw=0.9)
                verdicts.append((e.step, v, color))
        mark_events(ax, data, (EventKind.PROMOTE, EventKind.FALLBACK, EventKind.ROLLBACK, EventKind.REWIND))
        ax.set_title(fit_title(f"{name} ({note})", 3.9, 9), fontsize=9, loc="left", pad=12 + 9 * _rows(verdicts, max(last, 1)))
        ax.tick_params(labelsize=7)
        ax.set_xlabel(STEP_LABEL, fontsize=8)
        # the scale from the run's own evals and the baseline's: an eval on weights a rewind
        # abandoned (diverged, say) is a triangle on the edge with its value, not the scale
        ours = [v for v in s3[1] if math.isfinite(v)]
        others = [v for ss in (base_series.get(name), hp) if ss for v in ss[1] if math.isfinite(v)]
        spans_decades = ppl and ours and min(ours) > 0 and max(ours + others) / min(ours + others) > 30
        ax.set_ylabel(unit_label(name) + (", log scale" if spans_decades else ""), fontsize=8)
        if spans_decades:
            log_axis(ax)
        else:   # at most 4 digits, no offset text above the axis, where the verdicts are written
            compact_ticks(ax, ours + others)
            clip_axis(ax, list(zip(s3[0], s3[1])) + data.metrics.get(f"abandoned/eval/{name}", []), others)
        stagger(ax, verdicts)
    # one legend for every panel (they draw the same series), under the panels: never over the data
    seen: dict[str, object] = {}
    for ax in axes:
        for handle, text in zip(*ax.get_legend_handles_labels()):
            seen.setdefault(text, handle)
    fig.legend(list(seen.values()), list(seen), loc="outside lower center", ncol=3, fontsize=7, frameon=False)
    against = f"against {data.baseline_name} (dotted: its last)" if base_series else f"({NO_BASELINE})"
    fig.suptitle(fit_title(f"{data.run_name}: evals per checkpoint {against}\ngate verdicts dash-dotted; stage "
                           f"changes, fallbacks and rewinds as on the loss picture", 4.1 * len(axes[:3]), 11),
                 fontsize=11, x=0.01, ha="left")
    return fig


def _rows(verdicts, span: int) -> int:
    """Extra label rows the verdicts may take (stagger's): 0 where none are close."""
    steps = sorted({s for s, _, _ in verdicts})
    return int(any(b - a < 0.08 * span for a, b in zip(steps, steps[1:])))
