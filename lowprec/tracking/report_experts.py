"""Experts in `lowprec report`: `experts.png`, a layers-by-experts picture of a mixture of experts.

Drawn when the run's sites include experts (lowprec.sites.experts: `<experts module>.<index>`):

* left, each expert's format at the end of the final trajectory (`precision_history`, the
  precision map that MLflow keeps over time), one colour per format, the format's name in the
  cell;
* right, the tokens routed to each expert at the run's last check (`signal/<expert>/routed/tokens`,
  summed over the check window's statistics steps and all ranks), with the count in the cell:
  an expert in BF16 beside few tokens is where a stale scale was put back, one beside many is
  where precision was at fault.
"""

from __future__ import annotations

import re

from lowprec.tracking.report_sources import ReportData, precision_history
from lowprec.tracking.report_timeline import fit_title, new_figure

__all__ = ["experts_figure", "expert_grid"]

_EXPERT = re.compile(r"^(?P<layer>.+\.experts)\.(?P<index>\d+)$")
_COLORS = ("#2171b5", "#fd8d3c", "#74c476", "#9e9ac8", "#fec44f", "#e7298a", "#969696")


def expert_grid(names) -> tuple[list[str], int, dict[str, tuple[int, int]]]:
    """(experts modules in order, experts per module, site -> (row, column)) of the expert sites
    among `names`; ([], 0, {}) when there are none."""
    cells, layers = {}, []
    for n in names:
        m = _EXPERT.match(n)
        if m is None:
            continue
        if m["layer"] not in layers:
            layers.append(m["layer"])
        cells[n] = (layers.index(m["layer"]), int(m["index"]))
    width = 1 + max((c for _, c in cells.values()), default=-1)
    return layers, width, cells


def experts_figure(data: ReportData):
    """The picture (see the module docstring), or None for a run without experts."""
    history = precision_history(data)
    final = history[-1][1] if history else dict(data.initial)
    layers, width, cells = expert_grid(final)
    if not cells:
        return None
    import numpy as np
    from matplotlib.colors import ListedColormap
    formats = sorted(set(final[n] for n in cells))
    fmt_grid = np.full((len(layers), width), np.nan)
    tok_grid = np.full((len(layers), width), np.nan)
    for n, (r, c) in cells.items():
        fmt_grid[r, c] = formats.index(final[n])
        series = data.metrics.get(f"signal/{n}/routed/tokens")
        if series:
            tok_grid[r, c] = series[-1][1]
    fig = new_figure(max(6.0, 0.5 * width * 2 + 3), 1.2 + 0.45 * len(layers))
    ax_f, ax_t = fig.subplots(1, 2)
    ax_f.imshow(fmt_grid, cmap=ListedColormap(_COLORS[:max(1, len(formats))]), vmin=-0.5,
                vmax=len(formats) - 0.5, aspect="auto")
    ax_t.imshow(tok_grid, cmap="Greys", aspect="auto")
    for n, (r, c) in cells.items():
        ax_f.text(c, r, final[n].replace("fp8_", "").replace("_", "\n"), ha="center", va="center", fontsize=6,
                  color="white")
        if not np.isnan(tok_grid[r, c]):
            ax_t.text(c, r, f"{tok_grid[r, c]:.0f}", ha="center", va="center", fontsize=6, color="tab:red")
    for ax, title in ((ax_f, "format at the end"), (ax_t, "tokens routed, last check")):
        ax.set_title(title, fontsize=9)
        ax.set_yticks(range(len(layers)), layers, fontsize=7)
        ax.set_xticks(range(width), [str(i) for i in range(width)], fontsize=7)
        ax.set_xlabel("expert")
    fig.suptitle(fit_title(f"{data.run_name}: experts by layer ({', '.join(formats)})", 8.0, 10), fontsize=10,
                 x=0.01, ha="left")
    return fig
