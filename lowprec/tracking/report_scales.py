"""Axes that stay readable whatever a run logged: non-finite values, outliers, constant and huge series.

The report's pictures (lowprec.tracking.report) use these so that one diverged step, a
metric stored as MLflow's stand-in for infinity or a series that never moved leaves the rest
of the picture readable:

* `as_inf(v)`: MLflow stores +-inf as +-1.797e308 (the largest double) and reads it back as
  that number; this turns it back into +-inf (NaN stays NaN).
* `finite(points)`: the (step, value) points with a finite value, the others apart.
* `clip_axis(ax, values, keep)`: the y limits from the bulk of the values (those within 20
  median absolute deviations of their median, widened by what `keep` must show, e.g. the
  baseline), each value beyond drawn as a triangle on the edge with its value written beside,
  so one spike of 9,000 does not flatten a loss of 3; `at_step`: a series read between its
  logged steps.
* `compact_ticks(ax)`: tick labels with at most 4 significant digits (no 22-digit integers,
  no `0.0000000000000000000` on an axis whose values are all 0) and y limits around a
  constant series; `log_axis(ax)`: a logarithmic y axis for perplexities (always >= 1).
* `stagger(ax, items)`: labels above the plot (step, text, colour), each at the lowest of
  a few rows where it overlaps no other.
"""

from __future__ import annotations

import math

__all__ = ["MLFLOW_INF", "as_inf", "finite", "clip_axis", "at_step", "compact_ticks", "log_axis", "stagger", "tick_text"]

MLFLOW_INF = 1.7976931348623157e308    # what MLflow stores for +inf (and - for -inf)
OFF_SCALE_COLOR = "#67000d"


def as_inf(v: float) -> float:
    return math.copysign(math.inf, v) if abs(v) >= MLFLOW_INF else v


def finite(points) -> tuple[list[tuple[int, float]], list[tuple[int, float]]]:
    """(the points with a finite value, the others)."""
    ok = [(s, v) for s, v in points if math.isfinite(v)]
    return ok, [(s, v) for s, v in points if not math.isfinite(v)]


def tick_text(v: float) -> str:
    """A tick label of at most 4 significant digits: 0.25, 3.5, 1,200, 2.5e+08."""
    if v == 0 or not math.isfinite(v):
        return "0" if v == 0 else str(v)
    if 1e-3 <= abs(v) < 1e5:
        return f"{v:,.4g}" if abs(v) >= 1000 else f"{v:.4g}"
    return f"{v:.3g}"


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    i = (len(xs) - 1) * q
    lo, hi = math.floor(i), math.ceil(i)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def clip_axis(ax, values: list[tuple[int, float]], keep: list[float] = (), *, margin: float = 0.1,
              spread: float = 20.0) -> list[tuple[int, float]]:
    """Set ax's y limits to the bulk of `values` (and everything in `keep`); a value further from
    their median than `spread` times their median absolute deviation (at least 10% of the
    median) is drawn as a triangle on the edge with its value, and left off the scale. Returns
    the points left off. Infinite values count as off the scale."""
    ys = sorted(v for _, v in values if math.isfinite(v))
    if len(ys) < 3:
        return []
    med = _percentile(ys, 0.5)
    mad = _percentile(sorted(abs(v - med) for v in ys), 0.5)
    reach = spread * max(mad, 0.1 * abs(med), 1e-12)
    kept = [v for v in keep if math.isfinite(v)]
    off = [(s, v) for s, v in values if not abs(v - med) <= reach]
    if not off:
        return []
    inside = [v for _, v in values if abs(v - med) <= reach] + kept
    lo, hi = min(inside), max(inside)
    pad = margin * ((hi - lo) or abs(hi) or 1.0)
    ax.set_ylim(lo - pad, hi + pad)
    edge = ax.get_xaxis_transform()
    for i, (s, v) in enumerate(off):
        y, marker, va = (0.98, "^", "top") if v > hi else (0.02, "v", "bottom")
        ax.plot([s], [y], ls="", marker=marker, ms=7, color=OFF_SCALE_COLOR, transform=edge, zorder=6, clip_on=False,
                label=None if i else "off the scale (value written beside)")
        ax.annotate(tick_text(v), (s, y), xycoords=edge, xytext=(5, 0), textcoords="offset points", fontsize=6,
                    color=OFF_SCALE_COLOR, va=va, ha="left")
    return off


def at_step(points: list[tuple[int, float]], step: float) -> float | None:
    """The series' value at `step`: logged there, else linear between the logged steps around it
    (None outside them)."""
    for (s0, v0), (s1, v1) in zip(points, points[1:]):
        if s0 <= step <= s1:
            return v0 if s1 == s0 else v0 + (v1 - v0) * (step - s0) / (s1 - s0)
    return points[0][1] if points and points[0][0] == step else None


def compact_ticks(ax, ys: list[float] = ()) -> None:
    """At most 4 significant digits on the y ticks, no offset text; around a constant series
    (every finite value the same) limits of +-5% of it (+-0.05 around 0)."""
    from matplotlib.ticker import FuncFormatter
    vals = [v for v in ys if math.isfinite(v)]
    if vals and max(vals) - min(vals) <= 1e-12 * max(1.0, abs(vals[0])):
        d = 0.05 * abs(vals[0]) or 0.05
        ax.set_ylim(vals[0] - d, vals[0] + d)
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: tick_text(v)))


def log_axis(ax) -> None:
    """A log y axis with compact labels (for perplexities: >= 1, often spanning decades)."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, numticks=6))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: tick_text(v)))
    ax.yaxis.set_minor_formatter(NullFormatter())


def stagger(ax, items: list[tuple[float, str, str]], fontsize: float = 7, rows: int = 3) -> None:
    """Write each (step, text, colour) above ax at its step, in the lowest row where it does not
    overlap a label already placed (texts at one step are joined first)."""
    joined: dict[float, tuple[list[str], str]] = {}
    for step, text, color in items:
        texts, _ = joined.setdefault(step, ([], color))
        if text not in texts:
            texts.append(text)
    x0, x1 = ax.get_xlim()
    width_in = ax.get_position().width * ax.figure.get_figwidth()
    per_char = (x1 - x0) * (fontsize * 0.62 / 72) / max(width_in, 0.1)   # steps per character
    placed: list[list[tuple[float, float]]] = [[] for _ in range(rows)]
    top = ax.get_xaxis_transform()
    for step in sorted(joined):
        texts, color = joined[step]
        text = ",".join(texts)
        half = (len(text) + 1) * per_char / 2
        row = next((r for r in range(rows) if all(step + half < a or step - half > b for a, b in placed[r])),
                   rows - 1)
        placed[row].append((step - half, step + half))
        ax.text(step, 1.01 + 0.07 * row, text, transform=top, fontsize=fontsize, color=color, ha="center",
                va="bottom")
