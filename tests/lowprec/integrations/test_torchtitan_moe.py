"""Experts as sites under torchtitan's real Trainer with expert parallelism: torchtitan 0.3's Qwen3
MoE (titan_moe_job.py: its own model code at a CPU size, 2 layers of 4 experts, top 2) under
`torchtitan.train` on torchrun with gloo, 2 ranks: EP 2 (torchtitan's `AllToAllTokenDispatcher`,
`all_to_all_single` over gloo; the 3-D expert weights DTensors sharded along the experts) and
FSDP 2 over the same ranks (dp_shard 2: the dense layers sharded, each rank its own batch).

Each rank runs the expert sites of its own experts (rank 0 experts 0 and 1 of each layer, rank 1
experts 2 and 3): the sites of those global indices, fed the tokens of both ranks. A NaN planted in
expert 3 of layer 1 (an injection on every rank: it fires only where that expert runs, rank 1) makes
the step's loss NaN on both ranks; the replays bisect over the 8 expert sites (8, 4, 2, 1, 1) and
demote exactly that expert on both ranks, whose decisions are the same event for event, and the
same as the one-process run's (the same job on one rank, no EP: every expert's site runs there).

Layer 1's experts run delayed scaling, layer 0's NVFP4 (stochastic rounding of gradients, random
Hadamard signs): each rank's experts' amax histories and random generators are that rank's own. The
router metrics logged every step are every rank's (the same on both ranks). After training each rank's
eval logits equal the whole model's in one process (every rank's parameters and scaling state
gathered). The EP run saves a checkpoint at step 4; resumed from it (the final checkpoint removed),
each rank gets its own rollout state back and trains steps 5 and 6 again as the uninterrupted run
did, loss for loss, ending with the same eval logits.

Three torchrun launches: 2 ranks (EP 2 x FSDP 2), 2 ranks again (the resume), then 1 rank (the
one-process run).
"""

from __future__ import annotations

import math
import shutil

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install 'lowprec[torchtitan]')")
pytest.importorskip("tokenizers")
pytest.importorskip("datasets")

from test_torchtitan_trainer import _ok, decisions  # noqa: E402
from titan_helpers import TitanJob, fault  # noqa: E402
from titan_moe_job import MOE_JOB  # noqa: E402

import torch  # noqa: E402

from lowprec.policy.router_signals import router_balance  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.launches]

EXPERTS = "layers.{}.moe.routed_experts.inner_experts"
EXPERT = EXPERTS.format(1) + ".3"
PLAN = """\
precision:
  backend: emulated
  default: bf16
  keep_high_precision: [{fqns: [lm_head]}]
  rules:
    - {name: dense, select: {module_type: Linear}, format: bf16, ladder: [fp8_tensorwise, bf16]}
    - {name: experts, select: {kind: experts}, format: fp8_delayed, ladder: [fp8_delayed, bf16]}
    - {name: experts_sr, select: {kind: experts, layers: [0]}, format: nvfp4, ladder: [nvfp4, bf16]}
rollout:
  check_every: 2
  min_steps: 2
  cooldown_steps: 1000
  thresholds: {site_patience: 1, min_expert_tokens: 1000000}   # no expert judged by thresholds (the runs see other data), NaNs still blamed
  stages:
    - {name: dense_fp8, select: {kind: dense}, format: fp8_tensorwise}
tracking: {enabled: false}
"""
NAN_AT, STEPS, SAVED = 3, 6, 4


def test_ep2_fsdp2_nan_in_one_expert_demotes_it_on_every_rank(tmp_path, gloo, free_port, rank_forks):
    job = TitanJob(tmp_path, PLAN, steps=STEPS, checkpoint_every=SAVED, reference=True,
                   job=MOE_JOB, faults=[fault("nan", EXPERT, NAN_AT, NAN_AT + 1)])
    log = _ok(job.run(rank_forks, 2, free_port(), "--parallelism.expert_parallel_degree", "2"))
    assert "dp_shard=2" in log, log[-4000:]
    reports = job.reports(2)
    experts = [f"{EXPERTS.format(layer)}.{e}" for layer in (0, 1) for e in range(4)]
    for rank, r in enumerate(reports):
        # each rank ran its own experts' sites (2 of each layer), on tokens of both ranks
        ran = {f for f, n in r["expert_tokens"].items() if n > 0}
        assert ran == {f"{EXPERTS.format(layer)}.{e}" for layer in (0, 1) for e in (2 * rank, 2 * rank + 1)}, r
        assert sorted(r["expert_tokens"]) == experts
    # the router metrics logged every step count every rank's experts (each rank runs only its own):
    # the same on both ranks, those of the two ranks' tokens together
    routed = {f: sum(r["expert_tokens"][f] for r in reports) for f in experts}
    assert reports[0]["routers"] == reports[1]["routers"] == router_balance({}, routed), reports[0]["routers"]
    assert sorted(reports[0]["routers"]) == sorted(f"router/{EXPERTS.format(layer)}/{m}" for layer in (0, 1)
                                                   for m in ("cv", "max_over_mean"))
    want = decisions(reports[0]["events"])
    for r in reports:
        assert decisions(r["events"]) == want, f"rank {r['rank']} decided otherwise"
        assert r["formats"][EXPERT] == "bf16"
        assert {e: f for e, f in r["formats"].items() if e in experts and e != EXPERT} == \
            {e: "nvfp4" if e.startswith(EXPERTS.format(0)) else "fp8_delayed" for e in experts if e != EXPERT}
        assert math.isnan(r["losses"][NAN_AT]) and r["skipped"] == 1
    # bisected by replays through torchtitan's forward and backward over the 8 expert sites, then
    # exactly that expert demoted and the step skipped; the dense stage promoted at the next check
    replays = [sites for kind, step, _, sites in want if kind == "replay"]
    assert [len(s) for s in replays] == [8, 4, 2, 1, 1] and replays[-1] == (EXPERT,), want
    assert [d[:2] for d in want] == [("replay", NAN_AT)] * 5 + [("fallback", NAN_AT), ("skip_step", NAN_AT),
                                                                ("promote", NAN_AT + 2)], want
    assert want[5][3] == (EXPERT,) and want[7][2] == "dense_fp8"
    forwards = _against_one_process(job)
    # resumed under EP from the checkpoint of step SAVED (the last one removed): each rank's own
    # experts' delayed-scaling histories come back with its own entry of the rollout's state, so
    # the steps trained again are the uninterrupted run's, loss for loss and decision for decision
    shutil.rmtree(job.dump / "checkpoint" / f"step-{STEPS}")
    _ok(job.run(rank_forks, 2, free_port(), "--parallelism.expert_parallel_degree", "2"))
    for before, after in zip(reports, job.reports(2)):
        assert after["restored"] and after["losses"][SAVED:] == before["losses"][SAVED:], (before, after)
        assert decisions(after["events"]) == want and after["formats"] == before["formats"]
        assert after["routers"] == before["routers"]
    # and ends with the same model: its eval logits are the uninterrupted run's, bit for bit
    assert all(torch.equal(a["logits"], b["logits"]) for a, b in zip(forwards, _against_one_process(job)))
    # the one-process run: the same job on one rank (no EP, no FSDP) decides the same, event for event
    (tmp_path / "one").mkdir()
    job = TitanJob(tmp_path / "one", PLAN, steps=STEPS, checkpoint_every=STEPS, job=MOE_JOB,
                   faults=[fault("nan", EXPERT, NAN_AT, NAN_AT + 1)])
    log = _ok(job.run(rank_forks, 1, free_port()))
    assert "dp_shard" not in log or "dp_shard=1" in log, log[-4000:]
    one, = job.reports(1)
    assert all(n > 0 for n in one["expert_tokens"].values()), one["expert_tokens"]   # every expert ran here
    assert decisions(one["events"]) == want and one["formats"] == reports[0]["formats"]
    assert one["routers"] == router_balance({}, one["expert_tokens"])   # one process: its own tokens


def _against_one_process(job) -> list[dict]:
    """Each rank's eval logits under EP 2 x FSDP 2 (3 rows of 40 tokens, the same on both ranks) equal
    the whole model's in one process (every rank's parameters and its own experts' delayed-scaling
    histories gathered, the run's formats, the parameters in BF16 as FSDP computes): measured identical
    bits. The bound 1e-5 leaves room for another BLAS only; a reference that took a rank's fresh copies
    of the other rank's experts' histories, or ran the batch as 2-row micro-batches padded to seq_len
    (per-tensor FP8 scales of other tokens), was off by 0.028 (docs/moe.md)."""
    forwards = [torch.load(job.dump / f"forwards_rank{r}.pt") for r in range(2)]
    assert torch.equal(forwards[0]["logits"], forwards[1]["logits"]) and forwards[0]["logits"].shape[:2] == (3, 40)
    for f in forwards:
        d = (f["logits"] - f["logits_one_process"]).abs().max().item()
        assert d <= 1e-5, d
    return forwards
