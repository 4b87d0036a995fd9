"""experiments/bench_host_noop.py: the CPU host-time harness runs every row, counts the launches
a GPU would make (the no-ops' and the other kernel-launching ATen ops), and puts back what it
replaced."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from experiments import bench_host_noop  # noqa: E402
from lowprec.numerics import fp8_ops  # noqa: E402


def test_every_row_runs_and_the_patches_are_undone():
    before = (fp8_ops.uses_kernels, torch._scaled_mm)
    lines = bench_host_noop.main(["--calls", "2", "--repeats", "1"])
    assert (fp8_ops.uses_kernels, torch._scaled_mm) == before
    # Inductor's registry of extern GEMMs holds the real `_scaled_mm`, not the stand-in the compiled row
    # ran under: a graph later loaded from Inductor's cache in this process calls it by that name
    from torch._inductor.select_algorithm import extern_kernels
    assert getattr(extern_kernels, "_scaled_mm", None) is torch._scaled_mm
    assert not hasattr(extern_kernels, "scaled_mm")
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ")[1:] for line in lines if line.startswith("| ")
            and not line.startswith("| step")}
    assert list(rows) == list(bench_host_noop.ROWS)
    launches = {row: [int(c.rstrip(" |")) for c in cells[-3:]] for row, cells in rows.items()}
    assert all(k + o == total for k, o, total in launches.values())
    # nn.Linear: its three GEMMs, seen by the profiler as ATen mm
    assert launches["nn.Linear fwd+bwd"] == [0, 3, 3]
    # three casts (two Triton kernels each; delayed: one) and three GEMMs a step, the input's
    # and the weight's casts in one launch per kernel (9 -> 7, 6 -> 5, row-wise 12 -> 9);
    # row-wise also zeroes the maxima (one buffer for the pair, one for the output gradient's
    # cast); a check step pairs too and adds no kernel (each operand's last tile sums its
    # statistics), only the zeroed buffer the output gradient's statistics are written to
    assert launches["PrecisionLinear fp8_tensorwise"] == [7, 0, 7]
    assert launches["PrecisionLinear fp8_delayed"] == [5, 0, 5]
    assert launches["PrecisionLinear fp8_rowwise"] == [7, 2, 9]
    assert launches["PrecisionLinear fp8_tensorwise, check step"] == [7, 1, 8]
    assert launches["PrecisionLinear fp8_rowwise, check step"] == [7, 3, 10]
    assert launches["PrecisionLinear fp8_tensorwise (compiled)"][0] == 9
    assert all(float(cells[0]) > 0 for cells in rows.values())
    # the estimate: the host figure plus 14.7 us (the default --launch-us) per launch
    for row, cells in rows.items():
        assert abs(float(cells[2]) - (float(cells[0]) + 14.7 * launches[row][2])) < 0.11, (row, cells)
