"""experiments/bench_linear.py --device cpu --tiny: the issue-15 table, every row, runs on CPU."""

import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments import bench_linear  # noqa: E402


@pytest.mark.slow
def test_tiny_table_has_every_row_and_shape():
    out = subprocess.run([sys.executable, "experiments/bench_linear.py", "--device", "cpu", "--tiny",
                          "--repeats", "2", "--warmup", "1", "--quantizer", "eager"],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("# command: ") and "bench_linear.py --device cpu --tiny" in lines[0]
    assert lines[1].startswith("# device: cpu") and "torch " in lines[1]
    head = next(line for line in lines if line.startswith("| variant"))
    shapes = [c.strip() for c in head.strip("|").split("|")[1:]]
    assert shapes == ["d=64 tok=64", "d=64 tok=128", "d=128 tok=64", "d=128 tok=128"]
    rows = {line.strip("|").split("|")[0].strip(): [c.strip() for c in line.strip("|").split("|")[1:]]
            for line in lines if line.startswith("| ") and not line.startswith("| variant")}
    assert list(rows) == bench_linear.row_names()
    for name, cells in rows.items():
        assert len(cells) == len(shapes)
        if name.startswith("torchao"):   # no GPU here: skipped, and the reason is printed
            assert cells == ["n/a"] * len(shapes)
            assert any(line.startswith(f"# {name}: skipped") for line in lines)
            continue
        for c in cells:
            ms, ratio = c.split(" ")
            assert math.isfinite(float(ms)) and float(ms) > 0 and ratio.endswith("x)")
    assert all(c.endswith("(1.00x)") for c in rows["bf16 nn.Linear"])
    assert not any("FAILED" in line for line in lines)
