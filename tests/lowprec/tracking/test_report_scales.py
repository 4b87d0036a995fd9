"""What a run can log that made `lowprec report`'s pictures lie or unreadable (issues 54 and 56),
each on recorded figures: a constant or huge eval, a perplexity interval below zero, an eval on
weights a rewind abandoned, skipped steps and accepted levels, a loss spike, MLflow's stand-in
for infinity, the final eval one step late, a gap across a rewind, a legend cut off, a baseline
promised and not drawn, a title cut mid-phrase, labels over each other."""

from __future__ import annotations

import math
import warnings


from lowprec.policy.events import Event, EventKind
from lowprec.tracking.records import LR_SENSITIVITY
from lowprec.tracking.report import evals_figure, loss_figure, lr_sensitivity_figure, signals_figure
from lowprec.tracking.report_scales import MLFLOW_INF, as_inf, stagger
from lowprec.tracking.report_sources import ReportData, _final_trajectory
from lowprec.tracking.report_timeline import fit_title, new_figure

SITE = "blocks.0.mlp.fc"


def _drawn(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig).draw()
    return fig


def _panel(fig, name):
    return next(ax for ax in fig.axes if ax.get_title(loc="left").startswith(name))


def _ticks(ax) -> list[str]:
    return [t.get_text() for t in ax.get_yticklabels() if t.get_text()]


def _labelled(ax, label):
    return [ln for ln in ax.lines if ln.get_label() == label]


def test_eval_axes_read_short_and_intervals_stay_where_values_can_be():
    loss = [(s, 3.0) for s in range(20)]
    metrics = {"train/loss": loss,
               "eval/cloze/acc": [(10, 0.0), (20, 0.0)], "eval/cloze/acc_stderr": [(10, 0.0), (20, 0.0)],
               "eval/cloze/perplexity": [(10, 1.0e8), (20, 2.0e7)],
               "eval/cloze/perplexity_stderr": [(10, 6.0e7), (20, 2.0e7)],
               "eval/held/word_perplexity": [(10, 3.0e21), (20, 2.0e21)]}
    fig = _drawn(evals_figure(ReportData("run", {}, 0, [], metrics)))
    acc = _panel(fig, "cloze/acc")
    assert "(interval logged as 0)" in acc.get_title(loc="left")        # logged, not missing
    assert _ticks(acc) and all(len(t) <= 6 for t in _ticks(acc)), _ticks(acc)   # not 0.0000000000000000000
    for name in ("cloze/perplexity", "held/word_perplexity"):
        ax = _panel(fig, name)
        assert all(len(t) <= 8 for t in _ticks(ax)), _ticks(ax)      # no 22-digit integers
    ppl = _panel(fig, "cloze/perplexity")
    bars = [c for c in ppl.collections if type(c).__name__ == "LineCollection"]
    lows = [min(seg[0][1], seg[1][1]) for c in bars for seg in c.get_segments()]
    assert lows and min(lows) >= 1.0                                  # a perplexity is never below 1
    (cand,) = [ln for ln in acc.lines if ln.get_label().startswith("candidate")]
    assert list(cand.get_xdata()) == [10, 19]                         # the final eval at the last trained step


def test_an_eval_on_abandoned_weights_is_drawn_beside_its_verdict():
    # the eval at step 40 ran on diverged weights (perplexity +inf, MLflow's 1.797e308), the
    # gate said pass, a rewind at 41 went back to 30, the redone step 40 evaluated again
    pts = {"eval/held/bits_per_byte": [(20, 1.0, 4.2), (40, 2.0, 772.0), (40, 4.0, 4.0)],
           "eval/held/perplexity": [(20, 1.0, 60.0), (40, 2.0, as_inf(MLFLOW_INF)), (40, 4.0, 55.0)],
           "train/rewound_to": [(41, 3.0, 30.0)]}
    metrics = {k: sorted(v.items()) for k, v in _final_trajectory(pts).items()}
    assert metrics["abandoned/eval/held/bits_per_byte"] == [(40, 772.0)]
    metrics["train/loss"] = [(s, 3.0) for s in range(60)]
    events = [Event(40, EventKind.GATE, reason="gate: pass", evidence={"verdict": "pass"}),
              Event(41, EventKind.REWIND, reason="rewind", evidence={"skip_batches": 0})]
    fig = _drawn(evals_figure(ReportData("run", {}, 0, events, metrics)))
    bpb = _panel(fig, "held/bits_per_byte")
    (x,) = _labelled(bpb, "eval on weights a rewind abandoned")
    assert list(x.get_xdata()) == [40]
    assert bpb.get_ylim()[1] < 10                                     # 772 is on the edge, written, not the scale
    assert any(t.get_text() == "772" for t in bpb.texts)
    assert _labelled(_panel(fig, "held/perplexity"), "eval on weights a rewind abandoned")


def test_skipped_steps_accepted_levels_and_a_spike_on_the_loss_picture():
    loss = [(s, 3.0 - s / 100) for s in range(60)]
    loss[30] = (30, 600.0)
    events = [Event(12, EventKind.SKIP_STEP, reason="skip"), Event(13, EventKind.SKIP_STEP, reason="skip"),
              Event(45, EventKind.ACCEPT, reason="accept")]
    fig = _drawn(loss_figure(ReportData("run", {}, 0, events, {"train/loss": loss})))
    ax = fig.axes[0]
    assert [list(ln.get_xdata()) for ln in _labelled(ax, "skipped step (no update)")] == [[12, 13]]
    assert [list(ln.get_xdata()) for ln in _labelled(ax, "new level accepted")] == [[45]]
    assert ax.get_ylim()[1] < 4                                       # the 600 does not flatten a loss of 3
    assert _labelled(ax, "off the scale (value written beside)") and any(t.get_text() == "600" for t in ax.texts)


def test_the_gap_compares_the_same_batches_after_a_rewind():
    """Each batch's loss differs by +-30%; the run rewound at step 20 to 10 and skipped 5 batches,
    so its step s >= 10 trained on the baseline's batch s + 16: the gap is that of the batches."""
    batch = [1.0 + 0.3 * math.sin(3 * i) for i in range(120)]
    base = [(s, batch[s]) for s in range(100)]
    loss = [(s, batch[s] if s < 10 else batch[s + 16]) for s in range(60)]
    events = [Event(20, EventKind.REWIND, reason="rewind", evidence={"skip_batches": 5})]
    data = ReportData("run", {}, 0, events, {"train/loss": loss, "train/rewound_to": [(20, 10.0)]}, base)
    fig = _drawn(loss_figure(data))
    (gap,) = [ln for ln in fig.axes[1].lines if ln.get_label() == "gap to the baseline"]
    assert max(abs(v) for v in gap.get_ydata()) < 1e-9


def test_a_diverged_lr_probe_is_marked_without_an_overflow():
    assert as_inf(MLFLOW_INF) == math.inf and as_inf(-MLFLOW_INF) == -math.inf and as_inf(2.0) == 2.0
    points = [(9, 0.01), (19, as_inf(MLFLOW_INF)), (29, 0.02), (39, as_inf(MLFLOW_INF))]
    data = ReportData("run", {}, 0, [], {LR_SENSITIVITY: points, "train/lr": [(s, 1e-3) for s in range(40)]})
    with warnings.catch_warnings():
        warnings.simplefilter("error")                                 # matplotlib's overflow warning fails it
        fig = _drawn(lr_sensitivity_figure(data))
    ax = fig.axes[0]
    (curve,) = [ln for ln in ax.lines if ln.get_label().startswith("sensitivity")]
    assert list(curve.get_ydata()) == [0.01, 0.02]
    (up,) = _labelled(ax, "larger step diverged (inf)")
    assert list(up.get_xdata()) == [19, 39]
    assert -1 < ax.get_ylim()[0] < ax.get_ylim()[1] < 1


def test_signals_legend_under_the_panels_and_a_baseline_named_only_where_drawn():
    events = [Event(20, EventKind.FALLBACK, (SITE,), {SITE: "fp8_tensorwise"}, {SITE: "bf16"}, "saturated",
                    {"input/saturated_frac": 0.03}, "mlp_fp8")]
    metrics = {"train/loss": [(s, 3.0) for s in range(40)],
               f"signal/{SITE}/input/saturated_frac": [(s, 0.001 * s) for s in range(0, 40, 5)]}
    data = ReportData("lr-spike-run-with-a-long-name", {SITE: "fp8_tensorwise"}, 0, events, metrics,
                      baseline_name="bf16-baseline")
    fig = _drawn(signals_figure(data))
    title = fig._suptitle.get_text()
    assert "dashed: bf16-baseline" not in title and "bf16-baseline logged none of these signals" in title
    box = fig.legends[0].get_window_extent()
    assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= fig.bbox.x1       # not cut off
    data.baseline_metrics = {f"signal/{SITE}/input/saturated_frac": [(s, 0.0) for s in range(0, 40, 5)]}
    assert "dashed: bf16-baseline" in _drawn(signals_figure(data))._suptitle.get_text()


def test_titles_break_between_phrases_and_labels_never_overlap():
    text = "run-x: the signals that triggered fallbacks; dashed: bf16-baseline"
    # 55 characters a line: "...fallbacks; dashed:" would fit, cutting the last phrase in two
    assert fit_title(text, 5.2, 11).split("\n") == ["run-x: the signals that triggered fallbacks;",
                                                     "dashed: bf16-baseline"]
    fig = new_figure(6, 3)
    ax = fig.subplots()
    ax.set_xlim(0, 100)
    stagger(ax, [(40, "pass", "g"), (40, "pass", "g"), (42, "pass", "g"), (44, "12,13", "r"), (90, "mlp_fp8", "b")])
    _drawn(fig)
    boxes = [t.get_window_extent() for t in ax.texts]
    assert len(boxes) == 4                                              # the two at step 40: one label
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
