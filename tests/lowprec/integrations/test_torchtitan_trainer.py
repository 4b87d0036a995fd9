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
tracks into MLflow. Rank 0 is then SIGKILLed one step after a checkpoint (its step sent to
MLflow), and torchtitan resumes the job from that checkpoint with an `eval:` section added:
lowprec's state comes back on every rank, the job goes on in the same MLflow run without a
point or event logged twice, and the final eval runs on both ranks with rank 0's outcome on each.
Under FSDP 2 the sites are the torch backend's, their weights gathered by lowprec's FP8
all-gather (`LowprecConverter.Config(fp8_all_gather=True)`): every forward of every site gets
FP8 bytes while the site runs FP8 and its weight in FSDP's param dtype otherwise, and the gathered
weights are the whole weights' (FP8: one process's cast) bit for bit, after the fallback and the
resume. That job and the pipeline's set FSDP's param dtype to float32: BF16 arithmetic on a CPU
without AVX512-BF16 is tens of times slower than FP32 (the FSDP 2 x TP 2 jobs keep torchtitan's
bf16, and their gathers are checked in bf16).
Under FSDP 2 x TP 2 the sites are the torchao backend's (torchao's Float8Linear) in one launch,
and the torch backend's with lowprec's FP8 all-gather of tensor-parallel shards in another.

Under pipeline parallelism 2 (torchtitan's default looped schedule) each rank hosts its own
stages' sites, the controller every site; the NaN is planted on the rank that holds the site;
the LR probe and the final eval run through the pipeline schedule and agree with one process.

Three torchrun launches of 2 ranks (killed, then resumed; pipeline) and two of 4 ranks.
"""

from __future__ import annotations

import json
import math
from collections import Counter

import pytest

pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install 'lowprec[torchtitan]')")
pytest.importorskip("tokenizers")
pytest.importorskip("datasets")

from titan_helpers import TitanJob, fault  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.launches]

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
# within reach of an 8-step run, and MLflow tracking (with lowprec's telemetry; energy off: codecarbon's
# start costs ~11 s a launch here, and lowprec run's tests hold the energy figures)
FULL = PLAN.replace("  thresholds: {site_patience: 1}", """\
  thresholds: {site_patience: 1, large_warmup: 2, large_factor: 3.0}
  rewind: {enabled: true, snapshot_every: 2, keep: 3}
  lr_probe: {enabled: true, every_checks: 1}""").replace("tracking: {enabled: false}",
                                                        'tracking: {uri: "URI", experiment: titan, report: false}\n'
                                                        'telemetry: {energy: "off"}')
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


def _check_nan_fallback(reports: list[dict], log: str, pipelined: bool = False) -> list[tuple]:
    """Every rank decided alike: the planted site fell back at the NaN step, which was skipped.
    The decisions returned leave out in-loop gate events (an `eval:` section's)."""
    every = decisions(reports[0]["events"])
    want = [d for d in every if d[0] != "gate"]
    for r in reports:
        assert decisions(r["events"]) == every, f"rank {r['rank']} decided otherwise"
        assert r["formats"][SITE] == "bf16"
        assert {f for n, f in r["formats"].items() if n != SITE} == {"fp8_tensorwise"}   # the rest as promoted
        assert math.isnan(r["losses"][NAN_AT])
    # bisected by replays through torchtitan's forward and backward, then blamed, fallen back, skipped;
    # the attention stage promoted at the next check after two stable steps
    assert [d[:2] for d in want[:8]] == [("replay", NAN_AT)] * 5 + [("fallback", NAN_AT), ("skip_step", NAN_AT),
                                                                     ("promote", NAN_AT + 2)], want
    assert want[5][3] == (SITE,) and want[7][2] == "attn_fp8"
    assert f"lowprec: step {NAN_AT + 1} had a non-finite loss and was withheld" in log
    # torchtitan logged no metrics line for the withheld step (under a pipeline the first stage logs its -1)
    lines = [line for line in log.splitlines() if f"step: {NAN_AT + 1:2d}" in line]
    assert all("loss: -1.00000" in line for line in lines) if pipelined else not lines, lines
    return want


def _mlflow_run(uri: str):
    from mlflow.tracking import MlflowClient
    client = MlflowClient(uri)
    runs = client.search_runs([client.get_experiment_by_name("titan").experiment_id])
    assert len(runs) == 1, [r.info.run_id for r in runs]   # one run, written by rank 0
    return client, runs[0]


# the evals here check the plumbing, not the model: 8 documents a task (eval.limit; the in-loop gate's min_samples)
EVAL = "eval: {suite: default, every: 0, mode: fast, final_mode: fast, gates: inloop, high_precision: true, limit: 8}\n"


def _check_fp8_all_gather(reports: list[dict], resumed: bool = False, hp_bytes: int = 2) -> None:
    """Under lowprec's FP8 all-gather every forward of every site got what its format at that
    moment asks for: FP8 bytes while it ran tensor-wise FP8, its weight in FSDP's param dtype
    otherwise (SITE after its fallback, replays in high precision, the attention until its
    promotion), on every rank; each rank sent one byte per element of its shard into each FP8
    gather and `hp_bytes` (2: bf16, torchtitan's default param dtype; 4: float32) into each
    high-precision one; and at the kill or the end, each site's gathered weight is its whole
    weight's, bit for bit (FP8: one process's cast of it with the whole weight's scale; high
    precision: its values). `resumed`: a job resumed after SITE's fallback (high precision from its start)."""
    for r in reports:
        gathers, sent, check = r["gathers"], r["sent"], r["gather_check"]
        assert set(gathers) == set(r["formats"]) == set(sent), sorted(gathers)
        assert all(bad == 0 for _, _, bad in gathers.values()), gathers   # never the other mode
        assert all(fp8 > 0 for fqn, (fp8, _, _) in gathers.items() if "feed_forward" in fqn and fqn != SITE), gathers
        # FP8 until the fallback, bf16 after (a resumed job: bf16 only)
        assert (gathers[SITE][0] == 0 if resumed else gathers[SITE][0] > 0) and gathers[SITE][1] > 0, gathers[SITE]
        for fqn, modes in sent.items():   # bytes per dtype: FP8 one a weight element, BF16 two, FP32 four
            assert all(b == e * {"fp8": 1, "hp": hp_bytes}[m] and n > 0 for m, (n, b, e) in modes.items()), (fqn, modes)
            # sent as the forwards were handed (and as the check below gathered)
            assert ("fp8" in modes) == (gathers[fqn][0] > 0 or check[fqn][0] == "fp8"), (fqn, modes)
            assert ("hp" in modes) == (gathers[fqn][1] > 0), (fqn, modes)
        assert set(sent[SITE]) == ({"hp"} if resumed else {"fp8", "hp"}), sent[SITE]
        # each site's weight as FSDP2 gathers it (its unit unshard()ed) against its whole weight
        assert all(ok for _, ok in check.values()), check
        assert {m for m, _ in check.values()} == {"fp8", "hp"} and check[SITE][0] == "hp", check


def test_fsdp2_nan_on_one_rank_skip_rewind_probe_tracking_kill_resume_and_eval(tmp_path, gloo, free_port, rank_forks):
    """Under FSDP 2 with the torch backend and lowprec's FP8 all-gather (LowprecConverter.Config)."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"   # made by the job: a refused setting must leave none
    faults = [fault("nan", SITE, NAN_AT, NAN_AT + 1, rank=0), fault("loss_spike", "", SPIKE_AT, SPIKE_AT + 2, 100.0)]
    steps, plan = 10, FULL.replace("URI", uri).replace("backend: emulated", "backend: torch")
    # first a setting lowprec refuses (the default in-loop gate needs Milton, the shakespeare suite has none):
    # one line from rank 0, exit 2 on both ranks, no rank's traceback, before torchtitan builds anything
    # FSDP's param dtype float32: native BF16 arithmetic is slow on CPUs without AVX512-BF16 (the
    # FSDP 2 x TP 2 test below holds the bf16 gathers of torchtitan's default)
    job = TitanJob(tmp_path, plan + "eval: {suite: shakespeare, every: 0}\n", steps=steps + 2, checkpoint_every=5,
                   faults=faults, validator=True, kill_at=steps + 1, param_dtype="float32")
    proc = job.run(rank_forks, 2, free_port())
    log = proc.stdout + proc.stderr
    assert proc.returncode != 0 and log.count("lowprec: eval.gates: 'inloop' gates") == 1, log[-6000:]
    assert "Fix: a suite with that task" in log and "ConfigError" not in log and "exitcode  : 2" in log, log[-6000:]
    assert "dp_shard=2" not in log and not (tmp_path / "mlflow.db").exists()   # no mesh built, no store
    job.update(plan=plan, fp8_all_gather=True)
    proc = job.run(rank_forks, 2, free_port(), timeout=600)   # (a hang's net; on a shared 2-core machine ~4-5 min)
    log = proc.stdout + proc.stderr
    assert "lowprec: tracking into MLflow run" in log, log[-6000:]   # rank 0 names the run
    assert proc.returncode != 0 and "SIGKILL" in log, log[-6000:]   # rank 0 died after step 11
    assert "dp_shard=2, cp=1, tp=1" in log   # torchtitan's mesh: FSDP 2
    first = job.reports(2)   # as of the step-10 checkpoint
    _check_fp8_all_gather(first, hp_bytes=4)
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
    assert run.info.status == "RUNNING"   # killed
    metrics = run.data.metrics
    assert "train/loss" in metrics and "train/rewound_to" in metrics
    # lowprec's telemetry, as under `lowprec run`: each step's phases and throughput, MLflow's system metrics
    assert {"time/data_s", "time/forward_s", "time/backward_s", "time/optimizer_s", "time/recovery_s",
            "throughput/tokens_per_s"} <= set(metrics), sorted(metrics)
    assert "system/system_memory_usage_megabytes" in metrics and "system/cpu_utilization_percentage" in metrics
    assert math.isfinite(metrics["train/lr_sensitivity"])   # the LR probe ran, on torchtitan's validation batch

    # resumed by torchtitan from its step-10 checkpoint (plain high-precision shards), FP8 all-gather on,
    # no faults, an eval at the end
    job.update(plan=plan + EVAL, kill_at=-1, faults=[])
    log = _ok(job.run(rank_forks, 2, free_port(), timeout=600))
    assert f"Loading the checkpoint from {job.dump / 'checkpoint' / f'step-{steps}'}" in log
    assert f"lowprec: continuing MLflow run {run.info.run_id}" in log, log[-6000:]
    assert "lowprec: rollout restored from torchtitan's checkpoint" in log and f"MLflow run {run.info.run_id} continues" in log
    last = job.reports(2)
    _check_fp8_all_gather(last, resumed=True, hp_bytes=4)
    killed = json.loads((job.dump / "killed_step.json").read_text())   # rank 0's step 11 before the kill
    for before, after in zip(first, last):
        assert after["restored"] and after["step"] == before["step"] + 2 and after["rewinds"] == 1
        assert after["formats"][SITE] == "bf16"               # the fallback came back with the checkpoint
        assert after["events"][:len(before["events"])] == before["events"]
        a, b = after["losses"][:len(before["losses"])], before["losses"]
        assert all(x == y or (x != x and y != y) for x, y in zip(a, b)), (a, b)
        # the step trained again after the resume is the killed job's, bit for bit (the FP8 gathers' scales
        # taken again from the loaded weights)
        redone = (after["losses"][killed["step"] - 1], after["grad_norms"][killed["step"] - 1])
        assert redone == (killed["loss"], killed["grad_norm"]), (redone, killed)
    _check_one_run_continued(client, uri, run.info.run_id, job, last[0])
    _check_final_eval_on_both_ranks(client, run.info.run_id, last)


def _check_one_run_continued(client, uri: str, run_id: str, job, lead: dict) -> None:
    """The resumed job went on in the killed job's MLflow run: each (key, step) once, and each
    event once. Metrics are at torchtitan's step, which a rewind does not take back: the steps
    lowprec redid are new steps there (`train/lowprec_step` holds lowprec's count, once a step)."""
    _, run = _mlflow_run(uri)
    assert run.info.run_id == run_id and run.info.status == "FINISHED"
    for key in run.data.metrics:
        counts = Counter(m.step for m in client.get_metric_history(run_id, key))
        assert all(n == 1 for n in counts.values()), (key, counts)
    # train/loss at every torchtitan step but the rewind's, which logs train/loss_rewound instead
    rewind = [m.step for m in client.get_metric_history(run_id, "train/rewound_to")]
    losses = Counter(m.step for m in client.get_metric_history(run_id, "train/loss"))
    assert losses == Counter(s for s in range(1, lead["titan_step"] + 1) if s not in rewind), (losses, rewind)
    # the step's time and throughput with its training metrics; the job's telemetry/* numbers once, at its end
    for key in ("time/window_s", "time/forward_s", "throughput/tokens_per_s"):
        assert Counter(m.step for m in client.get_metric_history(run_id, key)) == losses, key
    final = {k: v for k, v in run.data.metrics.items() if k.startswith("telemetry/")}
    assert final["telemetry/tokens_per_s"] > 0 and final["telemetry/phase/forward_s"] > 0, final
    assert final["telemetry/bucket/checkpoint_s"] > 0 and final["telemetry/bucket/eval_s"] > 0, final
    assert [m.step for m in client.get_metric_history(run_id, "telemetry/wall_s")] == [lead["titan_step"]]
    buffer = json.loads((job.dump / "lowprec" / "tracking.json").read_text())["buffer"]
    tracked = (job.dump / "lowprec" / buffer / "events.jsonl").read_text().splitlines()
    # tracked at torchtitan's step; lowprec's is one less, or in the evidence where a rewind made them differ
    own = [json.loads(x)["evidence"].get("lowprec_step", json.loads(x)["step"] - 1) for x in tracked]
    sent = [(k, s, stage, sites) for (k, _, stage, sites), s in zip(decisions(tracked), own)]
    assert sent == decisions(lead["events"]), sent   # every event of the job once, none twice
    assert decisions((job.tmp / "events.jsonl").read_text().splitlines()) == sent   # rank 0's event log too


def _check_final_eval_on_both_ranks(client, run_id: str, reports: list[dict]) -> None:
    """Both ranks ran the final eval; rank 1 holds rank 0's outcome (lm-eval's results are rank 0's)."""
    evals = [[{k: v for k, v in e.items() if k != "seconds"} for e in r["evals"]] for r in reports]   # each its own time
    assert len(evals[0]) == 1 and evals[0][0]["verdict"] == "pass", evals[0]
    assert evals[1] == evals[0]
    logged = client.get_run(run_id).data.metrics
    assert any(k.startswith("eval/heldout_shakespeare/") for k in logged), sorted(logged)
    assert any(k.startswith("eval_hp/heldout_shakespeare/") for k in logged), sorted(logged)


def test_fsdp2_x_tp2_torchao_backend_nan_on_one_rank_falls_back_on_every_rank(tmp_path, gloo, free_port, rank_forks):
    """The torchao backend's sites (torchao's Float8Linear, emulated on CPU) as torchtitan Modules,
    on tensor-parallel shards under FSDP 2 x TP 2."""
    pytest.importorskip("torchao")
    job = TitanJob(tmp_path, PLAN.replace("backend: emulated", "backend: torchao"), steps=STEPS,
                   checkpoint_every=STEPS, faults=[fault("nan", SITE, NAN_AT, NAN_AT + 1, rank=0)])
    log = _ok(job.run(rank_forks, 4, free_port(), "--parallelism.tensor_parallel_degree", "2"))
    assert "dp_shard=2, cp=1, tp=2" in log   # torchtitan's mesh: FSDP 2 x TP 2
    reports = job.reports(4)
    want = _check_nan_fallback(reports, log)
    assert len(want) == 8
    for r in reports:
        assert r["skipped"] == 1 and r["step"] == STEPS and r["titan_step"] == STEPS
        assert all(math.isfinite(v) for i, v in enumerate(r["losses"]) if i != NAN_AT)


def test_fsdp2_x_tp2_fp8_all_gather_nan_on_one_rank_falls_back_to_bf16_gathers(tmp_path, gloo, free_port, rank_forks):
    """lowprec's FP8 all-gather on tensor-parallel shards under FSDP 2 x TP 2 (the torch backend's
    sites; their weights DTensors sharded over dp and tp): every FP8 site's weight gathered as FP8
    bytes on every rank, SITE's as bf16 from its fallback on, and each gathered weight the whole
    weight's bit for bit. Column-wise TP weights (wqkv, w1, w3) are sharded over dp as
    `_StridedShard`, which c13c165 left out of the amax all-reduce: each dp rank cast with its
    own scale, and their gathered bytes were no one process's cast."""
    job = TitanJob(tmp_path, PLAN.replace("backend: emulated", "backend: torch"), steps=STEPS,
                   checkpoint_every=STEPS, faults=[fault("nan", SITE, NAN_AT, NAN_AT + 1, rank=0)], fp8_all_gather=True)
    log = _ok(job.run(rank_forks, 4, free_port(), "--parallelism.tensor_parallel_degree", "2"))
    assert "dp_shard=2, cp=1, tp=2" in log   # torchtitan's mesh: FSDP 2 x TP 2
    reports = job.reports(4)
    assert len(_check_nan_fallback(reports, log)) == 8
    _check_fp8_all_gather(reports)
    for r in reports:
        assert r["skipped"] == 1 and r["step"] == STEPS and r["losses"] == reports[0]["losses"]


# evals before the promotion and at the end, one pass each (their forwards are pipeline steps: the cost)
PP_EVAL = "eval: {suite: shakespeare, every: 0, mode: fast, final_mode: fast, gates: null, high_precision: false, limit: 8}\n"
PP_SITE_RANK = 1   # torchtitan's default Interleaved1F1B, 2 ranks: 4 stages, layers.1 in stage 1 on rank 1


def test_pipeline_2_stages_nan_skip_rewind_probe_and_eval(tmp_path, gloo, free_port, rank_forks, sqlite_store):
    """Pipeline parallelism 2 (torchtitan's default looped schedule: two stages per rank, each a model
    part): every rank sees the last stage's loss, the NaN planted on the rank whose stage holds SITE
    is bisected by replays through torchtitan's pipeline schedule and that site falls back there
    (every rank's controller records it); the logits spike is skipped and rewound (each rank's own
    stages' parameters and optimizer state); rank 0 tracks every stage's precision map, and would
    without a controller (`lowprec.runtime.session.tracked_map`). The LR probe
    (at every check) and the final eval run as steps of the pipeline schedule on both ranks: each
    rank has the same eval outcome, probe result and eval logits, equal to the whole model's in one
    process (`_check_against_one_process`)."""
    uri = sqlite_store(tmp_path)   # a migrated store (a copy): no schema migration in the job
    plan = FULL.replace("URI", uri) + PP_EVAL
    steps = 10
    job = TitanJob(tmp_path, plan, steps=steps, checkpoint_every=steps, validator=True, reference=True, param_dtype="float32",
                   faults=[fault("nan", SITE, NAN_AT, NAN_AT + 1, rank=PP_SITE_RANK),
                           fault("loss_spike", "", SPIKE_AT, SPIKE_AT + 2, 100.0)])
    # micro-batches of 4 rows (8 a step): an eval batch of 32 rows is 4 schedule steps, not 16
    log = _ok(job.run(rank_forks, 2, free_port(), "--parallelism.pipeline_parallel_degree", "2",
                      "--training.local_batch_size", "8", "--parallelism.pipeline_parallel_microbatch_size", "4"))
    assert "pp=2" in log and "with 2 microbatches and 4 stages" in log   # torchtitan's pipeline, 2 stages per rank
    reports = job.reports(2)
    want = _check_nan_fallback(reports, log, pipelined=True)
    assert [d[:2] for d in want[8:13]] == [("replay", SPIKE_AT), ("skip_step", SPIKE_AT), ("replay", SPIKE_AT + 1),
                                           ("skip_step", SPIKE_AT + 1), ("rewind", SPIKE_AT + 1)], want
    local = [set(r["local"]) for r in reports]
    assert SITE in local[PP_SITE_RANK] and not local[0] & local[1]   # each site on one rank
    assert local[0] | local[1] == set(reports[0]["formats"])          # together every site of the model
    for r in reports:
        assert r["rewinds"] == 1 and r["titan_step"] == steps and r["skipped"] == 2   # NaN, spike; then the rewind
        assert r["step"] == 4 + (steps - SPIKE_AT - 2) and len(r["losses"]) == r["step"]
        assert r["losses"] == reports[0]["losses"]   # the last stage's loss on every rank
    # rank 0 tracks the whole model's precision map: SITE's BF16 share, though SITE is rank 1's
    client, run = _mlflow_run(uri)
    shares = {k.rsplit("/", 1)[1]: v for k, v in run.data.metrics.items() if k.startswith("precision/flops_share/")}
    # BF16: SITE after its fallback plus the kept output layer (a GEMM that is no site counts as what it
    # runs in, issue 53): 12.8% here, against 87.2% FP8
    assert 0.1 < shares["bf16"] < 0.2 and shares["bf16"] + shares["fp8_tensorwise"] == pytest.approx(1), shares
    # without a controller too (the plan as it is: a HostedRollout of the plan without `rollout:` over the
    # stages as they ended): every stage's sites, as the ranks holding them run them, SITE's fallback on
    # rank 1 included, though rank 0's copy of rank 1's layers never heard of it
    for r in reports:
        plain = r["without_controller"]
        assert plain["formats"] == reports[0]["formats"] and plain["formats"][SITE] == "bf16", plain
        assert plain["flops_share"] == pytest.approx(shares), (plain["flops_share"], shares)
    assert reports[0]["without_controller"]["whole_copy"][SITE] == "fp8_tensorwise"
    assert math.isfinite(run.data.metrics["train/lr_sensitivity"])   # the LR probe ran through the schedule
    evals = [[{k: v for k, v in e.items() if k != "seconds"} for e in r["evals"]] for r in reports]
    # before the promotion and at the end, each the same on both ranks
    assert [e["step"] for e in evals[0]] == [NAN_AT + 2, reports[0]["step"]] and evals[1] == evals[0], evals
    assert any(k.startswith("eval/heldout_shakespeare/") for k in run.data.metrics), sorted(run.data.metrics)
    _check_against_one_process(job)


def _check_against_one_process(job) -> None:
    """Under the pipeline both ranks got the same eval logits (3 rows of 40 tokens: padded to one
    schedule step of two [4, 64] micro-batches), LR probe result and held loss, and these equal the
    whole model's in one process, run on the same micro-batches with the run's formats. The bound:
    the same ops on the same inputs, split across stages (measured: identical bits)."""
    import torch
    ranks = [torch.load(job.dump / f"forwards_rank{r}.pt") for r in range(2)]
    assert torch.equal(ranks[0]["logits"], ranks[1]["logits"]) and ranks[0]["logits"].shape[:2] == (3, 40)
    assert ranks[0]["probe"] == ranks[1]["probe"] and math.isfinite(ranks[0]["probe"][-1])
    assert torch.equal(ranks[0]["held_loss"], ranks[1]["held_loss"])
    for r in ranks:
        d = (r["logits"] - r["logits_one_process"]).abs().max().item()
        h = (r["held_loss"].reshape(()) - r["held_loss_one_process"].float()).abs().item()
        assert d <= 1e-5 and h <= 1e-5, (d, h, r["held_loss"], r["held_loss_one_process"])
