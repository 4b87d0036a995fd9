"""The report draws the baseline run beside the candidate: two real tiny `lowprec run`s (a
BF16 baseline, then a staged rollout naming it as its loss-gap baseline) into one MLflow
SQLite store, then `lowprec report`; the loss and evals pictures are read back through
matplotlib's objects (the lines by label, the axis labels), not their pixels."""

from __future__ import annotations

import copy

import pytest
import yaml

from lowprec.cli import main
from lowprec.policy.events import EventKind
from lowprec.tracking.report import baseline_label, candidate_label, evals_figure, loss_figure, report_figures
from lowprec.tracking.report_baseline import read_run

pytestmark = pytest.mark.slow   # two short training runs with evaluations

CONFIG = {
    "model": {"factory": "experiments.model:build_gpt",
              "args": {"vocab_size": 256, "block_size": 64, "n_layer": 2, "n_head": 2, "d_model": 64}},
    "data": {"factory": "experiments.data:shakespeare_tokens", "args": {"max_bytes": 400_000}, "block_size": 64},
    "train": {"steps": 20, "batch_size": 8, "lr": 3e-3, "warmup": 5, "seed": 0, "log_every": 5, "ckpt_every": 100},
    "precision": {"backend": "emulated", "keep_high_precision": [{"fqns": ["lm_head"]}],
                  "rules": [{"name": "blocks", "select": {"glob": "blocks.*"}, "format": "bf16",
                             "ladder": ["fp8_tensorwise", "bf16"]}]},
    "rollout": {"check_every": 5, "min_steps": 0, "baseline": {"mlflow_run": "tiny-bf16"}, "lr_probe": {"enabled": False},
                "stages": [{"name": "mlp_fp8", "select": {"glob": "blocks.*.mlp.*"}, "format": "fp8_tensorwise"}]},
    "eval": {"suite": "shakespeare", "every": 10, "mode": "fast", "final_mode": "fast", "high_precision": False,
             "gates": None, "batch_size": 64, "limit": 8},
    "telemetry": {"energy": "off", "mfu": False, "system_metrics_s": None},
}


def lines(ax) -> dict[str, object]:
    """{label: Line2D} of an axes' labelled lines."""
    return {ln.get_label(): ln for ln in ax.get_lines() if not ln.get_label().startswith("_")}


@pytest.fixture(scope="module")
def two_runs(tmp_path_factory, sqlite_store):
    tmp = tmp_path_factory.mktemp("baseline-report")
    uri = sqlite_store(tmp / "store")
    cfg = copy.deepcopy(CONFIG)
    cfg["tracking"] = {"uri": uri, "experiment": "lowprec-tests-baseline"}
    path = tmp / "tiny.yaml"
    path.write_text(yaml.safe_dump(cfg))
    assert main(["run", str(path), "--as-baseline", "--run-name", "tiny-bf16", "--out", str(tmp / "base")]) == 0
    assert main(["run", str(path), "--run-name", "tiny-rollout", "--out", str(tmp / "cand")]) == 0
    ids = {k: (tmp / k / "run_id").read_text().strip() for k in ("base", "cand")}
    return uri, ids, tmp


def test_loss_and_evals_draw_the_recorded_baseline_beside_the_candidate(two_runs, capsys):
    from mlflow.tracking import MlflowClient
    uri, ids, tmp = two_runs
    data = read_run(MlflowClient(uri), ids["cand"])   # no --baseline: the run's rollout.baseline.mlflow_run
    assert data.baseline_name == "tiny-bf16" and any(e.kind == EventKind.PROMOTE for e in data.events)
    base_loss = MlflowClient(uri).get_metric_history(ids["base"], "train/loss")

    fig = loss_figure(data)
    ax, gax = fig.axes[:2]
    drawn = lines(ax)
    assert candidate_label(data) == "candidate: tiny-rollout" and baseline_label(data) == "baseline: tiny-bf16"
    assert {"candidate: tiny-rollout", "baseline: tiny-bf16"} <= set(drawn)
    assert list(drawn["baseline: tiny-bf16"].get_ydata()) == pytest.approx(
        [m.value for m in sorted(base_loss, key=lambda m: m.step)])
    assert {t.get_text() for t in ax.get_legend().get_texts()} >= {"candidate: tiny-rollout", "baseline: tiny-bf16",
                                                                     EventKind.PROMOTE}
    assert "nats/token" in ax.get_ylabel() and "%" in gax.get_ylabel() and gax.get_xlabel().startswith("step")
    promote = next(e.step for e in data.events if e.kind == EventKind.PROMOTE)
    assert any(list(ln.get_xdata()) == [promote, promote] for ln in ax.get_lines())   # marked on the step axis

    fig = evals_figure(data)
    panels = [a for a in fig.axes if a.get_visible() and a.axison]
    assert len(panels) >= 2   # heldout_shakespeare and cloze_shakespeare metrics
    for pax in panels:
        drawn = lines(pax)
        assert {"candidate: tiny-rollout", "baseline: tiny-bf16"} <= set(drawn), pax.get_title(loc="left")
        assert list(drawn["baseline: tiny-bf16"].get_xdata()) == [19]   # its final eval, at its last trained step
        assert list(drawn["candidate: tiny-rollout"].get_xdata()) == [10, 19]
        assert pax.get_xlabel().startswith("step") and pax.get_ylabel()
    legend, = fig.legends   # one legend for the panels, naming both runs
    assert {"candidate: tiny-rollout", "baseline: tiny-bf16"} <= {t.get_text() for t in legend.get_texts()}
    bpb = next(a for a in panels if "heldout_shakespeare/bits_per_byte" in a.get_title(loc="left").replace("\n", ""))
    assert bpb.get_ylabel() == "bits per byte (lower is better)"
    want = MlflowClient(uri).get_metric_history(ids["base"], "eval/heldout_shakespeare/bits_per_byte")
    assert list(lines(bpb)["baseline: tiny-bf16"].get_ydata()) == pytest.approx([want[-1].value])

    # `lowprec report` writes the same pictures (and says what happened), `--baseline` by id too
    out = tmp / "pics"
    assert main(["report", ids["cand"], "--tracking-uri", uri, "--out", str(out), "--baseline", ids["base"]]) == 0
    printed = capsys.readouterr().out
    assert {"loss.png", "evals.png"} <= {p.name for p in out.iterdir()}
    assert "step " in printed and " promote mlp_fp8: " in printed
    named = read_run(MlflowClient(uri), ids["cand"], baseline_run=ids["base"])
    assert named.baseline_name == "tiny-bf16" and set(report_figures(named)) >= {"loss", "evals"}
    assert main(["report", ids["cand"], "--tracking-uri", uri, "--out", str(out), "--baseline", "no-such-run"]) == 2
    assert "no baseline run 'no-such-run'" in capsys.readouterr().err


def test_without_a_baseline_the_pictures_say_how_to_get_one(two_runs):
    from mlflow.tracking import MlflowClient
    uri, ids, _ = two_runs
    data = read_run(MlflowClient(uri), ids["base"])   # the baseline run itself names none
    assert data.baseline_name == "" and not data.baseline
    ax = evals_figure(data).axes[0]
    assert set(lines(ax)) >= {"candidate: tiny-bf16"} and "baseline: " not in " ".join(lines(ax))
    assert "--baseline" in evals_figure(data).get_suptitle()
