"""`lowprec report`'s experts picture (lowprec.tracking.report_experts): layers by experts, the
formats at the end (a fallback event applied) and the tokens routed at the last check."""

from lowprec.policy.events import Event, EventKind
from lowprec.tracking.report import report_figures
from lowprec.tracking.report_experts import expert_grid, experts_figure
from lowprec.tracking.report_sources import ReportData

EXPERTS = [f"model.layers.{i}.mlp.experts.{e}" for i in range(2) for e in range(4)]


def test_layers_by_experts_formats_and_tokens():
    initial = {"model.layers.0.self_attn.q_proj": "fp8_tensorwise", **{n: "fp8_tensorwise" for n in EXPERTS}}
    fall = Event(step=30, kind=EventKind.FALLBACK, sites=("model.layers.1.mlp.experts.2",),
                 from_format={"model.layers.1.mlp.experts.2": "fp8_tensorwise"},
                 to_format={"model.layers.1.mlp.experts.2": "bf16"})
    metrics = {f"signal/{n}/routed/tokens": [(9, 10.0 + i), (39, 100.0 + i)] for i, n in enumerate(EXPERTS)}
    data = ReportData("moe", initial, events=[fall], metrics=metrics)
    layers, width, cells = expert_grid(initial)
    assert layers == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"] and width == 4
    assert cells["model.layers.1.mlp.experts.2"] == (1, 2) and "model.layers.0.self_attn.q_proj" not in cells
    fig = experts_figure(data)
    ax_f, ax_t = fig.axes[:2]
    fmt_texts = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax_f.texts}
    assert fmt_texts[(1, 2)] == "bf16" and fmt_texts[(0, 2)] == "tensorwise"
    tok_texts = {(round(t.get_position()[1]), round(t.get_position()[0])): t.get_text() for t in ax_t.texts}
    assert tok_texts[(1, 3)] == "107" and tok_texts[(0, 0)] == "100"
    assert "experts" in report_figures(data)
    assert experts_figure(ReportData("dense", {"h.0.mlp.fc": "bf16"})) is None
