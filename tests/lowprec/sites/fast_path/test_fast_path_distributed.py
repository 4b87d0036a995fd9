"""The `torch` backend's FP8 fast path under torchrun (gloo): FSDP2, TP and DP x TP.

dist_fast_worker.py trains the small GPT (every block's linear layers in FP8) for 5 AdamW
steps in each layout, and a one-process run (no process group in it, on rank 0 of the
2-rank launch) trains the same model on the same batches:

* DP 2 and DP 4: `lowprec.runtime.engines.fsdp.FullyShardedDP` (DP 4 in fp8_tensorwise only);
* TP 2 and DP 2 x TP 2: `lowprec.runtime.engines.parallel.data_parallel` (qkv and fc column-,
  proj row-parallel DTensor sites);

for fp8_tensorwise, fp8_delayed and fp8_rowwise. What must hold:

* every FP8 site on every rank ran the fast path on every step (its call counters: 5 fast
  calls, no fallback call);
* `amax_scope: group`: the losses equal one process's within a relative 1e-6 at each of
  the 5 steps (under DP x TP one process's loss at the run's own parameters of that step:
  chained, the two drift apart once a rounding difference moves a value across an FP8
  rounding boundary, which data decide; 5e-5 relative by step 3 seen with row-wise). Not bit for bit: the batch-mean loss is a sum of per-rank means, an FSDP
  weight gradient a sum of per-rank GEMMs and a row-parallel output a sum of per-rank
  partial GEMMs; each rounds differently from one GEMM by an FP32 ulp (measured: 0 to
  1.8e-7 relative). The FP8 bytes themselves are one process's: on one layer (the `layer`
  variant, column- and row-parallel, rows split over dp) the column-parallel output (and
  at dp 1 the weight gradient) is bit for bit one process's, and everything else within 1e-5 (FP32
  partial sums of values about 1-10), delayed scaling exactly;
* FP8 all-gather of weights (FSDP2, DP 2, `fsdp8`) trains bit for bit as the
  high-precision all-gather (`fsdphp`) through a fallback of one site to bf16 at step 2
  (that site gathers its high-precision weight from then on), and the state_dict holds
  plain high-precision shards;
* the ledger (experiments/ledger.py) of 4 FSDP2 steps of a BF16 GPT: the weight
  all-gathers move at most 0.55x the bytes of BF16's with FP8 all-gather; `local` issues no
  amax all-reduce per cast (one per step for the gathered weights' amaxes); `group` two per
  site per step (both the count model's, experiments/amax_count.py); a check step (every
  2nd) issues exactly one statistics collective, and every rank's check sees the same
  statistics (the controller decides the same on every rank);
* sequence parallel (TP 2, `seq`): a column-parallel site on a sequence-sharded input with
  `FP8SequenceColwiseParallel` gathers FP8 bytes (a quarter of the FP32 gather's here,
  half of BF16's) and gives the output, input gradient and weight gradient of
  `ColwiseParallel(input_layouts=Shard(1))` (a high-precision gather, then the fast
  path) bit for bit, in both scopes; three such sites reading one input (q, k, v of one
  prepared model) reduce its amax once (the count model's MAX all-reduces: 1 under `local`,
  7 under `group`);
* `precision.gemm` on shards (`layer`, `seq`): each `_scaled_mm` of the sharded paths
  (fprop, dgrad, wgrad) gets its own `use_fast_accum`, here the opposite of the defaults;
* FP8 all-gather under FSDP2 x TP (DP 2 x TP 2: each tp shard's FP8 bytes gathered over
  dp, `fsdptp8`) and HSDP (2 x 2, `hsdp8`) trains bit for bit as the high-precision gather
  through the same fallback, every FP8 site's forward gets FP8 bytes until it falls back;
* checkpoint and resume under DP 2 x TP 2 with FP8 all-gather (FSDP2 x TP,
  lowprec.runtime.engines.parallel.data_parallel; the `fsdptp8` run above, after its
  fallback): a DCP checkpoint after step 3 holds FP32 weights; a fresh model resumed from
  it repeats the uninterrupted run's losses bit for bit;
  2 ranks (TP 2, the dp shards folded) load it (DCP resharding) and train on: the first
  step within 1e-6, the next within 1e-4 (the bf16 site's input roundings; see the test);
* `amax_scope: local`: each rank's loss on its own rows at the initial weights equals one
  process's loss on those rows bit for bit (each rank its own scales); the same layer
  check with local scales differs from one process by far more than rounding (one large
  input value that only one rank holds), so the group checks can fail.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from fast_path_checks import INTERPRETED

pytestmark = [pytest.mark.slow, pytest.mark.launches]

WORKER = Path(__file__).resolve().parent / "dist_fast_worker.py"
ROOT = Path(__file__).resolve().parents[4]
TIMEOUT_S = 1200 if INTERPRETED else 400   # a hang's net; interpreted kernels take ~3x as long
FORMATS = ("fp8_tensorwise", "fp8_delayed", "fp8_rowwise")
GROUP = [f"{m}:{f}:group" for m in ("fsdp", "dptp") for f in FORMATS]
LOCAL = ["fsdp:fp8_tensorwise:local", "dptp:fp8_rowwise:local"]
LAYER = [f"layer:{f}:group" for f in FORMATS]
CKPT = ["ckpt_fsdptp:fp8_tensorwise:group"]
GATHER = ["fsdp8:fp8_tensorwise:group", "fsdphp:fp8_tensorwise:group"]
GATHER2D = [f"{m}:fp8_tensorwise:group" for m in ("fsdptphp", "hsdp8", "hsdphp")]   # fsdptp8: the ckpt run
LEDGER = ["ledger:fp8_tensorwise:group", "ledger:fp8_tensorwise:local"]
SEQ = ["seq:fp8_tensorwise:group", "seq:fp8_tensorwise:local"]
RESHARD = ["reshard_fsdptp:fp8_tensorwise:group"]   # loads w4's checkpoint
# the one-process runs (no process group in them) go in the 2-rank launch: one process start less
SINGLE = [f"single:{f}:group" for f in FORMATS] + ["single:fp8_tensorwise:local", "single:fp8_rowwise:local"]
# DP 4 runs FSDP2 in one format: the engine, the amax all-reduce and every format's code path are the
# same at DP 2 and DP 4 (only the group's size differs); the w2 runs hold each format under FSDP2
W4_GROUP = [v for v in GROUP if not v.startswith("fsdp:") or v == "fsdp:fp8_tensorwise:group"]
FIRST = {"w4": (4, W4_GROUP + LOCAL + ["layer:fp8_tensorwise:group"] + GATHER2D + CKPT)}
AFTER = {"w2": (2, SINGLE + GROUP + LOCAL + LAYER + ["layer:fp8_tensorwise:local"] + GATHER + LEDGER + SEQ + RESHARD)}
JOBS = {**FIRST, **AFTER}
PINNED = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
GEMM_FLAGS = (False, True, True)   # the worker's `precision.gemm` in `layer` and `seq`: (fprop, dgrad, wgrad)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, gloo, rank_forks):
    d = tmp_path_factory.mktemp("fast_path_distributed")
    out = _run(d, FIRST, rank_forks)
    out.update(_run(d, AFTER, rank_forks))   # one 2-rank launch, after the checkpoint it reshards
    return out


def _run(d: Path, specs: dict, rank_forks) -> dict:
    """Launch the jobs of `specs` at once, wait for all; each one's results by name."""
    jobs = {}
    for name, (n, variants) in specs.items():
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n)]
        with open(d / f"{name}.log", "w") as log:
            jobs[name] = subprocess.Popen([*launch, *rank_forks.rank(WORKER, d / f"{name}.pt", *variants)],
                                          stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                          env=rank_forks.env({**os.environ, **PINNED}), start_new_session=True)
    out = {}
    try:
        for name, proc in jobs.items():
            try:
                proc.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} ran past {TIMEOUT_S} s:\n{(d / f'{name}.log').read_text()[-4000:]}")
            assert proc.returncode == 0, f"{name} failed:\n{(d / f'{name}.log').read_text()[-6000:]}"
            out[name] = torch.load(d / f"{name}.pt", weights_only=True)
    finally:
        for proc in jobs.values():   # only the jobs started here, after a timeout or failure
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return out


TRAINED = [(w, v) for w in ("w2", "w4") for v in (GROUP if w == "w2" else W4_GROUP) + LOCAL]


@pytest.mark.parametrize("world,variant", TRAINED)
def test_every_site_runs_the_fast_path_every_step(runs, world, variant):
    run = runs[world][variant]
    assert len(run["counts"]) == JOBS[world][0] and len(run["sites"]) == 8
    for rank, counts in enumerate(run["counts"]):
        assert set(counts) == set(run["sites"])
        assert all(c == (5, 0) for c in counts.values()), f"rank {rank}: (fast, fallback) calls {counts}"


@pytest.mark.parametrize("world,variant", [(w, v) for w, v in TRAINED if v.endswith(":group")])
def test_group_scope_losses_equal_one_process(runs, world, variant):
    _, fmt, _ = variant.split(":")
    run = runs[world][variant]
    # FSDP2 and DP x TP: against one process at the run's own parameters, step by step (chained runs
    # drift apart once an FP32 reduction moves a value across an FP8 rounding boundary, on some CPUs
    # and not others; dist_fast_worker._with_reference)
    ref = run["ref_losses"] if "ref_losses" in run else runs["w2"][f"single:{fmt}:group"]["losses"]
    got = run["losses"]
    assert len(got) == len(ref) == 5
    for step, (a, b) in enumerate(zip(got, ref)):
        assert abs(a - b) <= 1e-6 * abs(b), f"step {step}: {a} vs one process {b}"


@pytest.mark.parametrize("world", ["w2", "w4"])
def test_local_scope_is_one_process_per_rank(runs, world):
    n = JOBS[world][0]
    own = runs[world]["fsdp:fp8_tensorwise:local"]["own_row_loss"]
    assert own == runs["w2"]["single:fp8_tensorwise:local"]["row_losses"][n]
    # the group scope's rank losses are not the per-rank ones: its scales are the batch's
    grouped = runs[world]["fsdp:fp8_tensorwise:group"]["own_row_loss"]
    assert grouped != own


@pytest.mark.parametrize("world,variant", [("w2", v) for v in LAYER] + [("w4", "layer:fp8_tensorwise:group")])
def test_one_layer_on_shards_is_one_process(runs, world, variant):
    per_rank = runs[world][variant]
    assert len(per_rank) == JOBS[world][0]
    exact = variant.startswith("layer:fp8_delayed")
    for rank, res in enumerate(per_rank):
        for style in ("col", "row"):
            r = res[style]
            assert r["calls"] == (1, 0), f"rank {rank} {style}: {r['calls']}"
            assert r["gemm_flags"] == list(GEMM_FLAGS), f"rank {rank} {style}: fprop, dgrad, wgrad {r['gemm_flags']}"
            bound = 0.0 if exact else 1e-5
            assert max(r["y"], r["dx"], r["dw"]) <= bound, f"rank {rank} {style}: {r}"
        assert res["col"]["y"] == 0.0   # a local GEMM on one process's FP8 bytes
        if world == "w2":               # one dp rank: the weight gradient is one GEMM too
            assert res["col"]["dw"] == 0.0


def test_local_scales_differ_on_one_layer(runs):
    for res in runs["w2"]["layer:fp8_tensorwise:local"]:
        assert res["row"]["y"] > 0.1 and res["col"]["dw"] > 0.1


@pytest.mark.parametrize("world", ["w2"])
def test_fp8_all_gather_trains_as_the_high_precision_gather(runs, world):
    fp8, hp = runs[world]["fsdp8:fp8_tensorwise:group"], runs[world]["fsdphp:fp8_tensorwise:group"]
    assert len(fp8["wrapped"]) == 8 and hp["wrapped"] == []
    assert fp8["losses"] == hp["losses"]
    assert fp8["params"].keys() == hp["params"].keys()
    assert all(torch.equal(fp8["params"][k], hp["params"][k]) for k in hp["params"])
    assert fp8["state_types"] == ["Tensor"]   # checkpoints see plain high-precision shards
    for counts in fp8["counts"]:   # the site that fell back at step 2 ran two FP8 steps
        assert counts.pop("blocks.0.mlp.fc") == (2, 0) and set(counts.values()) == {(5, 0)}


def _per_step(run, mode, role):
    return [t.get(role, (0, 0, 0)) for t in run[mode]]


def test_ledger_fp8_all_gather_bytes(runs):
    for variant in LEDGER:
        run = runs["w2"][variant]
        hp, fp8 = _per_step(run, "hp_gather", "weight_all_gather"), _per_step(run, "fp8_gather", "weight_all_gather")
        for (n_hp, b_hp, crit_hp), (n_fp8, b_fp8, crit_fp8) in zip(hp, fp8):
            assert n_hp == n_fp8 and crit_hp == crit_fp8 == 0
            assert b_fp8 <= 0.55 * b_hp, (b_fp8, b_hp)


def test_ledger_amax_reductions_by_scope(runs):
    """The real MAX all-reduces per step are the count model's (experiments/amax_count.py): under
    FSDP2 `local` (the default) none per cast, `group` two per site; and every rank's check saw
    the same statistics (the controller decides on them: the same decisions on every rank)."""
    from experiments.amax_count import SiteLayout, Split, amax_all_reduces
    for scope in ("local", "group"):
        run = runs["w2"][f"ledger:fp8_tensorwise:{scope}"]
        sites = [SiteLayout(Split.NONE)] * len(run["fast_calls"][0])
        for mode, fp8 in (("hp_gather", False), ("fp8_gather", True)):
            want = amax_all_reduces(sites, scope=scope, dp=True, fp8_all_gather=fp8)
            assert [c for c, _, _ in _per_step(run, mode, "amax_all_reduce")] == [want] * 4, (scope, mode)
            stats = [c for c, _, _ in _per_step(run, mode, "stats_all_gather")]
            assert stats == [0, 1, 0, 1]   # check_every=2: steps 1 and 3, one collective for all sites
            checks = run["checks_" + mode.split("_")[0]]
            assert len(checks[0]) == 2 and all(c == checks[0] for c in checks), (scope, mode)
    assert amax_all_reduces(sites, scope="local", dp=True, fp8_all_gather=False) == 0


@pytest.mark.parametrize("layout", ["fsdptp", "hsdp"])
def test_fp8_all_gather_2d_trains_as_the_high_precision_gather(runs, layout):
    fp8 = runs["w4"]["ckpt_fsdptp:fp8_tensorwise:group" if layout == "fsdptp" else "hsdp8:fp8_tensorwise:group"]
    hp = runs["w4"][f"{layout}hp:fp8_tensorwise:group"]
    assert len(fp8["wrapped"]) == 8 and hp["wrapped"] == []
    assert fp8["losses"] == hp["losses"]
    assert fp8["params"].keys() == hp["params"].keys()
    assert all(torch.equal(fp8["params"][k], hp["params"][k]) for k in hp["params"])
    assert fp8["state_types"] == ["Tensor"]   # checkpoints see plain high-precision shards
    # 8 sites x 2 steps, then 7 x 3 after blocks.0.mlp.fc fell back: FP8 bytes on every rank
    assert fp8["fp8_forwards"] == [37] * 4 and hp["fp8_forwards"] == [0] * 4
    for counts in fp8["counts"]:
        assert counts.pop("blocks.0.mlp.fc") == (2, 0) and set(counts.values()) == {(5, 0)}


def test_dp_x_tp_fp8_all_gather_checkpoint_resumes_exactly_and_reshards(runs):
    run = runs["w4"]["ckpt_fsdptp:fp8_tensorwise:group"]   # blocks.0.mlp.fc fell back at step 2
    assert len(run["wrapped"]) == 8 and len(run["losses"]) == 5
    straight = run["losses"][3:]
    assert run["resumed"] == straight
    assert run["weight_dtypes"] and set(run["weight_dtypes"].values()) == {"torch.float32"}
    resharded = runs["w2"]["reshard_fsdptp:fp8_tensorwise:group"]
    assert resharded["step"] == 3 and len(resharded["wrapped"]) == 8
    # step 3 runs on the loaded weights: only the sums' order differs (dp 1 against dp 2).
    # Step 4's weights carry step 3's gradients, FP32 sums in another order; the bf16 site
    # rounds its input to bf16, where an FP32 ulp can flip a rounding (measured 1e-5).
    for (a, b), bound in zip(zip(resharded["resumed"], straight, strict=True), (1e-6, 1e-4)):
        assert abs(a - b) <= bound * abs(b), (resharded["resumed"], straight)


@pytest.mark.parametrize("variant", SEQ)
def test_sequence_parallel_gathers_fp8_bytes(runs, variant):
    for rank, res in enumerate(runs["w2"][variant]):
        assert (res["y"], res["dx"], res["dw"]) == (0.0, 0.0, 0.0), f"rank {rank}: {res}"
        fp8_bytes, hp_bytes = res["bytes"]
        assert hp_bytes > 0 and fp8_bytes * 4 == hp_bytes   # FP32 input: 4 bytes an element, FP8 1
        assert res["calls"] == ((1, 0), (1, 0))
        # q, k, v reading one input reduce its amax once (lowprec.sites.shared_amax): the count model's
        from experiments.amax_count import SiteLayout, Split, amax_all_reduces
        scope = variant.split(":")[2]
        want = amax_all_reduces([SiteLayout(Split.SP, "x")] * 3, scope=scope, dp=False, fp8_all_gather=False)
        assert res["qkv_amax_all_reduces"] == want == {"local": 1, "group": 7}[scope], res["qkv_amax_all_reduces"]
        assert res["gemm_flags"] == (list(GEMM_FLAGS), list(GEMM_FLAGS)), f"rank {rank}: {res['gemm_flags']}"
