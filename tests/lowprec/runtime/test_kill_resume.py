"""A kill-and-resume campaign (issue 12, "What it must show"): `lowprec run` killed with SIGKILL
at N = 20 random moments, each followed by `lowprec run CONFIG --out DIR --resume`, ends as an
uninterrupted run does: losses.json equal bit for bit, one MLflow run (the same id throughout)
that is FINISHED, every `train/loss` step in its metric history exactly once, every event once
in events.jsonl and in MLflow.

The moments (seeded) are chosen three ways: a wall-time offset after the process starts, a
checkpoint being written (a `*.tmp` in the checkpoint folder), an eval checkpoint running
(the step before it logged), and the tracker's journal growing (`outbox.jsonl`) or being sent
(`outbox.ack` changing). The run is tiny (48 steps,
a checkpoint every 3 steps, a rollout stage promoted at step 7, lm-eval evals of the
`shakespeare` suite in fast mode at steps 16, 32 and 48); its steps sleep a quarter second
each while the file `slow` exists (during the kills, not in the reference run or the last
resume; the numbers do not depend on it). evals.jsonl and the eval metrics are checked too, and
the eval history the newest checkpoint carries (the damage check's previous checkpoint, the
pictures' evals) is the uninterrupted run's (issue 54: a resumed run started it afresh).

Every `lowprec run` here (the reference, the 20 lives, the last resume) is forked from one
process that has imported lowprec, MLflow and lm-eval (tests/cli_forks.py, the session's
`lowprec_forks`): each is still a process of its own, SIGKILLed, running the same `main` with the
same arguments, without paying the imports 22 times.
"""

from __future__ import annotations

import json
import random
import signal
import sys
import time
from pathlib import Path

import pytest
import yaml

from cli_forks import CliForks, Forked
from lowprec.policy.events import EventKind

N_KILLS = 20
STEPS = 48
SEED = 12
EVAL_AFTER = (15, 31, STEPS - 1)   # the steps after which an eval runs (eval.every 16, the final one)

def _config(uri: str, experiment: str, slow_while: str | None = None, eval_slow_while: str | None = None) -> dict:
    return {
        "model": {"factory": "killlm:build", "args": {"vocab": 256, "width": 32, "step_seconds": 0.25,
                                                      "slow_while": slow_while, "eval_seconds": 0.1,
                                                      "eval_slow_while": eval_slow_while}},
        "data": {"factory": "killlm:tokens", "args": {"vocab": 256, "seed": 0}, "block_size": 16},
        "train": {"steps": STEPS, "batch_size": 4, "warmup": 2, "ckpt_every": 3, "log_every": 2},
        "precision": {"backend": "emulated", "default": "bf16", "keep_high_precision": [{"fqns": ["head"]}],
                      "rules": [{"name": "mlp", "select": {"fqns": ["up", "down"]}, "format": "bf16",
                                 "ladder": ["fp8_tensorwise", "bf16"]}]},
        "rollout": {"check_every": 4, "min_steps": 4,
                    "stages": [{"name": "mlp", "select": {"fqns": ["up", "down"]}, "format": "fp8_tensorwise"}]},
        "eval": {"suite": "shakespeare", "every": 16, "mode": "fast", "final_mode": "fast", "gates": None,
                 "high_precision": False, "batch_size": 8, "limit": 8},
        "tracking": {"uri": uri, "experiment": experiment, "run_name": "k", "report": False},
        # no energy meter: on a CPU it is codecarbon's estimate, whose start takes ~1.2 s of every
        # life (before its first step) and which no assertion here reads
        "telemetry": {"energy": "off"},
    }


def _start(forks: CliForks, cwd: Path, out: str, resume: bool) -> Forked:
    """`lowprec run run.yaml --out OUT [--resume]` in `cwd`, forked from `forks`."""
    return forks.start(["run", "run.yaml", "--out", out] + (["--resume"] if resume else []), cwd)


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except FileNotFoundError:
        return -1


def _mtime(p: Path) -> int:
    try:
        return p.stat().st_mtime_ns
    except FileNotFoundError:
        return -1


def _kill_at(p: Forked, out: Path, how: str, rng: random.Random, give_up: float) -> bool:
    """Wait for the moment `how` names, SIGKILL the process; False when it ended first."""
    ckpts, journal, ack = out / "checkpoints", out / "tracking" / "outbox.jsonl", out / "tracking" / "outbox.ack"
    t0, started, alive = time.monotonic(), None, None
    offset = rng.uniform(0.0, 1.2)   # after the process first writes to its journal (start-up done)
    skip = rng.randrange(0, 2 if how == "ack" else 3)   # let a few such moments pass first
    size, stamp = _size(journal), _mtime(ack)
    first, writing = size, set()
    while p.poll() is None:
        now = time.monotonic() - t0
        if how == "time":
            if started is None and _size(journal) != first:
                started = now
            hit = started is not None and now >= started + offset
        elif how == "checkpoint":   # a checkpoint being written (each write counted once)
            tmps = {q.name for q in ckpts.iterdir() if q.name.endswith(".tmp")} if ckpts.is_dir() else set()
            hit, writing = bool(tmps - writing), tmps
        elif how == "journal":
            hit = (s := _size(journal)) != size
            size = s
        elif how == "eval":   # the step before an eval checkpoint is logged: the eval runs now
            if alive is None and _size(journal) != first:
                alive = now
            if started is None and alive is not None and _last_loss_step(journal) in EVAL_AFTER:
                started = now
            # no eval within two seconds: a plain moment (so that one life does not run far)
            hit = now >= started + offset / 3 if started is not None else alive is not None and now > alive + 2
        else:   # "ack": the outbox was sent to the store
            hit = (m := _mtime(ack)) != stamp
            stamp = m
        if hit and skip > 0:
            skip -= 1
            hit = False
        if hit or now > give_up:
            p.send_signal(signal.SIGKILL)
            p.communicate(timeout=60)
            return True
        time.sleep({"checkpoint": 0.0005, "eval": 0.02}.get(how, 0.002))
    return False


def _last_loss_step(journal: Path) -> int:
    try:
        lines = journal.read_bytes().splitlines()[-6:]
    except FileNotFoundError:
        return -1
    steps = [m[3] for x in lines if x.endswith(b"}") for m in json.loads(x).get("metrics", ()) if m[0] == "train/loss"]
    return steps[-1] if steps else -1


def _finish(p: Forked) -> None:
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr[-3000:]


def _progress(out: Path) -> str:
    """Where the run was when killed: newest checkpoint, last journaled train/loss step."""
    ckpts = sorted(q.name for q in (out / "checkpoints").glob("step_*")) if (out / "checkpoints").is_dir() else []
    journal = out / "tracking" / "outbox.jsonl"
    steps = [m[3] for x in (journal.read_text().splitlines() if journal.exists() else []) if x.endswith("}")
             for m in json.loads(x).get("metrics", []) if m[0] == "train/loss"]
    return f"{ckpts[-1] if ckpts else '-'} loss@{max(steps, default=-1)}"


def _ended(p: Forked) -> None:
    """The last `--resume`: it trains to the end, or finds the run finished (killed after its
    end was sent: refused, exit 2, nothing written)."""
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0 or (p.returncode == 2 and "which finished" in stderr), stderr[-3000:]


def _eval_history(run: Path) -> list[dict]:
    """The evals so far in `run`'s newest checkpoint (their times left out: they are the machine's)."""
    from lowprec.state.checkpoint import list_checkpoints, verify_checkpoint
    _, newest = list_checkpoints(run / "checkpoints")[-1]
    history = verify_checkpoint(newest)["extra"]["evals"]["history"]
    return [{k: v for k, v in h.items() if k != "seconds"} for h in history]


def _events_jsonl(out: Path) -> list[tuple]:
    rows = [json.loads(x) for x in (out / "events.jsonl").read_text().splitlines() if x.strip()]
    return [(r["step"], r["kind"], tuple(r.get("sites", ())), r.get("stage")) for r in rows]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, sqlite_store, tiny_lm, lowprec_forks):
    """The folder with run.yaml (tracked in its own store; its steps slow while the file `slow`
    exists, its logits calls while `eval_slow` exists) and `ref`, the run trained once without
    interruption, at full speed."""
    root = tmp_path_factory.mktemp("kill_resume")
    uri = sqlite_store(root / "store")
    tiny_lm(root, "killlm")
    (root / "run.yaml").write_text(yaml.safe_dump(_config(uri, "kill", slow_while=str(root / "slow"),
                                                          eval_slow_while=str(root / "eval_slow"))))
    _finish(_start(lowprec_forks, root, "ref", resume=False))
    assert any(e[1] == EventKind.PROMOTE for e in _events_jsonl(root / "ref")), "the rollout must promote a stage"
    return root, uri


@pytest.mark.slow   # 22 `lowprec run` processes, about a minute
def test_lowprec_run_killed_at_random_moments_ends_as_an_uninterrupted_run(uninterrupted, lowprec_forks):
    from mlflow.tracking import MlflowClient
    tmp_path, uri = uninterrupted
    slow = tmp_path / "slow"   # steps sleep while it exists: only while the process may be killed
    ref = tmp_path / "ref"

    out, rng = tmp_path / "out", random.Random(SEED)
    kinds = ["time", "checkpoint", "journal", "ack", "eval"]
    kills, resume, log = 0, False, []
    slow.touch()
    while kills < N_KILLS:
        how = kinds[kills % len(kinds)] if kills < len(kinds) else rng.choice(kinds)
        p = _start(lowprec_forks, tmp_path, "out", resume)
        if not _kill_at(p, out, how, rng, give_up=15.0):
            _ended(p)
            break   # it finished before the moment came
        kills, resume = kills + 1, True
        log.append((how, _progress(out)))
    else:
        slow.unlink()   # nothing left to kill
        _ended(_start(lowprec_forks, tmp_path, "out", resume=True))
    print("kills:", *log, sep="\n  ")
    assert kills >= N_KILLS * 3 // 4, log   # all of them, unless the run ended first

    assert (out / "losses.json").read_bytes() == (ref / "losses.json").read_bytes()
    assert (out / "grad_norms.json").read_bytes() == (ref / "grad_norms.json").read_bytes()
    summary, ref_summary = (json.loads((d / "summary.json").read_text()) for d in (out, ref))
    # site_paths' call counts persist in the checkpoints: the killed run's are the whole run's
    assert summary["site_paths"] == ref_summary["site_paths"] and summary["site_paths"], log
    assert {**summary, "seconds_per_step": 0} == {**ref_summary, "seconds_per_step": 0}, log
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("kill")
    runs = {r.info.run_id: r for r in client.search_runs([exp.experiment_id])}
    ref_id = (ref / "run_id").read_text().strip()
    run_id = json.loads((out / "tracking" / "run.json").read_text())["run_id"]
    assert set(runs) == {ref_id, run_id}, "one MLflow run for the killed run, the same id throughout"
    if (out / "run_id").exists():   # absent when killed after the run ended, before it was written
        assert (out / "run_id").read_text().strip() == run_id
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    for key in ("train/loss", "train/loss_last", "train/grad_norm", "eval/heldout_shakespeare/bits_per_byte"):
        steps = [m.step for m in client.get_metric_history(run_id, key)]
        ref_steps = [m.step for m in client.get_metric_history(ref_id, key)]
        assert sorted(steps) == sorted(ref_steps) and len(set(steps)) == len(steps), (key, log)
        vals = {m.step: m.value for m in client.get_metric_history(run_id, key)}
        assert vals == {m.step: m.value for m in client.get_metric_history(ref_id, key)}, (key, log)
    events = _events_jsonl(out)
    assert events == _events_jsonl(ref), log
    assert len(set(events)) == len(events)
    evals = Path(client.download_artifacts(run_id, "evals.jsonl", str(tmp_path / "dl")))
    ref_evals = Path(client.download_artifacts(ref_id, "evals.jsonl", str(tmp_path / "dl_ref")))
    assert [json.loads(x)["step"] for x in evals.read_text().splitlines()] == \
        [json.loads(x)["step"] for x in ref_evals.read_text().splitlines()] == [16, 32, STEPS], log
    key = "eval/heldout_shakespeare/bits_per_byte"
    assert sorted(m.step for m in client.get_metric_history(run_id, key)) == [16, 32, STEPS], log
    mlflow_events = Path(client.download_artifacts(run_id, "events.jsonl", str(tmp_path / "dl")))
    assert _events_jsonl(mlflow_events.parent) == events, log
    # the precision map over time, as sent: the uninterrupted run's (no revert from a resume's start)
    pmap, ref_pmap = (json.loads(Path(client.download_artifacts(i, "precision_map.json", str(tmp_path / d))).read_text())
                      for i, d in ((run_id, "dl"), (ref_id, "dl_ref")))
    assert pmap == ref_pmap and pmap["changes"], (pmap, ref_pmap, log)
    history = _eval_history(out)
    assert [h["step"] for h in history] == [16, 32] and history == _eval_history(ref), log


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_a_signal_stops_the_run_at_a_step_with_a_checkpoint_and_the_resume_ends_as_an_uninterrupted_run(
        uninterrupted, lowprec_forks, sig):
    """Ctrl-C or a scheduler's SIGTERM: the run stops at the next step with a checkpoint there,
    one line and no traceback, exit 128 + the signal, the MLflow run KILLED with the reason; the
    `--resume` ends bit for bit as the run never stopped (before, Ctrl-C printed a traceback, SIGTERM
    ended the process at once, and both lost the steps since the last periodic checkpoint)."""
    from mlflow.tracking import MlflowClient
    root, uri = uninterrupted
    name = f"stopped_{sig.name}"
    slow = root / "slow"
    slow.touch()
    p = _start(lowprec_forks, root, name, resume=False)
    journal = root / name / "tracking" / "outbox.jsonl"
    deadline = time.monotonic() + 120
    while _last_loss_step(journal) < 8:   # past start-up and a few (slowed) steps
        assert p.poll() is None and time.monotonic() < deadline, "the run ended before the signal"
        time.sleep(0.02)
    p.send_signal(sig)
    stdout, stderr = p.communicate(timeout=120)
    slow.unlink()
    assert p.returncode == 128 + sig, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    said = [line for line in stderr.splitlines() if "stopped by" in line]
    assert len(said) == 1 and f"stopped by {sig.name} at step " in said[0], stderr[-3000:]
    step = int(said[0].split(" at step ")[1].split(",")[0])
    assert f"--out {name} --resume`" in said[0] and step > 8, said
    assert (root / name / "checkpoints" / f"step_{step:08d}.pt").is_file(), sorted((root / name / "checkpoints").iterdir())
    assert not (root / name / "summary.json").exists()   # no final eval, no summary: it did not finish
    client = MlflowClient(uri)
    run_id = json.loads((root / name / "tracking" / "run.json").read_text())["run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and sig.name in run.data.tags["lowprec.stopped"], run.data.tags

    _finish(_start(lowprec_forks, root, name, resume=True))
    out, ref = root / name, root / "ref"
    assert (out / "losses.json").read_bytes() == (ref / "losses.json").read_bytes()
    assert (out / "grad_norms.json").read_bytes() == (ref / "grad_norms.json").read_bytes()
    assert client.get_run(run_id).info.status == "FINISHED"
    ref_id = (ref / "run_id").read_text().strip()
    logged = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert logged == {m.step: m.value for m in client.get_metric_history(ref_id, "train/loss")}
    assert len(client.get_metric_history(run_id, "train/loss")) == len(logged)   # each step once


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_with_one_line_and_the_resume_ends_as_an_uninterrupted_run(
        uninterrupted, lowprec_forks):
    root, _ = uninterrupted
    slow = root / "slow"
    slow.touch()
    p = _start(lowprec_forks, root, "twice", resume=False)
    deadline = time.monotonic() + 120
    while _last_loss_step(root / "twice" / "tracking" / "outbox.jsonl") < 8:
        assert p.poll() is None and time.monotonic() < deadline, "the run ended before the signal"
        time.sleep(0.02)
    p.send_signal(signal.SIGINT)
    time.sleep(0.02)   # inside the slowed step (a quarter second): before the step boundary
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=120)
    slow.unlink()
    assert p.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    assert stderr.rstrip().splitlines()[-1] == ("lowprec run: stopped at once by Ctrl-C; `--resume` continues from "
                                                "the newest checkpoint"), stderr[-3000:]
    _finish(_start(lowprec_forks, root, "twice", resume=True))
    assert (root / "twice" / "losses.json").read_bytes() == (root / "ref" / "losses.json").read_bytes()


@pytest.mark.slow
def test_a_signal_in_the_final_eval_stops_at_once_and_the_resume_redoes_only_that_eval(uninterrupted, lowprec_forks):
    """The last step writes a checkpoint (the trained weights) before the final eval; Ctrl-C during
    that eval stopped nothing until it ended (the run then FINISHED, exit 0). Now it stops at once:
    exit 130, the MLflow run KILLED at the last step, and `--resume` runs only the final eval, whose
    numbers are the uninterrupted run's, logged once."""
    from mlflow.tracking import MlflowClient
    root, uri = uninterrupted
    name, slow = "stopped_in_eval", root / "eval_slow"
    slow.touch()   # each logits call sleeps: the final eval lasts seconds
    p = _start(lowprec_forks, root, name, resume=False)
    last = root / name / "checkpoints" / f"step_{STEPS:08d}.pt"
    deadline = time.monotonic() + 120
    while not last.is_file():
        assert p.poll() is None and time.monotonic() < deadline, "the run ended before its last checkpoint"
        time.sleep(0.02)
    time.sleep(0.5)   # inside the final eval
    assert p.poll() is None, "the final eval ended before the signal"
    p.send_signal(signal.SIGINT)
    stdout, stderr = p.communicate(timeout=60)
    slow.unlink()
    assert p.returncode == 130 and "Traceback" not in stderr, stderr[-3000:]
    assert "SIGINT: stopping now, during the final eval; --resume redoes it" in stderr, stderr[-3000:]
    assert f"stopped by SIGINT at step {STEPS}, with a checkpoint there" in stderr.splitlines()[-1], stderr[-3000:]
    assert not (root / name / "summary.json").exists()
    client = MlflowClient(uri)
    run_id = json.loads((root / name / "tracking" / "run.json").read_text())["run_id"]
    run = client.get_run(run_id)
    assert run.info.status == "KILLED" and run.data.tags["lowprec.stopped"].startswith(f"SIGINT at step {STEPS}")

    p = _start(lowprec_forks, root, name, resume=True)
    stdout, stderr = p.communicate(timeout=300)
    assert p.returncode == 0, stderr[-3000:]
    assert "(nothing left to train: the final eval only)" in stdout + stderr
    out, ref = root / name, root / "ref"
    assert (out / "losses.json").read_bytes() == (ref / "losses.json").read_bytes()
    summary, ref_summary = (json.loads((d / "summary.json").read_text()) for d in (out, ref))
    assert summary["final_eval"]["step"] == STEPS and summary["formats"] and summary["seconds_per_step"] == 0.0
    # the precision map at the end as loaded (no step ran to record it), the final eval the uninterrupted run's
    assert {**summary, "seconds_per_step": 0} == {**ref_summary, "seconds_per_step": 0}
    assert "none trained in this process" in stdout, stdout
    assert client.get_run(run_id).info.status == "FINISHED"
    # the speed is the stopped life's, which trained the steps (the resumed one measured none: it logs none)
    speed = client.get_metric_history(run_id, "telemetry/tokens_per_s")
    assert len(speed) == 1 and speed[0].value > 0 and speed[0].step == STEPS, speed
    key = "eval/heldout_shakespeare/bits_per_byte"
    ref_id = (ref / "run_id").read_text().strip()
    assert [(m.step, m.value) for m in sorted(client.get_metric_history(run_id, key), key=lambda m: m.step)] == \
        [(m.step, m.value) for m in sorted(client.get_metric_history(ref_id, key), key=lambda m: m.step)]


def test_a_signal_before_training_began_trains_and_tracks_nothing(tmp_path, sqlite_store, tiny_lm, capsys):
    from lowprec.config import LowprecConfig
    from lowprec.runtime.trainer.run import prepare_run, train_prepared
    from lowprec.runtime.trainer.stop_request import StopRequest
    uri = sqlite_store(tmp_path / "store")
    tiny_lm(tmp_path, "killlm")
    sys.path.insert(0, str(tmp_path))
    try:
        cfg = _config(uri, "early")
        cfg.pop("eval")
        prepared = prepare_run(LowprecConfig.from_dict(cfg))
    finally:
        sys.path.remove(str(tmp_path))
    stop = StopRequest()
    stop.requested = signal.SIGTERM   # as its handler sets it, while the model was being built
    assert train_prepared(prepared, tmp_path / "out", name="early", stop=stop, config_path="run.yaml") == 143
    assert capsys.readouterr().err == ("lowprec run: stopped by SIGTERM before training began: nothing was trained or "
                                       "tracked (exit 143)\n")
    assert not (tmp_path / "out").exists()
    from mlflow.tracking import MlflowClient
    assert MlflowClient(uri).get_experiment_by_name("early") is None


# ------------------------------------------------------------------ what the campaign found, on its own
DEAD = "http://127.0.0.1:9"   # nothing listens: records stay in the journal
FAST = dict(flush_interval_s=0.2, retry_max_s=1.0, probe_timeout_s=0.5)


def test_resume_sends_a_finished_run_whose_end_was_not_sent(tmp_path, sqlite_store, capsys):
    """Killed after the run's end was journaled, before it was sent: the MLflow run said RUNNING
    and `--resume` refused the finished run, so nothing could close it. Now `--resume` sends it."""
    from mlflow.tracking import MlflowClient
    from lowprec.cli import main
    from lowprec.tracking.tracker import Tracker
    uri = sqlite_store(tmp_path / "store")
    out = tmp_path / "out"
    t = Tracker(DEAD, "kill", "k", buffer_dir=out / "tracking", **FAST)
    for s in range(3):
        t.log_metrics(s, {"train/loss": float(s)})
    assert t.finish("FINISHED", timeout=0.5, report=False)["pending"] > 0   # journaled, not sent
    cfg = _config(DEAD, "kill")
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(cfg))
    assert main(["run", str(tmp_path / "run.yaml"), "--out", str(out), "--resume"]) == 2   # still no server
    assert "were not sent" in capsys.readouterr().err and not (out / "run_id").exists()

    info = json.loads((out / "tracking" / "run.json").read_text())   # the server is back, at another address
    (out / "tracking" / "run.json").write_text(json.dumps({**info, "tracking_uri": uri}))
    (tmp_path / "run.yaml").write_text(yaml.safe_dump(_config(uri, "kill")))
    assert main(["run", str(tmp_path / "run.yaml"), "--out", str(out), "--resume"]) == 0
    assert "nothing was trained" in capsys.readouterr().out
    run_id = (out / "run_id").read_text().strip()
    client = MlflowClient(uri)
    assert client.get_run(run_id).info.status == "FINISHED"
    assert [m.step for m in client.get_metric_history(run_id, "train/loss")] == [0, 1, 2]
    assert main(["run", str(tmp_path / "run.yaml"), "--out", str(out), "--resume"]) == 2   # all sent: refused
    assert "which finished" in capsys.readouterr().err


def test_a_redone_eval_is_kept_once_in_evals_jsonl(tmp_path):
    """A run killed after an eval resumes from an earlier checkpoint and evaluates again: the
    line was appended to evals.jsonl twice (the metrics were filtered, the log was not)."""
    import subprocess as sp
    import textwrap
    from lowprec.tracking.tracker import Tracker
    buf = tmp_path / "tracking"
    code = textwrap.dedent(f"""
        import os, signal
        from lowprec.tracking.tracker import Tracker
        t = Tracker({DEAD!r}, "e", "k", buffer_dir={str(buf)!r})
        t.log_eval(4, {{"task": {{"acc": 0.5}}}}, mode="fast", suite="s")
        t._journal_flush(30)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    p = sp.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGKILL, p.stderr
    t = Tracker(DEAD, "e", "k", buffer_dir=buf, resume=True, **FAST)
    t.log_eval(4, {"task": {"acc": 0.5}}, mode="fast", suite="s")     # redone
    t.log_eval(8, {"task": {"acc": 0.6}}, mode="fast", suite="s")     # new
    t.finish("FINISHED", timeout=0.5, report=False)
    assert [json.loads(x)["step"] for x in (buf / "files" / "evals.jsonl").read_text().splitlines()] == [4, 8]


def test_a_resumed_session_keeps_each_event_once_in_its_log(tmp_path):
    """A run killed after an event (a promotion at step 7) resumes from a checkpoint before it and
    makes the same decision again: the event log held it twice. The checkpoint keeps the events
    so far; resuming rewrites the log to them (the later ones are redone)."""
    import torch
    from lowprec.policy.events import Event, read_events
    from lowprec.runtime.session.session import Session
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log = tmp_path / "events.jsonl"

    class NoSites:   # a precision state with nothing to quantize
        def collect_stats(self, on):
            pass

    first = Session(model, opt, NoSites(), None, event_log=log)
    early, late = Event(2, EventKind.SKIP_STEP, (), reason="early"), Event(7, EventKind.SKIP_STEP, (), reason="late")
    first.events.append(early)
    first.log.append([early])
    saved = first.state_dict()                     # the checkpoint at step 3
    first.events.append(late)
    first.log.append([late])                       # then killed: the OS lets go of its lock
    first.close()
    again = Session(model, opt, NoSites(), None, event_log=log)
    again.load_state_dict(saved)
    assert again.events == [early] and read_events(log) == [early]
