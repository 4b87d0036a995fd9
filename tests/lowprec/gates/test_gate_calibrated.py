"""`lowprec gate` on recorded runs of the calibrated config, in a real MLflow SQLite store (issue 33).

tests/lowprec/gates/data/calibrated_runs.json holds six runs of experiments/configs/gate_calibration.yaml
as the calibration recorded them (`python -m experiments.gate_calibration --fixture ...`): BF16
at seeds 0-3 and FP32 (every linear layer kept in FP32) at seeds 0 and 4, their gated metrics
and per-example scores. They are logged here with lowprec's Tracker, as `lowprec run` logs its
final eval, and gated with the repository's gates/default.yaml, whose tolerances came from the
same calibration:

- BF16 seed 0 -> FP32 seed 0 (a harmless numerical difference, what `make run` compares) passes;
  the same candidate with a planted 4% regression (bits per byte x 1.04 on every document)
  regresses on both bits-per-byte gates; `--power` gives a finite detectable regression per gate;
- a gate on the cloze accuracy (0.001 on this model: at its floor) is refused, exit 2, unless
  marked `informational: true`;
- seed-aware baselines: `--baseline NAME` matched by four finished BF16 runs of seeds 0-3; a
  different-seed FP32 run lies inside their spread, a 15% regression outside it.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from lowprec.gates.spec import GateSpec
from lowprec.tracking.tracker import Tracker

ROOT = Path(__file__).resolve().parents[3]
DEFAULT = ROOT / "gates" / "default.yaml"
FAST = dict(flush_interval_s=0.2, retry_max_s=1.0, probe_timeout_s=0.5)
STEP = 300


def _runs() -> dict:
    return json.loads((Path(__file__).parent / "data" / "calibrated_runs.json").read_text())["runs"]


def _planted(run: dict, drop: float) -> dict:
    """Every bits-per-byte value and per-document score times 1 + drop."""
    out = json.loads(json.dumps(run))
    for task, metrics in out["results"].items():
        if "bits_per_byte" in metrics:
            metrics["bits_per_byte"] *= 1 + drop
            out["samples"][task]["bits_per_byte"] = {k: v * (1 + drop) for k, v in
                                                     out["samples"][task]["bits_per_byte"].items()}
    return out


def _log(uri: str, root: Path, name: str, run: dict) -> str:
    tracker = Tracker(uri, "calibrated", name, buffer_dir=root / f"buf-{len(list(root.iterdir()))}", **FAST)
    tracker.log_config({"eval": {"suite": "default"}})
    tracker.log_eval(STEP, run["results"], samples=run["samples"], mode="full", suite="default")
    assert tracker.finish("FINISHED", timeout=120, report=False)["pending"] == 0
    return tracker.run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory, sqlite_store, lowprec_forks):
    root = tmp_path_factory.mktemp("gate-calibrated")
    uri = sqlite_store(root)   # a copy of the session's migrated store
    runs = _runs()
    ids = {"base": _log(uri, root, "bf16-seed0", runs["bf16_seed0"]),
           "harmless": _log(uri, root, "fp32-seed0", runs["fp32_seed0"]),
           "planted": _log(uri, root, "fp32-seed0-planted4", _planted(runs["fp32_seed0"], 0.04)),
           "other_seed": _log(uri, root, "fp32-seed4", runs["fp32_seed4"]),
           "other_seed_bad": _log(uri, root, "fp32-seed4-planted15", _planted(runs["fp32_seed4"], 0.15))}
    ids["seeds"] = [_log(uri, root, "bf16-seeds", runs[f"bf16_seed{s}"]) for s in range(4)]
    return {"uri": uri, "root": root, "forks": lowprec_forks, **ids}


def _cli(store, *args: str) -> subprocess.CompletedProcess:
    """`lowprec gate`, forked from the session's pre-imported server (`lowprec_forks`)."""
    return store["forks"].run(["gate", "--tracking-uri", store["uri"], *args], store["root"], timeout=180)


def _main(store, capsys, *args: str) -> tuple[int, str, str]:
    from lowprec.cli import main
    code = main(["gate", "--tracking-uri", store["uri"], *args])
    cap = capsys.readouterr()
    return code, cap.out, cap.err


@pytest.mark.slow
def test_harmless_difference_passes_planted_4pct_regresses_with_power(store):
    spec = GateSpec.from_yaml(DEFAULT)
    md, xml = store["root"] / "summary.md", store["root"] / "gate.xml"
    p = _cli(store, "--baseline", store["base"], "--candidate", store["harmless"], "--gates", str(DEFAULT),
             "--power", "--markdown", str(md), "--junit", str(xml))
    assert p.returncode == 0, p.stdout + p.stderr
    assert "REGRESS" not in p.stdout and "lowprec gate: PASS" in p.stdout
    power = p.stdout.split("Power: the smallest regression")[1]
    for g in spec.gates:   # one finite detectable regression per default gate, from its calibrated noise
        line = next(ln for ln in power.splitlines() if ln.startswith(g.metric))
        rel = re.search(r"([0-9.]+)%\s+eval se", line)
        assert rel and 0 < float(rel.group(1)) < 100, line
        assert "calibrated noise sd" in line, line
    assert "detectable regression (80% power)" in md.read_text()
    props = {c.get("name"): {p.get("name"): p.get("value") for p in c.iter("property")}
             for c in ET.parse(xml).getroot().iter("testcase")}
    assert set(props) == set(spec.metrics)
    assert all(math.isfinite(float(v["detectable_regression_80"])) for v in props.values())

    p = _cli(store, "--baseline", store["base"], "--candidate", store["planted"], "--gates", str(DEFAULT))
    assert p.returncode == 1, p.stdout + p.stderr
    for g in spec.gates:
        assert f"regress: {g.metric}: regression +" in p.stdout, p.stdout


def test_gate_on_a_metric_that_cannot_move_is_refused_unless_informational(store, tmp_path, capsys):
    cloze = ("  - metric: eval/cloze_shakespeare/acc\n    direction: higher_is_better\n"
             "    max_regression: {absolute: 0.02}\n")
    refused = tmp_path / "refused.yaml"
    refused.write_text(DEFAULT.read_text().split("\ngates:\n")[0] + "\ngates:\n" + cloze)
    code, out, err = _main(store, capsys, "--baseline", store["base"], "--candidate", store["harmless"],
                           "--gates", str(refused), "--power")
    assert code == 2, out + err
    assert "Traceback" not in err and "refused.yaml" in err
    for part in ("gates[0] (eval/cloze_shakespeare/acc)", "0.001", "floor 0", "cannot fire",
                 "informational: true"):
        assert part in err, f"{part!r} not in {err!r}"
    info = tmp_path / "info.yaml"
    info.write_text(refused.read_text() + "    informational: true\n")
    code, out, err = _main(store, capsys, "--baseline", store["base"], "--candidate", store["planted"],
                           "--gates", str(info))
    assert code == 0, out + err                 # reported, never failing
    assert "(informational)" in out and "eval/cloze_shakespeare/acc" in out


def test_seed_aware_baselines_by_name_and_by_ids(store, capsys):
    args = ["--gates", str(DEFAULT), "--baseline", "bf16-seeds"]
    code, out, err = _main(store, capsys, *args, "--candidate", store["other_seed"])
    assert code == 0, out + err
    assert "4 baselines (seed spread)" in out and "prediction interval of one more seed" in out
    assert "REGRESS" not in out
    code, out, err = _main(store, capsys, *args, "--candidate", store["other_seed_bad"])
    assert code == 1, out + err
    assert "outside the seed spread" in out
    # a one-baseline gate of the same different-seed pair cannot tell seed from numerics: the
    # tolerance is calibrated for same-seed comparisons; with run ids the spread form works too
    code, out, err = _main(store, capsys, "--gates", str(DEFAULT), "--baseline", *store["seeds"][:3],
                           "--candidate", store["other_seed"])
    assert code == 0 and "3 baselines (seed spread)" in out, out + err
    code, out, err = _main(store, capsys, "--gates", str(DEFAULT), "--baseline", store["seeds"][0],
                           store["seeds"][0], "--candidate", store["other_seed"])
    assert code == 2 and "same run twice" in err
