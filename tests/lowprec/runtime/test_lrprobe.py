"""The LR probe: its losses against a step taken by hand, and exact restoration of everything it touches."""

from __future__ import annotations

import copy
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lowprec.state.checkpoint import rng_state
from lowprec.sites.plan import PrecisionPlan
from lowprec.runtime.engines.engine import SingleProcess
from lowprec.runtime.session.lrprobe import LRProbe
from lowprec.sites.precision_state import prepare


class Net(nn.Module):
    def __init__(self, vocab=32, width=32, dropout=0.0):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.head = nn.Linear(width, vocab)
        self.drop = nn.Dropout(dropout)

    def forward(self, x, y):
        h = self.embed(x)
        h = h + self.down(self.drop(F.gelu(self.up(h))))
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def batch(seed, rows=4, t=16, vocab=32):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (rows, t), generator=g)
    return x, torch.roll(x, -1, 1)


def train_steps(model, opt, n, seed0=100):
    for i in range(n):
        model(*batch(seed0 + i)).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)


def clip_of(model):
    return lambda: torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)


def test_losses_are_those_of_a_step_taken_by_hand():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1)
    train_steps(model, opt, 3)
    held = batch(7)
    expected = {}
    for f in (2.0, 0.5):   # an independent copy: backward, clip, step at lr x f, loss
        m = copy.deepcopy(model)
        o = torch.optim.AdamW(m.parameters(), lr=3e-3, weight_decay=0.1)
        o.load_state_dict(copy.deepcopy(opt.state_dict()))
        l0 = m(*held)
        l0.backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        for g in o.param_groups:
            g["lr"] = 3e-3 * f
        o.step()
        with torch.no_grad():
            expected[f] = m(*held).item()
    r = LRProbe.for_model(model, opt, held, clip=clip_of(model))(step=3)
    assert r.loss == l0.item()
    assert r.loss_at(2.0) == expected[2.0] and r.loss_at(0.5) == expected[0.5]
    assert r.sensitivity == (expected[2.0] - expected[0.5]) / abs(l0.item())
    assert r.step == 3 and [f for f, _ in r.losses] == [2.0, 0.5]


def _everything(model, opt, state):
    """A bitwise copy of what the probe must leave alone."""
    return {"params": [p.detach().clone() for p in model.parameters()],
            "grads": [None if p.grad is None else p.grad.clone() for p in model.parameters()],
            "grad_ids": [id(p.grad) for p in model.parameters()],
            "opt": copy.deepcopy(opt.state_dict()),
            "rng": rng_state(), "py": random.getstate(),
            # the sites' call counters (site_paths) count the probe's forwards too, by design
            "precision": {f: {k: v for k, v in s.items() if k != "calls"}
                          for f, s in copy.deepcopy(state.state_dict())["sites"].items()},
            "collect": [s.module.collect_stats for s in state.sites.values()],
            "stats": [dict(s.module.stats) for s in state.sites.values()]}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and \
            bool((a.reshape(-1).view(torch.uint8) == b.reshape(-1).view(torch.uint8)).all())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.parametrize("fmt,collect", [("fp8_delayed", True), ("fp8_delayed", False), ("nvfp4", True)])
def test_everything_is_restored_bit_for_bit(fmt, collect):
    """AdamW with state, sites with amax histories (fp8_delayed) or stochastic rounding from their
    own CPU generators (nvfp4's gradients), dropout drawing on the global CPU generator, some
    gradients present and some not, statistics on or off: all as before."""
    torch.manual_seed(1)
    model = Net(dropout=0.2)
    state = prepare(model, PrecisionPlan.from_dict({"backend": "emulated", "default": fmt}))
    assert state.sites and all(s.module.format.name == fmt for s in state.sites.values())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train_steps(model, opt, 4)
    if fmt == "fp8_delayed":
        assert any(int(h.count) > 0 for s in state.sites.values() for h in s.module.histories.values())
    model(*batch(50)).backward()          # gradients of a step in progress on some parameters
    model.head.weight.grad = None
    state.collect_stats(collect)
    torch.rand(3)                         # the CPU generator is in use
    before = _everything(model, opt, state)
    lr_before = [g["lr"] for g in opt.param_groups]
    r = LRProbe.for_model(model, opt, batch(9), state=state, clip=clip_of(model))(step=4)
    assert r.loss > 0 and r.loss_at(2.0) != r.loss_at(0.5)
    after = _everything(model, opt, state)
    for key in before:
        assert _same(before[key], after[key]), key
    assert [g["lr"] for g in opt.param_groups] == lr_before


@pytest.mark.parametrize("fmt", ["fp8_delayed", "nvfp4"])
def test_a_run_with_probes_trains_exactly_as_one_without(fmt):
    """The strongest form of "nothing changed": the trajectory after probes is the same, bit for bit."""
    finals = []
    for probing in (False, True):
        torch.manual_seed(2)
        model = Net(dropout=0.1)
        state = prepare(model, PrecisionPlan.from_dict({"backend": "emulated", "default": fmt}))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        probe = LRProbe.for_model(model, opt, batch(9), state=state, clip=clip_of(model))
        for i in range(6):
            if probing and i % 2 == 0:    # before the step's batch, as the session runs it; the first
                probe(i)                  # one before the optimizer has any state
            model(*batch(200 + i)).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        finals.append([p.detach().clone() for p in model.parameters()] + [torch.rand(2)])
    assert _same(finals[0], finals[1])


def test_engine_loss_is_the_forward_backward_loss_without_gradients():
    torch.manual_seed(3)
    model = Net()
    x, y = batch(4, rows=6)
    for micro in (1, 3):
        eng = SingleProcess(model, micro)
        want = eng.forward_backward(x, y)
        model.zero_grad(set_to_none=True)
        got = eng.loss(x, y)
        assert not got.requires_grad and got.item() == pytest.approx(want.item(), rel=1e-6)
        assert all(p.grad is None for p in model.parameters())


def test_refusals_say_what_to_do():
    model = Net()
    opt = torch.optim.AdamW(model.parameters())

    class NoLossEngine:
        module, params = model, list(model.parameters())

        def forward_backward(self, x, y): ...

        def clip_grad_norm(self, m): ...
    with pytest.raises(TypeError, match="no loss\\(x, y\\) method.*or turn rollout.lr_probe off"):
        LRProbe.for_engine(NoLossEngine(), opt, batch(0))
    for bad in ([2.0], [2.0, 1.5], [0.5, 0.25], [2.0, 0.0]):
        with pytest.raises(ValueError, match="one below 1 and one above"):
            LRProbe.for_model(model, opt, batch(0), factors=bad)
