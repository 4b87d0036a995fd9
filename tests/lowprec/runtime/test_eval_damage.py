"""Eval checkpoints that see damage the in-loop gate cannot (lowprec.runtime.session.eval_damage).

The in-loop gate compares the model as trained with the same weights in high precision; a model
diverged by one update at 10,000 times the learning rate is equally broken in both, and the gate
says pass. The checkpoint's own numbers against the previous checkpoint (and a baseline run's at
the same step) fail it.
"""

from __future__ import annotations

import math


from lowprec.policy.events import EventKind
from lowprec.runtime import Injection
from lowprec.runtime.session.eval_damage import DamageVerdict, damage
from lowprec.runtime.trainer.run import run_config

CFG = {
    "model": {"factory": "experiments.model:build_gpt",
              "args": {"vocab_size": 256, "block_size": 64, "n_layer": 2, "n_head": 2, "d_model": 64}},
    "data": {"factory": "experiments.data:shakespeare_tokens", "args": {"max_bytes": 400_000}, "block_size": 64},
    "train": {"steps": 22, "batch_size": 8, "lr": 1e-3, "warmup": 10, "ckpt_every": 100, "seed": 0},
    "precision": {"backend": "emulated", "keep_high_precision": [{"fqns": ["lm_head"]}],
                  "rules": [{"name": "blocks", "select": {"glob": "blocks.*"}, "format": "bf16",
                             "ladder": ["fp8_tensorwise", "bf16"]}]},
    "rollout": {"check_every": 10, "min_steps": 0,
                "stages": [{"name": "all_fp8", "select": {"glob": "blocks.*"}, "format": "fp8_tensorwise"}]},
    "eval": {"suite": "default", "every": 20, "mode": "fast", "final_mode": "fast", "batch_size": 64},
    "tracking": {"enabled": False},
}


def test_a_model_diverged_by_one_lr_spike_fails_its_eval_checkpoint(tmp_path):
    # LR x1e4 on the update just before the periodic eval at step 20: the eval runs on the
    # diverged weights before any loss has shown it
    res = run_config(CFG, tmp_path, faults=[Injection("lr_spike", 19, 20, factor=1e4)])
    evals = {h["step"]: h for h in res.evals}
    before, at = evals[min(evals)], evals[20]
    assert before["verdict"] == "pass" and not before.get("damage")   # the promotion's gate, healthy weights
    bpb = at["results"]["heldout_shakespeare"]["bits_per_byte"]
    assert bpb > 100 > before["results"]["heldout_shakespeare"]["bits_per_byte"]   # it diverged
    assert at["verdict"] == "regress", at["reason"]   # the gate alone (as trained vs high precision) says pass
    assert any("heldout_shakespeare/bits_per_byte" in p for p in at["damage"])
    gates = [e for e in res.events if e.kind == EventKind.GATE and e.step == 20]
    assert gates and gates[0].evidence["verdict"] == "regress" and "damage" in gates[0].evidence["detail"]


def test_damage_rules():
    healthy = {"t": {"bits_per_byte": 4.6, "word_perplexity": 300.0, "acc": 0.3, "acc_stderr": 0.01}}
    assert damage(healthy, [("previous", healthy)]) == []
    assert damage({"t": {"bits_per_byte": 4.9, "word_perplexity": 400.0, "acc": 0.1}}, [("previous", healthy)]) == []
    diverged = {"t": {"bits_per_byte": 772.0, "word_perplexity": math.inf, "acc": 0.0}}
    problems = damage(diverged, [])    # no reference: only what is not finite
    assert problems == ["t/word_perplexity = inf is not finite"]
    problems = damage(diverged, [("the baseline run at step 100", healthy)])
    assert len(problems) == 2 and "772" in problems[1] and "baseline" in problems[1]
    saturated = {"t": {"word_perplexity": 1.7976931348623157e308}}   # MLflow's stored inf
    assert damage(saturated, []) == ["t/word_perplexity = 1.79769e+308 is not finite"]
    out = DamageVerdict(tuple(problems), gate=type("G", (), {"verdict": "pass"})())
    assert out.verdict == "regress" and "said pass" in out.reason


def test_a_checkpoint_is_compared_with_the_baseline_runs_evals_at_the_same_step(tmp_path, sqlite_store):
    """The baseline's evals are read from a real MLflow store; the first checkpoint has no previous
    one, so only the baseline shows that its bits per byte exploded."""
    import contextlib
    from types import SimpleNamespace

    from mlflow.tracking import MlflowClient

    from lowprec.runtime.session.baseline import BaselineEvals
    from lowprec.runtime.session.evals import EvalCheckpoints, EvalOutcome

    uri = sqlite_store(tmp_path)
    client = MlflowClient(uri)
    run = client.create_run(client.create_experiment("damage"), run_name="bf16")
    for step, bpb in ((10, 4.6), (20, 4.5)):
        client.log_metric(run.info.run_id, "eval/t/bits_per_byte", bpb, step=step)
        client.log_metric(run.info.run_id, "eval/t/bits_per_byte_stderr", 0.01, step=step)
        client.log_metric(run.info.run_id, "eval_mode/eval", 0.0, step=step)
    client.set_terminated(run.info.run_id)
    baseline = BaselineEvals(uri, "damage", "bf16")
    assert baseline(20, "fast") == {"t": {"bits_per_byte": 4.5}} and baseline(20, "full") is None

    class Evaluator:
        tasks = ("t",)
        value = 9.0

        def evaluate(self, mode):
            return EvalOutcome({"t": {"bits_per_byte": self.value}})

    class State:
        def formats(self):
            return {"a": "bf16"}

        def collect_stats(self, on):
            pass

        @contextlib.contextmanager
        def high_precision(self):
            yield

    cfg = SimpleNamespace(every=10, mode="fast", final_mode="fast", high_precision=True, suite="s")
    evaluator = Evaluator()
    ev = EvalCheckpoints(cfg, evaluator, None, State(), baseline=baseline)
    out = ev.gate(20)
    assert out.verdict == "regress" and "baseline run at step 20" in out.reason
    evaluator.value = 4.4
    assert ev.gate(30).verdict == "pass"   # no baseline eval at 30; the previous (damaged) one is no reference
    assert BaselineEvals(uri, "damage", "nonesuch")(10, "fast") is None   # a baseline that cannot be read: no comparison
