"""The precision timeline: which format every site ran in at every step, and why it changed.

Layers down, steps across, a colour per format (lighter and cooler for more bits); a
triangle where a site fell back (numbered, the reasons listed under the plot), a cross
where it was quarantined, dashed lines at rollbacks and rewinds (the rewound, redone steps
hatched), dotted lines at promotions; stage-level events labelled in a strip above, staggered
so that none overlap; under it the share of GEMM FLOPs per format over time.

Made for a 30-layer model (120+ sites): one row per site, grouped and labelled by block
with the row order inside a block in the axis label (every row named when there are 40 or
fewer), white lines between blocks, one mesh for all cells (fast to draw). The helpers here
(colours, event styles, numbering) are shared with the other pictures in lowprec.tracking.report.
"""

from __future__ import annotations

import re

from lowprec.policy.events import Event, EventKind, site_list
from lowprec.tracking.records import number, tidy_numbers
from lowprec.tracking.report_scales import stagger
from lowprec.tracking.report_sources import ReportData, flops_share_steps, precision_history, rewinds, signals_of

__all__ = ["timeline_figure", "FORMAT_COLORS", "EVENT_STYLE", "new_figure", "numbered_events", "reason_text",
           "shade_rewound", "fit_title", "mark_events", "is_eval_metric"]

# Higher precision lighter/cooler, lower precision darker/warmer; FP8 blues-greens, FP4 oranges-reds.
FORMAT_COLORS = {"bf16": "#d9d9d9", "fp8_delayed": "#9ecae1", "fp8_tensorwise": "#4292c6",
                 "fp8_rowwise": "#2171b5", "fp8_blockwise": "#41ab5d", "mxfp8": "#238b45",
                 "mxfp4": "#fd8d3c", "nvfp4": "#d94801"}
_EXTRA = ["#807dba", "#e7298a", "#a6761d", "#66a61e", "#e6ab02"]
# a (colour, line style) per EventKind (tests/lowprec/tracking/test_report_events.py checks every kind has one)
EVENT_STYLE = {EventKind.PROMOTE: ("#238b45", ":"), EventKind.ROLLBACK: ("#cb181d", "--"),
               EventKind.REWIND: ("#67000d", "--"), EventKind.SKIP_STEP: ("#969696", ":"),
               EventKind.FALLBACK: ("#cb181d", "-"), EventKind.RETRY: ("#6a51a3", ":"),
               EventKind.QUARANTINE: ("#000000", "-"), EventKind.GATE: ("#08519c", "-."),
               EventKind.REPLAY: ("#fdae6b", ":"), EventKind.ACCEPT: ("#737373", "-."),
               EventKind.HOLD: ("#d94801", "-."), EventKind.WINDOW: ("#9e9ac8", ":"),
               EventKind.NOT_PRECISION: ("#54278f", "-."), EventKind.INCONCLUSIVE: ("#bcbddc", ":"),
               EventKind.ROUTER_FAULT: ("#8c6d31", "-.")}
_BLOCK = re.compile(r"^(.*?)\.(\d+)\.(.+)$")


def new_figure(w: float, h: float):
    from matplotlib.figure import Figure
    return Figure(figsize=(w, h), dpi=110, layout="constrained")


def fit_title(text: str, width_in: float, fontsize: float) -> str:
    """`text` wrapped to lines that fit `width_in` inches at `fontsize` points (a character
    is at most about 0.62 em wide in the default sans-serif font)."""
    import textwrap
    chars = max(12, int(width_in * 72 / (fontsize * 0.62)))
    lines = []
    for line in text.split("\n"):   # phrases ("a; b") packed whole where they fit, never cut mid-phrase
        cur = ""
        for phrase in re.split(r"(?<=;) ", line):
            if cur and len(cur) + 1 + len(phrase) <= chars:
                cur += " " + phrase
                continue
            if cur:
                lines.append(cur)
            *done, cur = textwrap.wrap(phrase, chars, break_long_words=True) or [""]
            lines += done
        lines.append(cur)
    return "\n".join(lines)


NOTE_CHARS = 150   # the event list's characters per line: 8 pt monospace (0.6 em a character) in ~10.5 in


def wrap_notes(lines: list[str], chars: int = NOTE_CHARS) -> list[str]:
    """The event list's lines wrapped to `chars`, continuations indented under the event's kind."""
    import textwrap
    return [w for line in lines for w in textwrap.wrap(line, chars, subsequent_indent=" " * 14,
                                                         break_long_words=True) or [""]]


def _color(fmt: str, order: list[str]) -> str:
    return FORMAT_COLORS.get(fmt) or _EXTRA[order.index(fmt) % len(_EXTRA)]


def _short(v) -> str:
    return number(v)


def reason_text(e: Event, site: str | None = None, thresholds: dict | None = None) -> str:
    """The triggering signals with their values and thresholds, else the event's reason."""
    parts = []
    for sig in (signals_of(e, site, thresholds) if site else [])[:2]:
        op = "<" if sig["signal"] == "sqnr_db" else ">"
        thr = f" {op} {_short(sig['threshold'])}" if "threshold" in sig else ""
        val = f" {_short(sig['value'])}" if "value" in sig else ""
        parts.append(f"{sig.get('role', '')} {sig['signal']}{val}{thr}".strip())
    return ", ".join(parts) or tidy_numbers(e.reason)


# ------------------------------------------------------------------ precision timeline
def _rows(sites: list[str]) -> tuple[list[str], list[tuple[str, int, int]]]:
    """Sites in model order and the block groups (label, first row, last row)."""
    groups: list[tuple[str, int, int]] = []
    for i, s in enumerate(sites):
        m = _BLOCK.match(s)
        label = f"{m.group(1)}.{m.group(2)}" if m else s
        if groups and groups[-1][0] == label:
            groups[-1] = (label, groups[-1][1], i)
        else:
            groups.append((label, i, i))
    return sites, groups


def _format_grid(data: ReportData, sites: list[str], fmts: list[str], last: int, history):
    """Column edges (steps) and a sites x columns matrix of format indices, from the precision
    history of the final trajectory (`report_sources.precision_history`)."""
    starts = [(max(s, data.initial_step), fm) for s, fm in history if s < last]
    edges = [s for s, _ in starts] + [last]
    grid = [[fmts.index(fm[s]) for s in sites] for _, fm in starts]
    return edges, [list(col) for col in zip(*grid)]


def _place_labels(items: list[tuple[float, str, str]], span: float, levels: int = 3) -> list[tuple[float, int, str, str]]:
    """Stagger labels (x, text, colour) over `levels` rows so that close ones do not overlap."""
    placed, last_x = [], [-float("inf")] * levels
    for x, text, color in sorted(items, key=lambda t: t[0]):
        width = span * (0.012 * len(text) + 0.01)
        lvl = next((i for i in range(levels) if x >= last_x[i]), min(range(levels), key=lambda i: last_x[i]))
        last_x[lvl] = x + width
        placed.append((x, lvl, text, color))
    return placed


def timeline_figure(data: ReportData):
    sites, groups = _rows(list(data.initial))
    if not sites:
        return None
    from matplotlib.colors import BoundaryNorm, ListedColormap
    from matplotlib.lines import Line2D
    from matplotlib.patches import Patch
    row = {s: i for i, s in enumerate(sites)}
    last = max(data.last_step, data.initial_step + 1)
    fmts = list(dict.fromkeys(list(data.initial.values()) + [f for e in data.events for f in e.to_format.values()]))
    n = len(sites)
    history = precision_history(data)
    share_steps, share = flops_share_steps(data, history)
    notes = _notes(data)
    shown = notes[:30] + ([f"    ... {len(notes) - 30} more in the events.json table"] if len(notes) > 30 else [])
    shown = wrap_notes(shown)
    heights = [0.55, max(3.0, 0.075 * n), 1.1 if share else 0.0, 0.3 + 0.15 * max(len(shown), 1)]
    fig = new_figure(13, sum(heights) + 0.9)
    gs = fig.add_gridspec(4, 1, height_ratios=heights, hspace=0.02)
    ax = fig.add_subplot(gs[1])
    strip = fig.add_subplot(gs[0], sharex=ax)
    edges, grid = _format_grid(data, sites, fmts, last, history)
    cmap = ListedColormap([_color(f, fmts) for f in fmts])
    ax.pcolormesh(edges, range(n + 1), grid, cmap=cmap, norm=BoundaryNorm(range(len(fmts) + 1), len(fmts)))
    # Few sites: every row named. Many: one label per block, thin white lines between blocks,
    # and the order of the rows inside a block in the axis label.
    if n <= 40:
        ax.set_yticks([i + 0.5 for i in range(n)], sites, fontsize=8)
    else:
        ax.set_yticks([(a + b + 1) / 2 for _, a, b in groups], [g[0] for g in groups],
                      fontsize=7 if len(groups) > 20 else 8)
        sub = [m.group(3) for s in sites[groups[0][1]:groups[0][2] + 1] if (m := _BLOCK.match(s))]
        if len(groups) < n and sub:
            ax.set_ylabel("rows in each block, top to bottom: " + ", ".join(sub), fontsize=8)
    for _, a, _ in groups[1:]:
        ax.axhline(a, color="white", lw=1.0)
    ax.set_ylim(n, 0)
    ax.set_xlim(data.initial_step, last)
    _draw_markers(ax, data, row)
    _draw_strip(strip, ax, data, last)
    kinds = {e.kind for e in data.events} | ({EventKind.REWIND} if rewinds(data) else set())
    handles = [Patch(facecolor=_color(f, fmts), edgecolor="#999999", label=f) for f in fmts] + [h for k, h in (
        (EventKind.FALLBACK, Line2D([], [], ls="", marker="^", ms=8, mfc="white", mec="black", label="fallback (numbered)")),
        (EventKind.QUARANTINE, Line2D([], [], ls="", marker="X", ms=8, mfc="black", mec="white", label="quarantined")),
        (EventKind.PROMOTE, Line2D([], [], color=EVENT_STYLE[EventKind.PROMOTE][0], ls=":", label="promote")),
        (EventKind.ROLLBACK, Line2D([], [], color=EVENT_STYLE[EventKind.ROLLBACK][0], ls="--", label="rollback")),
        (EventKind.REWIND, Line2D([], [], color=EVENT_STYLE[EventKind.REWIND][0], ls="--", label="rewind")),
        (EventKind.REWIND, Patch(facecolor="none", edgecolor="#67000d", hatch="////", label="rewound (redone)")))
        if k in kinds]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.005, 1.0), fontsize=8, frameon=False)
    ax.tick_params(axis="x", labelsize=8)
    ax.set_xlabel("step", fontsize=9)
    if share:
        sax = fig.add_subplot(gs[2], sharex=ax)
        # the same history as the timeline above: one value per precision map, held to its end
        order = [f for f in fmts if f in share] + [f for f in share if f not in fmts]
        steps, ys = share_steps + [last], [share[f] + share[f][-1:] for f in order]
        sax.stackplot(steps, ys, colors=[_color(f, order) for f in order], step="post")
        sax.set_ylim(0, 1)
        sax.set_ylabel("GEMM FLOP\nshare", fontsize=8)
        sax.tick_params(labelsize=7)
        sax.xaxis.set_tick_params(labelbottom=False)
    tax = fig.add_subplot(gs[3])
    tax.axis("off")
    tax.text(0, 1, "\n".join(shown) if shown else "no fallbacks, rollbacks or rewinds", va="top", ha="left",
             fontsize=8, family="monospace", transform=tax.transAxes)
    fig.suptitle(fit_title(f"{data.run_name}: precision of each of {n} sites over training", 12.5, 11),
                 fontsize=11, x=0.01, ha="left")
    return fig


def numbered_events(data: ReportData):
    """(number, event, site or None) for each numbered marker, in event order."""
    k = 0
    for e in data.events:
        if e.kind == EventKind.FALLBACK:
            for s in e.sites:
                k += 1
                yield k, e, s
        elif e.kind in (EventKind.ROLLBACK, EventKind.REWIND):
            k += 1
            yield k, e, None


def _evidence(key: str, v) -> str:
    """`skip_batches 100`, or a detector's `loss_spike 3.9 > 3.1 at step 1690`."""
    if not isinstance(v, dict):
        return f"{key} {_short(v)}"
    value, limit = v.get("value", v.get("gap")), v.get("limit", v.get("threshold"))
    text = key + (f" {_short(value)}" if value is not None else "") + (f" > {_short(limit)}" if limit is not None else "")
    return text + (f" at step {v['step']}" if "step" in v else "")


def _notes(data: ReportData) -> list[str]:
    out = []
    for k, e, s in numbered_events(data):
        if s is not None:
            out.append(f"{k:>2}  step {e.step:<6} fallback  {s}: {e.from_format.get(s, '?')} -> "
                       f"{e.to_format.get(s, '?')}  ({reason_text(e, s, data.thresholds)})")
        else:
            extra = "".join(f", {_evidence(key, v)}" for key, v in e.evidence.items()
                            if isinstance(v, dict) or key in ("to_step", "checkpoint_step", "skip_batches",
                                                              "value", "threshold"))
            what = (f"{e.stage or '?'} up: {site_list(e.sites)}" if e.kind == EventKind.ROLLBACK else "training")
            if e.kind == EventKind.REWIND and "to_step" not in e.evidence and "checkpoint_step" not in e.evidence:
                back = dict(data.metrics.get("train/rewound_to", [])).get(e.step)
                what += f" back to step {int(back)}" if back is not None else ""
            out.append(f"{k:>2}  step {e.step:<6} {e.kind:<9} {what}  ({tidy_numbers(e.reason)}{extra})")
    for e in data.events:
        if e.kind == EventKind.QUARANTINE:
            out.append(f" X  step {e.step:<6} quarantine {site_list(e.sites)}  ({tidy_numbers(e.reason)})")
    return out


def _draw_markers(ax, data: ReportData, row) -> None:
    from matplotlib.transforms import offset_copy
    for k, e, s in numbered_events(data):
        if s is None:
            color, ls = EVENT_STYLE[e.kind]
            ax.axvline(e.step, color=color, ls=ls, lw=1.4, zorder=4)
            continue
        ax.plot(e.step, row[s] + 0.5, marker="^", ms=8, mfc="white", mec="black", mew=1.0, zorder=5)
        ax.annotate(str(k), (e.step, row[s] + 0.5), xytext=(6, 0), textcoords="offset points", fontsize=7.5,
                    fontweight="bold", va="center", zorder=6,
                    bbox=dict(boxstyle="round,pad=0.12", fc="white", ec="none", alpha=0.85))
    shade_rewound(ax, data, zorder=3)
    for e in data.events:
        if e.kind == EventKind.QUARANTINE:
            # Shifted left: a quarantine usually comes with a fallback at the same step and spot.
            shifted = offset_copy(ax.transData, fig=ax.figure, x=-10, units="points")
            for s in e.sites:
                ax.plot(e.step, row[s] + 0.5, marker="X", ms=8, mfc="black", mec="white", mew=0.8, zorder=6,
                        transform=shifted)
        elif e.kind in (EventKind.PROMOTE, EventKind.RETRY):
            ax.axvline(e.step, color=EVENT_STYLE[e.kind][0], ls=":", lw=1.2, zorder=4)


REWOUND_COLOR = "#67000d"


def shade_rewound(ax, data: ReportData, label: str | None = None, **kw) -> bool:
    """Hatch the steps each rewind went back over (its target to the step that rewound),
    from the REWIND events and `train/rewound_to`; True when there was one."""
    spans = [(back, step) for step, back in rewinds(data) if back < step]
    for i, (back, step) in enumerate(spans):
        ax.axvspan(back, step, facecolor="none", edgecolor=REWOUND_COLOR, hatch="////", lw=0,
                   label=label if i == 0 else None, **kw)
    return bool(spans)


def _draw_strip(strip, ax, data: ReportData, last: int) -> None:
    """Labels of stage-level events above the timeline, staggered so that none overlap."""
    strip.axis("off")
    strip.set_ylim(3, 0)
    items, num = [], {id(e): k for k, e, s in numbered_events(data) if s is None}
    for e in data.events:
        color = EVENT_STYLE[e.kind][0]
        if e.kind == EventKind.PROMOTE:
            items.append((e.step, f"promote {e.stage or ''}".strip(), color))
        elif e.kind in (EventKind.ROLLBACK, EventKind.REWIND):
            items.append((e.step, f"{num[id(e)]} {e.kind}", color))
        elif e.kind == EventKind.RETRY:
            items.append((e.step, "retry " + ", ".join(e.sites[:1]), color))
        elif e.kind == EventKind.GATE:
            v = str(e.evidence.get("verdict", e.reason))
            items.append((e.step, f"gate {e.stage + ' ' if e.stage else ''}{v}", "#006d2c" if v == "pass" else "#a50f15"))
        elif e.kind == EventKind.HOLD:
            items.append((e.step, f"hold {e.stage or ''}".strip(), color))
        elif e.kind == EventKind.NOT_PRECISION:   # a window judged: what precision was cleared of
            items.append((e.step, "not precision", color))
    for x, lvl, text, color in _place_labels(items, last - data.initial_step):
        strip.text(x, lvl + 0.5, text, fontsize=7.5, color=color, va="center", ha="left", clip_on=False,
                   bbox=dict(boxstyle="round,pad=0.15", fc="white", ec=color, lw=0.6))
        strip.plot([x, x], [lvl + 0.5, 3], color=color, lw=0.6)


def is_eval_metric(key: str) -> bool:
    """An eval result: `eval/<task>/<metric>`, not its stderr or interval, not how long the eval
    took (`eval/seconds` in older runs, `time/*` now) and not `eval_mode/*`."""
    name = key[len("eval/"):] if key.startswith("eval/") else ""
    last = name.rsplit("/", 1)[-1]
    return bool(name) and not last.endswith(("_stderr", "_ci_low", "_ci_high")) and \
        last not in ("seconds", "time", "duration") and not last.endswith(("_seconds", "_time"))


def mark_events(ax, data: ReportData, kinds=(EventKind.FALLBACK, EventKind.ROLLBACK, EventKind.REWIND,
                                              EventKind.PROMOTE), labels: bool = False) -> None:
    """Vertical lines at events (one legend entry per kind); numbered as on the timeline."""
    seen, num, at_step = set(), {}, {}
    for k, e, s in numbered_events(data):
        num.setdefault(id(e), []).append(str(k))
    for e in data.events:  # one label per step: events at the same step share it
        if e.kind in kinds:
            at_step.setdefault(e.step, []).extend(num.get(id(e), []) or [e.stage or e.kind])
    if labels:   # staggered: labels of nearby steps in rows, none over another
        stagger(ax, [(step, t, next(EVENT_STYLE[e.kind][0] for e in data.events if e.step == step and e.kind in kinds))
                     for step, texts in at_step.items() for t in dict.fromkeys(texts)])
    for e in data.events:
        if e.kind not in kinds:
            continue
        color, ls = EVENT_STYLE[e.kind]
        ax.axvline(e.step, color=color, ls=ls, lw=1, alpha=0.8, label=None if e.kind in seen else e.kind)
        seen.add(e.kind)
    if EventKind.REWIND in kinds:
        shade_rewound(ax, data, label="rewound (redone)", alpha=0.35)
