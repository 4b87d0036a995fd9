"""The LR probe inside the Session and the loop: when it runs, where its number goes, and that
training is the same bit for bit with it as without it; what the loop refuses."""

from __future__ import annotations

import pytest
import torch

from experiments.model import build_gpt
from lowprec.base.parse import ConfigError
from lowprec.sites.plan import PrecisionPlan
from lowprec.policy.rollout import parse_rollout
from lowprec.runtime.trainer.data import TokenBatches
from lowprec.runtime.trainer.run import run_config
from lowprec.runtime.session.session import Session

PLAN = {"backend": "emulated", "default": "bf16",
        "rules": [{"name": "blocks", "select": {"glob": "blocks.*"}, "format": "bf16",
                   "ladder": ["fp8_delayed", "bf16"]}]}
STAGES = [{"name": "mlp", "select": {"glob": "blocks.*.mlp.*"}, "format": "fp8_delayed"}]
TOKENS = torch.arange(3000) * 7 % 61


def rollout(probe: bool):
    return parse_rollout({"check_every": 2, "min_steps": 4, "stages": STAGES,
                          "lr_probe": {"enabled": probe, "every_checks": 2}})


def run_session(probe: bool, steps: int = 12):
    torch.manual_seed(0)
    model = build_gpt(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=32)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    held = TokenBatches(TOKENS, 4, 16, seed=99).batch(0)
    session = Session.build(model, opt, PrecisionPlan.from_dict(PLAN), rollout(probe), held_batch=held)
    data = TokenBatches(TOKENS, 4, 16, seed=1)
    losses, seen = [], {}
    for _ in range(steps):
        x, y = data.next()
        loss = model(x, y)[1]
        loss.backward()
        out = session.step(loss)
        losses.append(out.loss.item())
        if session.is_check_step(out.step):
            seen[out.step] = session.last_signals.lr_sensitivity
    return session, losses, [p.detach().clone() for p in model.parameters()], seen


@pytest.mark.slow   # over 10 s: in make test, not in the fast subset
def test_the_probe_runs_every_other_check_and_its_number_reaches_the_controller():
    session, losses, params, seen = run_session(True)
    # checks at steps 1, 3, 5, ...; the probe at every second one: 3, 7, 11 (before their batches)
    assert [s for s, v in seen.items() if v is not None] == [3, 7, 11]
    assert all(v is None for s, v in seen.items() if s not in (3, 7, 11))
    assert session.controller.lr_history == [(s, seen[s]) for s in (3, 7, 11)]
    assert session.lr_probe_result.step == 11 and session.lr_probe_result.sensitivity == seen[11]
    assert session.state_dict()["controller"]["lr_history"] == [[s, seen[s]] for s in (3, 7, 11)]
    # and it changes nothing: the same losses and weights, bit for bit, as without the probe
    _, losses_without, params_without, _ = run_session(False)
    assert losses == losses_without
    assert all(torch.equal(a, b) for a, b in zip(params, params_without))


def test_an_enabled_probe_needs_a_held_batch():
    model = build_gpt(vocab_size=64, block_size=16, n_layer=1, n_head=2, d_model=32)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ConfigError, match=r"rollout.lr_probe: is enabled, and the probe needs a held batch: "
                                          r"pass held_batch=\(x, y\)"):
        Session.build(model, opt, PrecisionPlan.from_dict(PLAN), rollout(True))


CONFIG = {
    "model": {"factory": "experiments.model:build_gpt",
              "args": {"vocab_size": 256, "block_size": 16, "n_layer": 1, "n_head": 2, "d_model": 32}},
    "data": {"factory": "experiments.data:shakespeare_tokens", "args": {"max_bytes": 20_000}, "block_size": 16},
    "train": {"steps": 12, "batch_size": 4, "lr": 3e-3, "warmup": 2, "ckpt_every": 100, "seed": 0},
    "precision": PLAN,
    "rollout": {"check_every": 2, "min_steps": 4, "stages": STAGES, "lr_probe": {"enabled": True, "every_checks": 2}},
    "tracking": {"enabled": False},
}


class Recorder:
    """The tracker calls the loop makes (a stand-in for lowprec.tracking.tracker.Tracker)."""

    def __init__(self):
        self.signals = {}

    def log_signals(self, step, signals):
        self.signals[step] = signals

    def __getattr__(self, name):
        return lambda *a, **k: None


@pytest.mark.slow   # over 10 s: in make test, not in the fast subset
def test_the_loop_probes_on_a_held_batch_of_its_own(tmp_path):
    rec = Recorder()
    res = run_config(CONFIG, tmp_path / "with", tracker=rec)
    assert [s for s, sig in rec.signals.items() if sig.lr_sensitivity is not None] == [3, 7, 11]
    without = dict(CONFIG, rollout={**CONFIG["rollout"], "lr_probe": {"enabled": False}})
    assert run_config(without, tmp_path / "without").losses == res.losses   # the data stream untouched


def test_the_loop_refuses_what_cannot_give_a_held_batch_or_a_forward_only_loss(tmp_path, monkeypatch):
    class Source:   # a batch source without held_batch()
        def __init__(self):
            self.inner = TokenBatches(torch.arange(3000) % 64, 4, 16)

        def next(self):
            return self.inner.next()

        def skip(self, n): ...

        def state_dict(self):
            return {}

        def load_state_dict(self, s): ...
    import lowprec.runtime.trainer.run as run_mod
    original = run_mod.prepare_run

    def with_source(cfg, **kw):
        p = original(cfg, **kw)
        p.data = Source()
        return p
    monkeypatch.setattr(run_mod, "prepare_run", with_source)
    with pytest.raises(ConfigError, match=r"rollout.lr_probe: is enabled, .* the Source batch source cannot give: "
                                          r"give it a held_batch\(\) method"):
        run_config(CONFIG, tmp_path / "a")
    monkeypatch.setattr(run_mod, "prepare_run", original)
    from lowprec.runtime.engines.engine import SingleProcess
    monkeypatch.delattr(SingleProcess, "loss")   # as the DP x TP and pipeline engines: no forward-only loss
    with pytest.raises(ConfigError, match=r"rollout.lr_probe: .*SingleProcess engine has no loss\(x, y\) method"):
        run_config(CONFIG, tmp_path / "b")
