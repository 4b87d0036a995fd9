"""`lowprec run` launched as a multi-node job: two torchrun agents (`--nnodes 2 --nproc-per-node
2`, c10d rendezvous on 127.0.0.1) on this machine, as two machines would start it (gloo on the
CPU). The four ranks finish one MLflow run, written by rank 0 alone, into the one run folder.
The job is FSDP2 over 4 ranks with `fp8_all_gather` and the MLPs in
`fp8_tensorwise` on the `torch` backend from step 0, so the run's summary.json and MLflow say
that those sites ran the fast path and were gathered as FP8, the others in high precision
(`lowprec.runtime.trainer.site_paths`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.launches]

ROOT = Path(__file__).resolve().parents[3]
TIMEOUT_S = 300
STEPS = 3
MLP = ("blocks.0.mlp.fc", "blocks.0.mlp.proj", "blocks.1.mlp.fc", "blocks.1.mlp.proj")


def _job(uri: str) -> dict:
    return {"model": {"factory": "experiments.model:build_gpt",
                      "args": {"vocab_size": 256, "block_size": 16, "n_layer": 2, "n_head": 4, "d_model": 32}},
            "data": {"factory": "experiments.data:shakespeare_tokens", "args": {"max_bytes": 50_000}, "block_size": 16},
            "train": {"steps": STEPS, "batch_size": 4, "warmup": 1, "ckpt_every": 100, "log_every": 1},
            "precision": {"backend": "torch", "keep_high_precision": [{"fqns": ["lm_head"]}],
                          "rules": [{"name": "mlp", "select": {"glob": "blocks.*.mlp.*"}, "format": "fp8_tensorwise"}]},
            "tracking": {"uri": uri, "experiment": "multinode", "run_name": "two-agents"},
            "telemetry": {"energy": "off"},
            "parallel": {"dp_shard": 4, "fp8_all_gather": True}}


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    return {**env, "OMP_NUM_THREADS": "1"}


def test_two_agents_on_one_machine_finish_one_mlflow_run(tmp_path, gloo, sqlite_store, free_port, rank_forks):
    uri = sqlite_store(tmp_path)
    cfg = tmp_path / "job.yaml"
    cfg.write_text(yaml.safe_dump(_job(uri)))
    out = tmp_path / "out"
    agent = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "2",
             "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "lowprec-two-agents",
             *rank_forks.rank("-m", "lowprec.cli", "run", cfg, "--out", out)]   # ranks forked from the rank server
    logs = [tmp_path / f"agent{i}.log" for i in range(2)]
    agents = []
    for log in logs:
        with open(log, "w") as f:
            agents.append(subprocess.Popen(agent, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT,
                                           env=rank_forks.env(_env()),
                                           start_new_session=True))
    t0 = time.perf_counter()
    try:
        for a in agents:
            a.wait(timeout=max(1.0, TIMEOUT_S - (time.perf_counter() - t0)))
    finally:
        for a in agents:
            if a.poll() is None:
                os.killpg(a.pid, signal.SIGKILL)
                a.wait()
    said = "\n".join(f"--- agent {i}\n{log.read_text()[-4000:]}" for i, log in enumerate(logs))
    assert [a.returncode for a in agents] == [0, 0], said

    from mlflow.tracking import MlflowClient
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("multinode").experiment_id])
    assert [(r.info.run_name, r.info.status) for r in runs] == [("two-agents", "FINISHED")], said
    run = runs[0]
    assert (out / "run_id").read_text().strip() == run.info.run_id
    assert run.data.tags["lowprec.parallel"] == "dp_shard4 (4 processes)"
    assert run.data.tags["lowprec.parallel.backend"] == "gloo"   # this machine has no GPU
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "train/loss")) == list(range(STEPS))
    pictures = {a.path for a in client.list_artifacts(run.info.run_id, "report")}   # drawn by the job's rank 0
    assert {"report/loss.png", "report/precision_timeline.png"} <= pictures, pictures
    # the fast path and the FP8 all-gather, per site: summary.json and MLflow
    paths = json.loads((out / "summary.json").read_text())["site_paths"]
    for site in MLP:   # STEPS forwards on each of the 4 ranks, on the fast path, gathered as FP8
        assert paths[site] == {"fast_calls": 4 * STEPS, "slow_calls": 0, "all_gather": "float8_e4m3fn"}, paths
        assert run.data.metrics[f"path/{site}/fast_calls"] == 4 * STEPS
    assert paths["blocks.0.attn.qkv"]["all_gather"] == "float32", paths   # bf16 sites gather their FP32 weights
    assert run.data.tags["lowprec.all_gather"].startswith("float32: ") and (
        "float8_e4m3fn: " + ", ".join(MLP)) in run.data.tags["lowprec.all_gather"]
