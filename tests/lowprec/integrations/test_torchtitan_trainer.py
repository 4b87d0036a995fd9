"""lowprec's rollout under torchtitan's real Trainer: `torchtitan.train` under torchrun, gloo, CPU.

torchtitan 0.3's own entry point (`torchtitan.train.main`: its ConfigManager, config registry,
Trainer, llama3 debugmodel, Hugging Face text data loader and tokenizer over local files,
FSDP2 / TP parallelisms, DCP checkpointer) runs a job whose config function returns
`lowprec_trainer(config)`. What torchtitan needs to run on a CPU at all is in
titan_launch.py and the job module (titan_helpers.py).

The MLP layers start in FP8 and a stage promotes the attention at a check. A NaN is planted
in one MLP layer's output on rank 0 only, in the 4th step: every rank sees the step's loss
as NaN (the step's loss is reduced over the ranks), replays it through torchtitan's forward
and backward with halves of the FP8 sites in high precision, blames that one layer, and
falls it back to BF16; the step is withheld from the optimizers (torchtitan's "Loss is not
finite" stop does not end the job) and training goes on. Under FSDP 2 the run also meets a
data fault (the logits x100 for two steps on every rank): replays with every site in high
precision clear precision, both steps are skipped and the run rewinds to an in-memory
snapshot of the sharded state; the LR probe runs on torchtitan's validation batch; rank 0
tracks into MLflow. The job is then resumed from torchtitan's checkpoint: lowprec's state
comes back from it on every rank.
"""

from __future__ import annotations

import math

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install 'lowprec[torchtitan]')")
pytest.importorskip("tokenizers")
pytest.importorskip("datasets")

from titan_helpers import TitanJob, fault  # noqa: E402

pytestmark = pytest.mark.slow

SITE = "layers.1.feed_forward.w2"
PLAN = """\
precision:
  backend: emulated
  default: bf16
  keep_high_precision: [{fqns: [lm_head]}]
  rules:
    - {name: mlp, select: {glob: "layers.*.feed_forward.*"}, format: fp8_tensorwise, ladder: [fp8_tensorwise, bf16]}
    - {name: attn, select: {glob: "layers.*.attention.*"}, format: bf16, ladder: [fp8_tensorwise, bf16]}
rollout:
  check_every: 2
  min_steps: 2
  cooldown_steps: 1000
  thresholds: {site_patience: 1}
  stages:
    - {name: attn_fp8, select: {glob: "layers.*.attention.*"}, format: fp8_tensorwise}
tracking: {enabled: false}
"""
# the same, with rewinds from in-memory snapshots, the LR probe at every check, loss anomalies
# within reach of an 8-step run, and MLflow tracking
FULL = PLAN.replace("  thresholds: {site_patience: 1}", """\
  thresholds: {site_patience: 1, large_warmup: 2, large_factor: 3.0}
  rewind: {enabled: true, snapshot_every: 2, keep: 3}
  lr_probe: {enabled: true, every_checks: 1}""").replace("tracking: {enabled: false}",
                                                        'tracking: {uri: "URI", experiment: titan}')
NAN_AT = 3       # the 4th step (lowprec counts from 0, torchtitan's log from 1): a NaN in SITE on rank 0
SPIKE_AT = 6     # steps 6 and 7: the logits x100 on every rank (a data fault: no precision to blame)
STEPS = 6


def decisions(events: list[str]) -> list[tuple]:
    """(kind, step, stage, sites) of each event (its JSON line)."""
    import json
    out = []
    for line in events:
        e = json.loads(line)
        out.append((e["kind"], e["step"], e.get("stage"), tuple(sorted(e["sites"]))))
    return out


def _ok(proc) -> str:
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return log


def _check_nan_fallback(reports: list[dict], log: str) -> list[tuple]:
    """Every rank decided alike: the planted site fell back at the NaN step, which was skipped."""
    want = decisions(reports[0]["events"])
    for r in reports:
        assert decisions(r["events"]) == want, f"rank {r['rank']} decided otherwise"
        assert r["formats"][SITE] == "bf16"
        assert {f for n, f in r["formats"].items() if n != SITE} == {"fp8_tensorwise"}   # the rest as promoted
        assert math.isnan(r["losses"][NAN_AT])
    # bisected by replays through torchtitan's forward and backward, then blamed, fallen back, skipped;
    # the attention stage promoted at the next check after two stable steps
    assert [d[:2] for d in want[:8]] == [("replay", NAN_AT)] * 5 + [("fallback", NAN_AT), ("skip_step", NAN_AT),
                                                                     ("promote", NAN_AT + 2)], want
    assert want[5][3] == (SITE,) and want[7][2] == "attn_fp8"
    assert f"lowprec: step {NAN_AT + 1} had a non-finite loss and was withheld" in log
    assert f"step: {NAN_AT + 1:2d}" not in log   # torchtitan logged no metrics line for the withheld step
    return want


def _mlflow_run(uri: str):
    from mlflow.tracking import MlflowClient
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("titan").experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]   # one run, written by rank 0
    return client, runs[0]


def test_fsdp2_nan_on_one_rank_skip_rewind_probe_tracking_and_resume(tmp_path, gloo, free_port):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    faults = [fault("nan", SITE, NAN_AT, NAN_AT + 1, rank=0), fault("loss_spike", "", SPIKE_AT, SPIKE_AT + 2, 100.0)]
    steps = 10
    job = TitanJob(tmp_path, FULL.replace("URI", uri), steps=steps, checkpoint_every=5, faults=faults, validator=True)
    log = _ok(job.run(2, free_port()))
    assert "dp_shard=2, cp=1, tp=1" in log   # torchtitan's mesh: FSDP 2
    first = job.reports(2)
    want = _check_nan_fallback(first, log)
    # the spike: replayed with every site in high precision (not precision's), skipped twice, then a rewind
    assert [d[:2] for d in want[8:]] == [("replay", SPIKE_AT), ("skip_step", SPIKE_AT), ("replay", SPIKE_AT + 1),
                                         ("skip_step", SPIKE_AT + 1), ("rewind", SPIKE_AT + 1)], want
    for r in first:
        assert r["rewinds"] == 1 and r["titan_step"] == steps
        # back to the snapshot of 4 completed steps (the newest before the spike began), then 4 more steps
        assert r["step"] == 4 + (steps - SPIKE_AT - 2) and len(r["losses"]) == r["step"]
    # rank 0's event log (the converter's event_log) holds the same events
    assert decisions((tmp_path / "events.jsonl").read_text().splitlines()) == want
    client, run = _mlflow_run(uri)
    assert run.info.status == "FINISHED"
    metrics = run.data.metrics
    assert "train/loss" in metrics and "train/rewound_to" in metrics
    assert math.isfinite(metrics["train/lr_sensitivity"])   # the LR probe ran, on torchtitan's validation batch

    # resumed by torchtitan from its last checkpoint, two more steps, no faults
    job.update(steps=steps + 2, faults=[])
    log = _ok(job.run(2, free_port()))
    assert f"Loading the checkpoint from {job.dump / 'checkpoint' / f'step-{steps}'}" in log
    for before, after in zip(first, job.reports(2)):
        assert after["restored"] and after["step"] == before["step"] + 2 and after["rewinds"] == 1
        assert after["formats"][SITE] == "bf16"               # the fallback came back with the checkpoint
        assert after["events"][:len(before["events"])] == before["events"]
        a, b = after["losses"][:len(before["losses"])], before["losses"]
        assert all(x == y or (x != x and y != y) for x, y in zip(a, b)), (a, b)


def test_fsdp2_x_tp2_nan_on_one_rank_falls_back_on_every_rank(tmp_path, gloo, free_port):
    job = TitanJob(tmp_path, PLAN, steps=STEPS, checkpoint_every=STEPS,
                   faults=[fault("nan", SITE, NAN_AT, NAN_AT + 1, rank=0)])
    log = _ok(job.run(4, free_port(), "--parallelism.tensor_parallel_degree", "2"))
    assert "dp_shard=2, cp=1, tp=2" in log   # torchtitan's mesh: FSDP 2 x TP 2
    reports = job.reports(4)
    want = _check_nan_fallback(reports, log)
    assert len(want) == 8
    for r in reports:
        assert r["skipped"] == 1 and r["step"] == STEPS and r["titan_step"] == STEPS
        assert all(math.isfinite(v) for i, v in enumerate(r["losses"]) if i != NAN_AT)


def test_fsdp2_torchao_backend_nan_on_one_rank_falls_back_on_every_rank(tmp_path, gloo, free_port):
    """The torchao backend's sites (torchao's Float8Linear, emulated on CPU) as torchtitan Modules."""
    pytest.importorskip("torchao")
    job = TitanJob(tmp_path, PLAN.replace("backend: emulated", "backend: torchao"), steps=STEPS,
                   checkpoint_every=STEPS, faults=[fault("nan", SITE, NAN_AT, NAN_AT + 1, rank=0)])
    log = _ok(job.run(2, free_port()))
    reports = job.reports(2)
    want = _check_nan_fallback(reports, log)
    assert len(want) == 8
    for r in reports:
        assert r["skipped"] == 1 and r["step"] == STEPS
        assert all(math.isfinite(v) for i, v in enumerate(r["losses"]) if i != NAN_AT)


def test_one_rank_job_runs_the_final_eval_and_tracks_it(tmp_path, gloo, free_port):
    """An `eval:` section's final eval (lm-eval over local tasks) through the model's logits,
    tracked into MLflow; a one-rank job (lm-eval returns results on local rank 0 only)."""
    pytest.importorskip("lm_eval")
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    plan = PLAN.replace("tracking: {enabled: false}", f'tracking: {{uri: "{uri}", experiment: titan}}') + \
        "eval: {suite: default, every: 0, mode: fast, final_mode: fast, gates: null, high_precision: false}\n"
    job = TitanJob(tmp_path, plan, steps=2, checkpoint_every=2)
    _ok(job.run(1, free_port()))
    client, run = _mlflow_run(uri)
    assert run.info.status == "FINISHED"
    evals = {k for k in run.data.metrics if k.startswith("eval/")}
    assert any(k.startswith("eval/heldout_shakespeare/") for k in evals), sorted(run.data.metrics)
