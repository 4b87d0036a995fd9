"""experiments/bench_host.py --device cpu: every row of the host-time table runs or says why."""

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments import bench_host  # noqa: E402


def test_every_row_is_measured_or_says_it_needs_cuda(tmp_path):
    js = tmp_path / "host.json"
    lines = bench_host.main(["--device", "cpu", "--d-model", "16", "--tokens", "16", "--calls", "2",
                             "--repeats", "1", "--json", str(js)])
    assert lines[0].startswith("# command: ") and "cpu" in lines[1]
    rows = json.loads(js.read_text())["rows"]
    assert list(rows) == list(bench_host.ROWS)
    cuda_only = {"Triton launch", "Triton launch, warm", "_scaled_mm", "PrecisionLinear fwd+bwd (compiled, CUDA graphs)"}
    for name, row in rows.items():
        if name in cuda_only:
            assert row["us"] is None and row["note"] == "CUDA only"
        else:   # measured here, the compiled layer included
            assert row["us"] > 0 and row["note"] == "", (name, row)
    table = [line for line in lines if line.startswith("| nn.Linear fwd+bwd |")]
    assert table and "| 1.00 |" in table[0]
