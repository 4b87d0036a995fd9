"""Report pictures after a rewind, and what they must not draw: the precision timeline and the
FLOP-share panel come from one precision history (the redone steps in the formats they were
redone in), the rewound steps are hatched and the loss that caused the rewind is marked, eval
durations and `eval_mode/*` are no eval metrics, titles fit, an output amax is never logged."""

from __future__ import annotations

import pytest

from lowprec.policy.events import Event, EventKind
from lowprec.tracking.records import signal_metrics
from lowprec.tracking.report import _eval_series, evals_figure, loss_figure, render_report, signals_figure
from lowprec.tracking.report_sources import ReportData, flops_share_steps, precision_history
from lowprec.tracking.report_timeline import timeline_figure

SITES = ("blocks.0.mlp.fc", "blocks.0.mlp.proj", "blocks.1.mlp.fc", "blocks.1.mlp.proj")
ROLLED = SITES[:2]


def rewound_run() -> ReportData:
    """What the loop logs for: all nvfp4, a loss spike at step 20 rolls two sites back to bf16
    and rewinds to step 10 (the REWIND event has no target; `train/rewound_to` has it), the
    steps 10..19 are redone in the new map; FLOP shares logged every 5 steps, the redone
    steps' values replacing the first pass's (the latest value of a step wins)."""
    init = dict.fromkeys(SITES, "nvfp4")
    events = [Event(20, EventKind.ROLLBACK, ROLLED, dict.fromkeys(ROLLED, "nvfp4"), dict.fromkeys(ROLLED, "bf16"),
                    "global signal: loss_spike", {"loss_spike": {"value": 9.0}}, "mlp_nvfp4"),
              Event(20, EventKind.REWIND, reason="rewind after loss_spike", evidence={"skip_batches": 0})]
    share: dict[str, dict[int, float]] = {"nvfp4": {}, "bf16": {}}
    for s in (0, 5, 10, 15):                       # first pass
        share["nvfp4"][s] = 1.0
    for s in (10, 15, 20, 25, 30):                 # redone and after: half the FLOPs back in bf16
        share["nvfp4"][s], share["bf16"][s] = 0.5, 0.5
    share["bf16"].update({s: 0.0 for s in (0, 5)})
    metrics = {f"precision/flops_share/{f}": sorted(v.items()) for f, v in share.items()}
    metrics["train/loss"] = [(s, 3.0 - s / 100) for s in range(0, 31)]
    metrics["train/loss_rewound"] = [(20, 9.0)]
    metrics["train/rewound_to"] = [(20, 10.0)]
    return ReportData("rewound", init, 0, events, metrics)


def _drawn(fig):
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    FigureCanvasAgg(fig).draw()
    return fig.canvas.get_renderer()


def test_timeline_and_flop_share_follow_the_redone_steps():
    data = rewound_run()
    after = dict.fromkeys(SITES, "nvfp4") | dict.fromkeys(ROLLED, "bf16")
    assert precision_history(data) == [(0, dict.fromkeys(SITES, "nvfp4")), (10, after)]
    steps, ys = flops_share_steps(data)
    assert steps == [0, 10] and ys == {"nvfp4": [1.0, 0.5], "bf16": [0.0, 0.5]}
    fig = timeline_figure(data)
    mesh = next(c for ax in fig.axes for c in ax.collections if type(c).__name__ == "QuadMesh")
    xs = sorted({round(float(x)) for x in mesh.get_coordinates()[..., 0].ravel()})
    assert xs == [0, 10, 30]                       # the map changes where the redone steps begin
    grid = mesh.get_array().reshape(len(SITES), -1)
    fmts = ["nvfp4", "bf16"]
    assert [fmts[int(v)] for v in grid[:, 1]] == ["bf16", "bf16", "nvfp4", "nvfp4"]
    assert [fmts[int(v)] for v in grid[:, 0]] == ["nvfp4"] * 4


def _hatched_spans(ax) -> list[tuple[float, float]]:
    inv = ax.transData.inverted()
    out = []
    for p in ax.patches:
        if p.get_hatch():
            ext = p.get_window_extent()
            out.append((round(float(inv.transform((ext.x0, 0))[0])), round(float(inv.transform((ext.x1, 0))[0]))))
    return out


def test_rewound_steps_are_hatched_and_the_rewound_loss_is_marked():
    data = rewound_run()
    fig = loss_figure(data)
    _drawn(fig)
    ax = fig.axes[0]
    assert (10, 20) in _hatched_spans(ax)
    marked = [ln for ln in ax.lines if ln.get_label() == "loss that caused a rewind"]
    assert len(marked) == 1 and list(marked[0].get_xdata()) == [20] and list(marked[0].get_ydata()) == [9.0]
    tfig = timeline_figure(data)
    _drawn(tfig)
    mesh_ax = next(a for a in tfig.axes if any(type(c).__name__ == "QuadMesh" for c in a.collections))
    assert (10, 20) in _hatched_spans(mesh_ax)
    from lowprec.tracking.report_timeline import _notes
    assert any("rewind" in n and "back to step 10" in n for n in _notes(data))


def test_eval_durations_and_modes_are_not_eval_metrics():
    metrics = {"eval/hellaswag/acc": [(10, 0.3)], "eval/hellaswag/acc_stderr": [(10, 0.01)],
               "eval/seconds": [(10, 41.0)], "eval/hellaswag/seconds": [(10, 12.0)],
               "time/eval_seconds": [(10, 41.0)], "eval_mode/eval": [(10, 0.0)]}
    assert set(_eval_series(metrics)) == {"hellaswag/acc"}
    fig = evals_figure(ReportData("r", {"a": "bf16"}, 0, [], metrics))
    assert [a.get_title(loc="left") for a in fig.axes if a.axison] == ["hellaswag/acc (95% interval)"]


def test_titles_fit_a_thirty_layer_run_with_a_long_name():
    from test_report import thirty_layer_rollout

    data = thirty_layer_rollout()
    data.run_name = "gpt2-30layer-mid-mlp-nvfp4-rollout-lr3e-3-warmup200-seed1234-2026-11-23-long-name"
    for make in (timeline_figure, loss_figure, signals_figure, evals_figure):
        fig = make(data)
        r = _drawn(fig)
        box = fig.bbox
        titles = [(fig._suptitle, None)] if fig._suptitle is not None else []
        titles += [(a.title if a.get_title() else a._left_title, a) for a in fig.axes if a.axison]
        for t, ax in titles:
            if not t.get_text():
                continue
            ext = t.get_window_extent(r)
            assert box.x0 - 1 <= ext.x0 and ext.x1 <= box.x1 + 1, (make.__name__, t.get_text())
            if ax is not None:  # a panel's title stays over its panel (not into the next one)
                assert ext.x1 <= ax.get_window_extent(r).x1 + 0.05 * box.width, (make.__name__, t.get_text())


def test_an_output_amax_that_is_never_measured_is_not_logged():
    zeros = {"amax": 0.0, "saturated_frac": 0.0, "underflow_frac": 0.0, "rel_mse": 0.0, "sqnr_db": 0.0,
             "nonfinite": 0.0}
    got = signal_metrics({"blocks.0.mlp.fc": {"output": dict(zeros), "input": dict(zeros, amax=3.5),
                                              "grad_output": dict(zeros, amax=0.25)}})
    assert "signal/blocks.0.mlp.fc/output/nonfinite" in got
    assert not [k for k in got if "/output/" in k and not k.endswith("/nonfinite")]
    assert got["signal/blocks.0.mlp.fc/input/amax"] == 3.5
    assert got["signal/blocks.0.mlp.fc/grad_output/amax"] == 0.25
    # an older run's zeros are not read back for the pictures either
    from lowprec.tracking.report_sources import _wanted
    site = {"blocks.0.mlp.fc"}
    assert not _wanted("signal/blocks.0.mlp.fc/output/amax", site)
    assert _wanted("signal/blocks.0.mlp.fc/output/nonfinite", site) and _wanted("signal/blocks.0.mlp.fc/input/amax", site)


def test_render_report_after_a_rewind_writes_the_pictures(tmp_path):
    names = [p.name for p in render_report(rewound_run(), tmp_path)]
    assert names == ["precision_timeline.png", "loss.png"]


if __name__ == "__main__":
    pytest.main([__file__])


def test_the_event_list_stays_inside_the_picture():
    """A rewind's reason with its evidence is longer than the figure is wide: the list wraps."""
    from dataclasses import replace
    data = rewound_run()
    long = ("rewind: loss_spike, grad_norm_spike for 2 steps in a row, not precision's, "
            "grad_norm_spike 4.023 > 1.764, loss_spike 5.269 > 4.37, " * 3)
    data = replace(data, events=[data.events[0], replace(data.events[1], reason=long)])
    fig = timeline_figure(data)
    renderer = _drawn(fig)
    texts = [t for ax in fig.axes for t in ax.texts if "step 20" in t.get_text()]
    assert texts and "4.37" in texts[0].get_text()
    assert all(t.get_window_extent(renderer).x1 <= fig.bbox.x1 for t in texts)
