"""A user's own loop with `Session`, on a Hugging Face Llama (not the reference GPT).

The loop below is a plain PyTorch loop plus one call, `session.step(loss[, closure])`: it
has no rewind, skip or format-switching code. An injected loss spike (a data fault: the
loss and its gradients x1000) after a stage was promoted:

* without a closure (no replays), the next check rolls the stage back and rewinds two
  checks back;
* with a closure, the step is replayed with the low-precision sites in high precision, the
  spike persists, so precision is not to blame: nothing is demoted, the first step is
  skipped and the second rewinds to the state before the spike began.

Either way the model, optimizer and scheduler after the rewind must equal, bit for bit,
the copy the test itself took when the session reached that step.
"""

from __future__ import annotations

import copy

import pytest
import torch

from lowprec.runtime.trainer.faults import FaultKind, Faults, Injection
from lowprec.runtime.session.session import Session

transformers = pytest.importorskip("transformers")

CONFIG = """
precision:
  backend: emulated
  default: bf16
  keep_high_precision: [{fqns: [lm_head]}]
  rules:
    - {name: layers, select: {glob: "model.layers.*"}, format: bf16, ladder: [fp8_tensorwise, bf16]}
rollout:
  check_every: 5
  min_steps: 10
  cooldown_steps: 100
  rewind: {enabled: true, skip_batches: 2, snapshot_every: 5, keep: 4}
  thresholds: {max_saturated_frac: 1.0, spike_min_history: 8}
  stages:
    - {name: mlp_fp8, select: {glob: "model.layers.*.mlp.*"}, format: fp8_tensorwise}
"""


def _llama():
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(cfg)


def _state(model, opt, sched) -> dict:
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": copy.deepcopy(opt.state_dict()), "sched": copy.deepcopy(sched.state_dict())}


def _assert_equal(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            _assert_equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, where


def _user_loop(tmp_path, iterations: int, spike_steps: int, closure: bool, **session_kwargs):
    """The user's loop: nothing but forward, backward and session.step (with the step's
    closure or without), a loss spike x1000 from iteration 27 for `spike_steps` iterations.
    Returns the session, the results, the test's own copies of model, optimizer and
    scheduler at every snapshot step, and (step, step rewound to, state after) per rewind."""
    (tmp_path / "lowprec.yaml").write_text(CONFIG)
    model = _llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 5))
    session = Session.from_yaml(tmp_path / "lowprec.yaml", model, opt, scheduler=sched, **session_kwargs)
    faults = Faults(model, [Injection(FaultKind.LOSS_SPIKE, start=27, stop=27 + spike_steps, factor=1000.0)])
    gen = torch.Generator().manual_seed(1)
    taken: dict[int, dict] = {}
    results, rewinds = [], []
    for iteration in range(iterations):
        if session.step_index % 5 == 0:
            taken[session.step_index] = _state(model, opt, sched)
        faults.tick(iteration)
        ids = torch.randint(0, 96, (4, 16), generator=gen)

        def step_closure():
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            return loss
        result = session.step(step_closure(), step_closure if closure else None)
        results.append(result)
        if result.rewound_to is not None:
            rewinds.append((result.step, result.rewound_to, _state(model, opt, sched)))
    return session, results, taken, rewinds


@pytest.mark.slow   # over 10 s: in make test, not in the fast subset
def test_user_loop_rewinds_to_the_snapshot_bit_for_bit(tmp_path):
    session, _, taken, rewinds = _user_loop(tmp_path, 45, spike_steps=1, closure=False,
                                            event_log=tmp_path / "events.jsonl")
    kinds = [e.kind for e in session.events]
    assert "promote" in kinds and "rollback" in kinds and "rewind" in kinds, kinds
    assert len(rewinds) == 1
    at, back, after = rewinds[0]
    assert back % 5 == 0 and back <= at - 10      # two checks back, on a snapshot step
    _assert_equal(taken[back], after, "state after the rewind")
    # after the rollback every site is back in bf16, and training went on from there
    assert set(session.state.formats().values()) == {"bf16"}
    assert session.step_index == 45 - (at + 1 - back)
    assert all(torch.isfinite(p).all() for p in session.model.parameters())


@pytest.mark.slow   # over 10 s: in make test, not in the fast subset
def test_user_loop_with_a_closure_demotes_nothing_for_a_data_fault_and_rewinds_before_it(tmp_path):
    session, results, taken, rewinds = _user_loop(tmp_path, 40, spike_steps=2, closure=True)
    kinds = [e.kind for e in session.events]
    assert "promote" in kinds and "rollback" not in kinds and "fallback" not in kinds, kinds
    first, second = results[27], results[28]
    assert first.action == "skip_step" and not first.attribution.precision_to_blame
    assert len(first.attribution.replays) == 1          # one replay, every low-precision site in bf16
    assert second.action == "rewind" and second.rewound_to == 25   # the snapshot before the spike began (27)
    assert len(rewinds) == 1
    _assert_equal(taken[25], rewinds[0][2], "state after the rewind")
    assert "fp8_tensorwise" in session.state.formats().values()   # the promoted stage stays
    assert all(torch.isfinite(p).all() for p in session.model.parameters())


def test_skip_step_leaves_adamw_untouched():
    """A non-finite gradient: the optimizer never steps (AdamW's moments and step count stay)."""
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    from lowprec.sites.plan import PrecisionPlan
    from lowprec.policy.rollout import parse_rollout
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    plan = PrecisionPlan.from_dict({"backend": "emulated", "default": "fp8_tensorwise"})
    rollout = parse_rollout({"check_every": 4, "stages": [{"name": "all", "select": {"glob": "*"},
                                                            "format": "fp8_tensorwise"}]})
    session = Session.build(model, opt, plan, rollout)
    x = torch.randn(8, 16)
    for _ in range(3):
        model(x).pow(2).mean().backward()
        assert session.step(model(x).pow(2).mean().detach()).applied
    before = _state(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0))
    out = model(x).pow(2).mean() * float("nan")
    out.backward()
    result = session.step(out)
    assert not result.applied and result.action == "skip_step"
    _assert_equal(before["model"], _state(model, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda k: 1.0))["model"])
    _assert_equal(before["optim"], copy.deepcopy(opt.state_dict()))
    assert all(p.grad is None for p in model.parameters())
