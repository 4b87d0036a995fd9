"""experiments/bench_model_step.py --device cpu --tiny: every variant runs and is recorded."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments import bench_model_step  # noqa: E402


def test_tiny_step_has_every_variant(tmp_path):
    js = tmp_path / "step.json"
    record = bench_model_step.main(["--device", "cpu", "--tiny", "--steps", "1", "--warmup", "1", "--no-compile",
                                    "--opaque-casts", "--json", str(js)])
    rows = {r["variant"]: r for r in record["rows"]}
    assert list(rows) == ["bf16", "lowprec fp8_tensorwise", "lowprec fp8_tensorwise, casts opaque",
                          "torchao Float8Linear tensorwise"]
    assert rows["bf16"]["speedup_vs_bf16"] == 1.0
    for name in ("lowprec fp8_tensorwise", "lowprec fp8_tensorwise, casts opaque"):
        assert rows[name]["tokens_per_s"] > 0 and rows[name]["note"] == "", rows[name]
    assert "CUDA" in rows["torchao Float8Linear tensorwise"]["note"]   # torchao's float8 training needs a GPU
    assert json.loads(js.read_text())["rows"] == record["rows"]
