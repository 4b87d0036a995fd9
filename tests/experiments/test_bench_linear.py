"""experiments/bench_linear.py --device cpu --tiny: the issue-29 table, every row, runs on CPU."""

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments import bench_linear  # noqa: E402

SHAPES = ["d=16 tok=16", "d=16 tok=32", "d=32 tok=16", "d=32 tok=32"]


def cells_of(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


@pytest.mark.slow
def test_tiny_table_has_every_row_and_shape(tmp_path):
    js = tmp_path / "linear.json"
    out = subprocess.run([sys.executable, "experiments/bench_linear.py", "--device", "cpu", "--tiny",
                          "--repeats", "2", "--warmup", "1", "--quantizer", "eager", "--json", str(js)],
                         cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert lines[0].startswith("# command: ") and "bench_linear.py --device cpu --tiny" in lines[0]
    assert lines[1].startswith("# device: cpu") and "torch " in lines[1] and "triton " in lines[1]

    # one line per shape and variant, printed as measured: shapes in order, every variant each
    streamed = [cells_of(ln) for ln in lines if ln.startswith("| ") and not ln.startswith(("| d_model", "| variant"))
                and cells_of(ln)[0].isdigit()]
    assert [(int(c[0]), int(c[1]), c[2]) for c in streamed] == [
        (d, n, name) for d in (16, 32) for n in (16, 32) for name in bench_linear.row_names()]

    # the summary table: variants by shapes
    head = lines.index(next(ln for ln in lines if ln.startswith("| variant")))
    assert cells_of(lines[head])[1:] == SHAPES
    rows = {cells_of(ln)[0]: cells_of(ln)[1:] for ln in lines[head + 2:] if ln.startswith("| ")}
    assert list(rows) == bench_linear.row_names()
    for name, cells in rows.items():
        assert len(cells) == len(SHAPES)
        if name.startswith("torchao"):   # no GPU here: skipped, and the reason is printed
            assert cells == ["n/a"] * len(SHAPES)
            assert any(line.startswith(f"# {name}: skipped") for line in lines)
            continue
        if name.startswith("lowprec torchao-backend") and cells[0] == "n/a":
            # the torchao backend or torchao is missing here: a skipped row that says why
            assert any(line.startswith(f"# {name}: skipped: get_backend('torchao')") for line in lines)
            continue
        for c in cells:
            ms, ratio = c.split(" ")
            assert math.isfinite(float(ms)) and float(ms) > 0 and ratio.endswith("x)")
    assert all(c.endswith("(1.00x)") for c in rows["bf16 nn.Linear"])
    assert not any("FAILED" in line for line in lines)

    record = json.loads(js.read_text())
    assert record["versions"]["torch"] and record["shapes"] == [[16, 16], [16, 32], [32, 16], [32, 32]]
    assert len(record["rows"]) == len(SHAPES) * len(bench_linear.row_names())
    for row in record["rows"]:
        assert (row["ms"] is None) == bool(row["note"]), row
        if row["variant"] == "bf16 nn.Linear":
            assert row["speedup_vs_bf16"] == 1.0


def test_deadline_leaves_the_other_shapes_unmeasured_and_says_so(tmp_path, capsys):
    js = tmp_path / "linear.json"
    bench_linear.main(["--device", "cpu", "--d-model", "32", "--tokens", "16", "32", "--repeats", "1",
                       "--warmup", "0", "--quantizer", "eager", "--deadline", "0", "--json", str(js),
                       "--compiled", "fp8_tensorwise"])
    record = json.loads(js.read_text())
    first = [r for r in record["rows"] if r["tokens"] == 16]
    rest = [r for r in record["rows"] if r["tokens"] == 32]
    assert first[1]["variant"] == "bf16 nn.Linear" and first[1]["ms"] > 0   # the first shape always runs
    # --compiled: the layer under torch.compile is measured here too; CUDA graphs need CUDA
    compiled = {r["variant"]: r for r in first if "(compiled" in r["variant"]}
    assert compiled["lowprec fp8_tensorwise (compiled) stats off"]["ms"] > 0
    assert "CUDA" in compiled["lowprec fp8_tensorwise (compiled, CUDA graphs) stats off"]["note"]
    assert rest and all(r["ms"] is None and r["note"] == bench_linear.NOT_MEASURED for r in rest)
    assert bench_linear.NOT_MEASURED in capsys.readouterr().out
