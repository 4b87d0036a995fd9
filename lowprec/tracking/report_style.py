"""What every report picture shares: its colours, axis labels with units, legend names and panel grid."""

from __future__ import annotations

from lowprec.tracking.report_sources import ReportData
from lowprec.tracking.report_timeline import new_figure

__all__ = ["CANDIDATE_COLOR", "BASELINE_COLOR", "HP_COLOR", "STEP_LABEL", "NO_BASELINE", "unit_label",
           "candidate_label", "baseline_label", "panels"]

CANDIDATE_COLOR, BASELINE_COLOR, HP_COLOR = "#08519c", "#636363", "#d94801"
STEP_LABEL = "step (optimizer steps)"
NO_BASELINE = "no baseline run: pass lowprec report RUN --baseline RUN, or log train/baseline_loss"
# units of the eval metrics and signal statistics, by the last part of their name
_UNITS = {"acc": "accuracy (fraction, higher is better)", "acc_norm": "accuracy (fraction, higher is better)",
          "exact_match": "exact match (fraction, higher is better)",
          "bits_per_byte": "bits per byte (lower is better)", "perplexity": "perplexity (lower is better)",
          "byte_perplexity": "perplexity per byte (lower is better)",
          "word_perplexity": "perplexity per word (lower is better)",
          "saturated_frac": "saturated (fraction of elements)", "underflow_frac": "underflow (fraction of elements)",
          "underflow_energy_frac": "underflow (fraction of energy)", "sqnr_db": "SQNR (dB)",
          "rel_mse": "relative MSE", "amax": "absolute max", "nonfinite": "non-finite elements (count)",
          "loss": "training loss (nats/token)", "grad_norm": "gradient norm (L2)"}


def unit_label(name: str) -> str:
    """The y-axis label of an eval metric (`task/metric`) or a signal statistic, with its unit."""
    last = name.rsplit("/", 1)[-1].split(",")[0]
    return _UNITS.get(last, last)


def candidate_label(data: ReportData) -> str:
    return f"candidate: {data.run_name}"


def baseline_label(data: ReportData) -> str:
    return f"baseline: {data.baseline_name}" if data.baseline_name else "baseline (train/baseline_loss)"

def panels(n: int, width: float, height: float):
    """A figure of `n` panels, three to a row, each width x height inches; unused axes hidden."""
    cols = min(3, n)
    rows = -(-n // cols)
    fig = new_figure(width * cols, height * rows)
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    for ax in axes[n:]:
        ax.axis("off")
    return fig, axes[:n]


