"""experiments/configs/gpu_llama.yaml (issue 15's GPU main job) passes `lowprec plan` on CPU."""

import json
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CONFIG = ROOT / "experiments" / "configs" / "gpu_llama.yaml"


@pytest.mark.slow
def test_gpu_llama_plans(tmp_path, lowprec_forks):
    """Every linear layer of the 155M Llama is listed; the first and last blocks and the head
    stay high precision; both stages select sites; the backend is the torch one. The config's
    loss-gap baseline is an MLflow run that the job trains first, so the plan here reads a
    losses file instead (as tests/lowprec/test_cli.py does for default.yaml)."""
    cfg = yaml.safe_load(CONFIG.read_text())
    assert cfg["precision"]["backend"] == "torch"
    (tmp_path / "bf16_losses.json").write_text(json.dumps([2.5] * cfg["train"]["steps"]))
    cfg["rollout"]["baseline"] = {"losses": "bf16_losses.json"}
    p = tmp_path / "cfg.yaml"
    p.write_text(yaml.safe_dump(cfg))
    out = lowprec_forks.run(["plan", str(p)], ROOT, timeout=300)   # forked from the session's server
    assert out.returncode == 0, out.stderr
    table = out.stdout.split("\n\n")[0]
    stages = out.stdout[out.stdout.index("rollout stages:"):]   # after the backend's device note, on a CPU
    rows = {line.split()[0]: line for line in table.splitlines()[2:]}
    assert len(rows) == 12 * 7 + 1   # 12 blocks x (q, k, v, o, gate, up, down) + lm_head
    assert "2816 x 1024" in rows["blocks.5.mlp.gate"]
    assert "fp8_tensorwise -> bf16" in rows["blocks.5.mlp.gate"]
    for fqn in ("lm_head", "blocks.0.attn.q", "blocks.11.mlp.down"):
        assert "keep_high_precision" in rows[fqn]
    assert "mlp_fp8: 30 sites" in stages and "attn_fp8: 40 sites" in stages


@pytest.mark.slow
def test_gpu_llama_without_baseline_lists_it_as_missing(lowprec_forks):
    """As written, the plan prints and says that only the BF16 baseline run is still missing
    (train it first, with the command); a plan needs no baseline, so it exits 0."""
    if (ROOT / "mlflow.db").exists():
        pytest.skip("a local tracking store exists: the baseline run may be in it")
    out = lowprec_forks.run(["plan", str(CONFIG)], ROOT, timeout=300)
    assert out.returncode == 0, out.stderr
    missing = out.stdout.split("still missing before `lowprec run` (1;")[1]
    assert "rollout.baseline.mlflow_run" in missing and "bf16-baseline" in missing and "--as-baseline" in missing
