"""`lowprec plan`'s FLOP shares and expected tokens/s ratio from a measured layer table
(lowprec.runtime.trainer.speed_estimate): the GPU main job's d 4096 config on the H200 table, the
arithmetic on shapes the table holds, and what it says with no table or no row."""

from pathlib import Path

import pytest

from lowprec.runtime.trainer.speed_estimate import H200, Execution, SiteGemm, estimate, format_estimate, table_for

ROOT = Path(__file__).resolve().parents[3]
D4096 = ROOT / "experiments" / "configs" / "gpu_llama_d4096.yaml"


def test_plan_of_the_d4096_main_job_prints_shares_and_the_h200_estimate(tmp_path, lowprec_forks):
    # the 0.81B model built on the meta device (shapes only, no 3 GB of weights on this CPU), a
    # corner of the corpus
    cfg = tmp_path / "d4096.yaml"
    cfg.write_text(D4096.read_text().replace("device: auto", "device: meta").replace("max_bytes: null", "max_bytes: 100000"))
    out = lowprec_forks.run(["plan", str(cfg), "--speed-table", "nvidia-h200"], ROOT, timeout=120)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "stage mlp_fp8: 66.8% of the FLOPs -> fp8_tensorwise" in text
    assert "stage attn_fp8: 33.1% of the FLOPs -> fp8_tensorwise" in text
    assert "at the rollout's end: fp8_tensorwise 99.9%, bf16 0.1%" in text
    ratio = float(text.split("expected tokens/s (rollout vs BF16): ")[1].split("x")[0])
    assert 1.3 < ratio < 1.6                         # between the d 4096 (1.19x) and d 8192 (1.62x) compiled rows
    assert "(compiled;" in text and "rows: bf16, fp8_tensorwise compiled" in text   # the blocks are compiled
    assert "layer table nvidia-h200: docs/performance.md 'The second H200 run, 2026-11-27'" in text
    assert "1 site(s) (lm_head) lie outside the measured shapes" in text
    assert "tokens a step (one micro-batch): 16,384" in text and "run otherwise: eager" in text


def test_the_ratio_is_the_tables_own_at_a_measured_shape():
    sites = [SiteGemm("a", 4096, 4096, "bf16", "fp8_tensorwise"), SiteGemm("b", 4096, 4096, "bf16", "bf16")]
    est = estimate(sites, 16384, H200, execution=Execution.EAGER, stats=True)
    bf16, fp8 = H200.ms("bf16", (4096, 16384)), H200.ms("fp8_tensorwise stats 1/10", (4096, 16384))
    assert est.ratio == pytest.approx(2 * bf16 / (bf16 + fp8))
    assert est.shares == {"fp8_tensorwise": 0.5, "bf16": 0.5} and not est.outside
    graphs = estimate(sites, 16384, H200, execution=Execution.CUDA_GRAPHS, stats=True)
    assert graphs.rows == ("bf16", "fp8_tensorwise cuda_graphs")
    rowwise = estimate([SiteGemm("a", 8192, 8192, "bf16", "fp8_rowwise")], 8192, H200, stats=False)
    assert rowwise.rows == ("bf16", "fp8_rowwise stats off")            # no compiled row: the eager one
    assert rowwise.ratio == pytest.approx(4.363 / 3.262)


def test_no_table_and_no_row_say_so():
    lines = format_estimate(None, "cpu", [("mlp_fp8", "fp8_tensorwise", 0.5)])
    assert "no layer table for this device (cpu); tables: nvidia-h200 (NVIDIA H200)" in lines
    assert "--speed-table NAME" in lines
    est = estimate([SiteGemm("a", 4096, 4096, "bf16", "nvfp4")], 16384, H200)
    assert est.ratio is None and est.missing == ("nvfp4",)
    assert "has no row for nvfp4: no estimate" in format_estimate(est, "cuda:0", [])
    with pytest.raises(ValueError, match="no layer table named 'h100'; tables: nvidia-h200"):
        table_for("h100")


def test_plan_refuses_an_unknown_table_with_exit_2(lowprec_forks):
    out = lowprec_forks.run(["plan", str(D4096), "--speed-table", "h100"], ROOT, timeout=60)
    assert out.returncode == 2
    assert "no layer table named 'h100'" in out.stderr and "Traceback" not in out.stderr
