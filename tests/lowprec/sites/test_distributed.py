"""The same FP8 plan under torchrun (gloo, 2 ranks) gives the single-process numbers.

Two sharded layouts of the small GPT (tests/lowprec/dist_worker.py has the runs), both
with every linear layer of both blocks in FP8 (`emulated` backend):

* tensor parallel on a 1-D mesh of 2: attn.qkv and mlp.fc ColwiseParallel, attn.proj
  and mlp.proj RowwiseParallel (attention on each rank's heads), every rank on the whole
  batch. Weights, the inputs of the rowwise layers and the output gradients of the
  colwise layers are DTensor shards, whose tensor-wise amax must be all-reduced over
  the shard group;
* FSDP2, fully_shard per block and on the root, half of every batch per rank,
  `prepare(..., amax_group=WORLD)` so activation and gradient amaxes are global.

Each is trained for 20 AdamW steps, with fp8_tensorwise and with fp8_delayed, and
compared with a single process on the same model, data and plan in two ways:

* step by step: at every step, a single-process copy of the model loads the sharded
  run's parameters and redoes the step on the whole batch. The loss must agree within a
  relative 1e-5 (the bound of issue 3) at every one of the 20 steps, and the weight and
  bias gradients of all 8 FP8 sites within 1e-5 of their largest entry in most steps
  (they agree to about 3e-7, FP32 rounding of the sharded GEMMs);
* as two independent 20-step runs: the losses agree within 1e-3. Not 1e-5: a
  row-parallel output is the sum of two partial FP32 GEMMs, an FSDP weight gradient the
  sum of two half-batch ones, and they round differently from one GEMM by an ulp. Now and
  then such an ulp moves a value across an FP8 rounding boundary (a whole grid step,
  6-12% of that value for E4M3, more for E5M2 gradients; a few percent of some sites'
  gradient norms), and from that step on two correct runs drift apart, by 1e-5 to 1e-4
  within 20 steps. A single process drifts by 1e-5 to 2e-5 from itself when only its
  CPU kernels change (AVX2 against AVX-512 reductions), so an independent-run bound of
  1e-5 holds for some data and not for others. That is why the 1e-5 bound is checked
  step by step; the same ulps occasionally flip an FP8 value within one step (0 to 3
  steps in 20 here), hence "most steps" for the gradients.

Without the amax reduction (tp: no all-reduce over the shard group; fsdp:
amax_group=None) every step's gradients differ by 7-15%: the control that shows the
comparison can fail (5 steps: from the first on, measured 7-15% in each of 20). A last test runs one layer on batch- and sequence-sharded inputs.

Runs: one torchrun job with all distributed variants and, on rank 0 without a process
group, the independent single-process runs; each process on one thread, with the CPU kernels pinned (MKL_CBWR,
ATEN_CPU_CAPABILITY) so that the summation orders depend less on the machine.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_worker import CONTROL_STEPS

pytestmark = [pytest.mark.slow, pytest.mark.launches]

HERE = Path(__file__).resolve().parents[1]
WORKER = HERE / "dist_worker.py"
TIMEOUT_S = 300
FORMATS = ("fp8_tensorwise", "fp8_delayed")
CORRECT = [f"{mode}:{fmt}" for mode in ("tp", "fsdp") for fmt in FORMATS]
CONTROLS = ["tp:fp8_tensorwise:noreduce", "fsdp:fp8_tensorwise:noreduce"]
PINNED = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MKL_CBWR": "AVX2",
          "ATEN_CPU_CAPABILITY": "avx2"}


def _launch(cmd: list[str], log: Path, rank_forks) -> subprocess.Popen:
    with open(log, "w") as f:  # a file, not a pipe: nobody reads it while the job runs
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT,
                                env=rank_forks.env({**os.environ, **PINNED}), cwd=HERE.parents[1],
                                start_new_session=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, gloo, rank_forks):
    d = tmp_path_factory.mktemp("distributed")
    commands = {
        "torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                     "--nproc-per-node", "2", *rank_forks.rank(WORKER, d / "torchrun.pt"),
                     *(f"single:{f}" for f in FORMATS), "layer", *CORRECT, *CONTROLS],
    }
    jobs = {name: _launch(cmd, d / f"{name}.log", rank_forks) for name, cmd in commands.items()}
    results = {}
    try:
        for name, proc in jobs.items():
            try:
                proc.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                log = (d / f"{name}.log").read_text()[-6000:]
                pytest.fail(f"{name} job ran past {TIMEOUT_S} s:\n{log}")
            assert proc.returncode == 0, (f"{name} job failed (exit {proc.returncode}):\n"
                                          f"{(d / f'{name}.log').read_text()[-6000:]}")
            results.update(torch.load(d / f"{name}.pt", weights_only=True))
    finally:
        for proc in jobs.values():  # only after a timeout or a failure: the jobs started here
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return results


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def _clean_steps(run) -> list[bool]:
    """Per step: every FP8 site's weight and bias gradient within 1e-5 of the reference."""
    return [max(step["grad_max"].values()) < 1e-5 for step in run["per_step"]]


@pytest.mark.parametrize("variant", CORRECT + CONTROLS)
def test_runs_are_sharded_and_quantized(runs, variant):
    run, fmt = runs[variant], variant.split(":")[1]
    assert run["sharded"], f"{variant}: the model was not sharded"
    assert run["formats"] == [fmt]
    assert len(run["sites"]) == 8 and run["sites_with_stats"] == run["sites"]
    assert run["stats_roles"] == ["grad_output", "input", "weight"]
    assert run["amax_min"] > 0
    assert len(run["losses"]) == len(run["per_step"]) == (CONTROL_STEPS if variant in CONTROLS else 20)


@pytest.mark.parametrize("variant", CORRECT)
def test_every_step_matches_single_process(runs, variant):
    steps = runs[variant]["per_step"]
    rel = [_rel(s["loss"], s["ref_loss"]) for s in steps]
    assert max(rel) < 1e-5, f"{variant}: relative loss differences per step {[f'{r:.1e}' for r in rel]}"
    clean = _clean_steps(runs[variant])
    worst = [f"{max(s['grad_max'].values()):.1e}" for s in steps]
    assert sum(clean) >= 12, f"{variant}: gradients differ in {20 - sum(clean)} of 20 steps: {worst}"


@pytest.mark.parametrize("variant", CORRECT)
def test_independent_runs_track_single_process(runs, variant):
    ref = runs[f"single:{variant.split(':')[1]}"]
    rel = [_rel(a, b) for a, b in zip(runs[variant]["losses"], ref["losses"], strict=True)]
    assert max(rel) < 1e-3, f"{variant}: relative loss differences per step {[f'{r:.1e}' for r in rel]}"


@pytest.mark.parametrize("variant", CONTROLS)
def test_without_amax_reduction_the_gradients_differ(runs, variant):
    worst = [max(s["grad_max"].values()) for s in runs[variant]["per_step"]]
    assert min(worst) > 1e-2, f"{variant}: local amaxes left some step's gradients unchanged: {worst}"
    assert not any(_clean_steps(runs[variant]))
    # and the loss bound of issue 3 fails too (within 5 steps by 3e-5 to 9e-5 here)
    assert max(_rel(s["loss"], s["ref_loss"]) for s in runs[variant]["per_step"]) > 1e-5


def test_layer_on_batch_and_sequence_sharded_inputs(runs):
    """A DTensor input sharded on a leading dim (the batch, or the sequence as sequence
    parallelism shards it), evenly or not: the output and its gradient keep that
    placement and the global shape, and y, dx, dw and db equal the single process's: within
    1e-6 (the GEMM of a shard's rows is the same arithmetic per row, but MKL picks its kernel
    by the number of rows, and with AVX-512 kernels their sums differ in the last bits:
    measured 5e-8 on this machine, 2026-11-23; bit for bit with AVX2 kernels)."""
    cases = {k: v for k, v in runs["layer"].items() if k != "mixed"}
    assert len(cases) == 4
    for case, r in cases.items():
        dim = case[-2]
        assert r["placements"] == [f"(Shard(dim={dim}),)"] * 2, (case, r)
        assert r["y"] < 1e-6 and r["dx"] < 1e-6, (case, r)    # row-local: the same products
        assert r["dw"] < 1e-6 and r["db"] < 1e-6, (case, r)   # sums over the shards
    assert "convert both to DTensors" in runs["layer"]["mixed"]
