"""lowprec.policy.monitor.Monitor on its own: a tiny prepared stack of linear layers, no training loop.

What the controller relies on: statistics are collected on check steps only (every step
with stats_every_step), check() returns the window's losses and grad norms in order and
resets the window, force_check makes the next step a check step, a NaN in a site's output
is counted for that site, and `sites=` packs a zero row for a site this rank lacks.
"""

from collections import OrderedDict

import pytest
import torch
from torch import nn

import lowprec.policy.monitor
from lowprec import prepare
from lowprec.policy.monitor import ROLES, Monitor, MonitorConfig
from lowprec.sites.plan import PrecisionPlan
from lowprec.numerics.quantize import QuantStats, quantize

BATCH, D_IN, D_HID, D_OUT = 4, 32, 64, 32


def prepared(fmt: str = "fp8_tensorwise", layers=None):
    """A prepared nn.Sequential (default: Linear, ReLU, Linear; sites "0" and "2")."""
    torch.manual_seed(0)
    if layers is None:
        layers = OrderedDict([("0", nn.Linear(D_IN, D_HID)), ("1", nn.ReLU()), ("2", nn.Linear(D_HID, D_OUT))])
    model = nn.Sequential(layers)
    plan = {"backend": "emulated",
            "rules": [{"name": "all", "select": {"glob": "*"}, "format": fmt, "ladder": list(dict.fromkeys([fmt, "bf16"]))}]}
    return model, prepare(model, PrecisionPlan.from_dict(plan))


def monitor(state, check_every: int = 3, stats_every_step: bool = False, **kw) -> Monitor:
    return Monitor(state, MonitorConfig(check_every=check_every, stats_every_step=stats_every_step), **kw)


def train_step(mon: Monitor, model: nn.Module, step: int, x: torch.Tensor) -> tuple[float, float]:
    """One step as the loop runs it: before_step, forward, backward, record. (loss, grad norm)"""
    mon.before_step(step)
    model.zero_grad(set_to_none=True)
    loss = model(x).pow(2).mean()
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    mon.record(step, loss, norm)
    return loss.item(), norm.item()


def inputs(scale: float = 1.0, seed: int = 0) -> torch.Tensor:
    return scale * torch.randn(BATCH, D_IN, generator=torch.Generator().manual_seed(seed))


def amax(t: torch.Tensor) -> float:
    return t.abs().max().item()


# ------------------------------------------------------------------ when statistics are collected
def test_statistics_are_collected_on_check_steps_only():
    model, state = prepared()
    mon = monitor(state, check_every=3)
    assert [mon.is_check_step(s) for s in range(6)] == [False, False, True, False, False, True]
    assert [mon.wants_stats(s) for s in range(6)] == [False, False, True, False, False, True]
    collected = []
    for step in range(3):
        # the big inputs of steps 0 and 1 must not show in the check's amax
        x = inputs(scale=100.0 if step < 2 else 1.0, seed=step)
        mon.before_step(step)
        model.zero_grad(set_to_none=True)
        model(x).pow(2).mean().backward()
        collected.append(bool(state.stats()))   # the layers computed statistics this step
        mon.record(step, torch.tensor(1.0), torch.tensor(1.0))
    assert collected == [False, False, True]
    sig = mon.check(2)
    assert set(sig.sites) == {"0", "2"}
    assert sig.sites["0"].amax["input"] == pytest.approx(amax(x), rel=1e-2)
    assert sig.sites["0"].saturated_frac["input"] == 0.0


def test_stats_every_step_collects_on_every_step():
    model, state = prepared()
    mon = monitor(state, check_every=3, stats_every_step=True)
    assert all(mon.wants_stats(s) for s in range(6))
    assert [mon.is_check_step(s) for s in range(3)] == [False, False, True]   # checks stay every 3
    xs = [inputs(scale=100.0 if step == 0 else 1.0, seed=step) for step in range(3)]
    for step, x in enumerate(xs):
        train_step(mon, model, step, x)
    sig = mon.check(2)
    assert sig.sites["0"].amax["input"] == pytest.approx(max(amax(x) for x in xs), rel=1e-2)


def test_underflow_energy_is_the_windows_flushed_share_of_the_energy():
    """Half of every input tiny: most of those values are flushed to zero but they hold a
    negligible share of the energy. Over a window of two steps the monitor sums the flushed
    energy and the signal power of both (expected: from the inputs and their quantized values)."""
    model, state = prepared()
    mon = monitor(state, check_every=2, stats_every_step=True)
    spec = state.site("0").module.format.input
    flushed_energy = power = flushed = 0.0
    for step in range(2):
        x = inputs(seed=step)
        x[:, D_IN // 2:] *= 2.0 ** -30
        zero = (x != 0) & (quantize(x, spec).values == 0)
        flushed += zero.sum().item()
        flushed_energy += (x[zero].double() ** 2).sum().item()
        power += (x.double() ** 2).sum().item()
        train_step(mon, model, step, x)
    sig = mon.check(1).sites["0"]
    assert sig.underflow_frac["input"] == flushed / (2 * x.numel()) >= 0.5
    assert sig.underflow_energy_frac["input"] == pytest.approx(flushed_energy / power, rel=1e-9)
    assert 0 < sig.underflow_energy_frac["input"] < 1e-15
    assert sig.flat()["input/underflow_energy_frac"] == sig.underflow_energy_frac["input"]


# ------------------------------------------------------------------ the check window
def test_check_returns_the_windows_losses_and_grad_norms_in_order_and_resets():
    model, state = prepared()
    mon = monitor(state, check_every=3)
    losses, norms = [3.0, 1.0, 2.0], [0.5, 0.25, 4.0]
    for step, (loss, norm) in enumerate(zip(losses, norms)):
        mon.before_step(step)
        mon.record(step, torch.tensor(loss), torch.tensor(norm))
    sig = mon.check(2)
    assert sig.step == 2 and sig.losses == losses and sig.grad_norms == norms
    assert not sig.nonfinite

    # the next window starts empty: only its own steps, only its own statistics
    got = [train_step(mon, model, step, inputs(scale=100.0 if step == 5 else 1.0, seed=step))
           for step in (3, 4, 5)]
    sig = mon.check(5)
    assert sig.losses == pytest.approx([g[0] for g in got]) and sig.grad_norms == pytest.approx([g[1] for g in got])
    assert sig.sites["0"].amax["input"] == pytest.approx(amax(inputs(100.0, seed=5)), rel=1e-2)
    big = sig.sites["0"].amax["input"]
    train_step(mon, model, 8, inputs(seed=8))
    sig = mon.check(8)
    assert len(sig.losses) == 1 and sig.sites["0"].amax["input"] < big / 10   # the amax max was reset


def test_check_of_an_empty_window_returns_no_steps():
    # a check step whose only step was replayed and decided on its own leaves an empty window
    _, state = prepared()
    sig = monitor(state).check(0)   # nothing recorded
    assert sig.losses == [] and sig.grad_norms == [] and sig.sites == {}


def test_force_check_makes_the_next_step_a_check_step_that_collects_statistics():
    model, state = prepared()
    mon = monitor(state, check_every=10)
    train_step(mon, model, 0, inputs(seed=0))
    assert not mon.is_check_step(1) and not mon.wants_stats(1)
    mon.force_check(1)
    assert mon.is_check_step(1) and mon.wants_stats(1)
    train_step(mon, model, 1, inputs(seed=1))
    assert state.stats() == {}   # record() took the layers' statistics into the window
    sig = mon.check(1)
    assert len(sig.losses) == 2 and set(sig.sites) == {"0", "2"}
    assert sig.sites["0"].amax["input"] == pytest.approx(amax(inputs(seed=1)), rel=1e-2)
    assert not mon.is_check_step(1)   # the forced step was used up by the check


# ------------------------------------------------------------------ non-finite outputs
def test_a_nan_in_one_sites_output_is_counted_for_that_site():
    model, state = prepared(fmt="bf16")   # high precision: the NaN stays in one output column
    mon = monitor(state, check_every=1)
    with torch.no_grad():
        state.site("2").module.bias[0] = float("nan")
    train_step(mon, model, 0, inputs())
    sig = mon.check(0)
    assert sig.sites["2"].nonfinite["output"] == BATCH   # column 0 of every row
    assert sig.sites["0"].nonfinite["output"] == 0
    assert sig.nonfinite                                  # the loss is NaN too

    mon.count_outputs = False   # a session that replays: no output pass on check steps
    train_step(mon, model, 1, inputs())
    sig = mon.check(1)
    assert all("output" not in s.nonfinite for s in sig.sites.values()) and sig.nonfinite


# ------------------------------------------------------------------ sites this rank lacks
class FakeGroup:
    """Stands in for a process group whose other ranks sent `others`; keeps what this rank sent."""

    def __init__(self, others=()):
        self.others, self.sent = list(others), []

    def all_gather(self, out, tensor):
        self.sent.append(tensor.clone())
        for o, t in zip(out, [tensor, *self.others], strict=True):
            o.copy_(t)


@pytest.fixture
def fake_dist(monkeypatch):
    """torch.distributed's world size and all_gather answered by the FakeGroup passed in."""
    dist = lowprec.policy.monitor.dist
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 1 + len(group.others))
    monkeypatch.setattr(dist, "all_gather", lambda out, tensor, group=None: group.all_gather(out, tensor))


def site_rows(packed: torch.Tensor, n_sites: int) -> torch.Tensor:
    n = n_sites * len(ROLES) * len(QuantStats.FIELDS)
    return packed[:n].reshape(n_sites, len(ROLES), len(QuantStats.FIELDS))


def test_sites_the_state_lacks_are_packed_as_zeros(fake_dist):
    model, state = prepared()
    everything = ["0", "2", "3"]   # "3": a later pipeline stage's site
    group = FakeGroup()
    mon = monitor(state, check_every=1, sites=everything, group=group)
    train_step(mon, model, 0, inputs())
    sig = mon.check(0)
    rows = site_rows(group.sent[0], len(everything))
    assert rows[0].abs().sum() > 0 and rows[1].abs().sum() > 0
    assert torch.equal(rows[2], torch.zeros_like(rows[2]))
    assert set(sig.sites) == {"0", "2"}

    with pytest.raises(ValueError, match="sites= must list every site"):
        monitor(state, sites=["0"])


def test_pipeline_stages_each_see_every_sites_statistics(fake_dist):
    """Two stages (sites "0" and "2"), each packing a row for both; after the gather each
    rank holds both stages' statistics, the mean loss and the max grad norm."""
    first, s0 = prepared(layers=OrderedDict([("0", nn.Linear(D_IN, D_HID)), ("1", nn.ReLU())]))
    second, s1 = prepared(layers=OrderedDict([("2", nn.Linear(D_HID, D_OUT))]))
    sites = ["0", "2"]
    g0, g1 = FakeGroup(), FakeGroup()
    m0, m1 = monitor(s0, check_every=1, sites=sites, group=g0), monitor(s1, check_every=1, sites=sites, group=g1)
    x = inputs()
    m0.before_step(0)
    m1.before_step(0)
    h = first(x)
    second(h).pow(2).mean().backward()
    m0.record(0, torch.tensor(1.0), torch.tensor(1.0))   # per-rank values, to see how they combine
    m1.record(0, torch.tensor(2.0), torch.tensor(3.0))
    m1.check(0)                # a one-rank check, only to obtain the second stage's packed vector
    g0.others = [g1.sent[0]]   # the first stage's group now has that rank too
    sig = m0.check(0)
    assert set(sig.sites) == {"0", "2"}
    assert sig.sites["0"].amax["input"] == pytest.approx(amax(x), rel=1e-2)
    assert sig.sites["2"].amax["input"] == pytest.approx(amax(h), rel=1e-2)
    assert sig.losses == [1.5] and sig.grad_norms == [3.0]


# ------------------------------------------------------------------ between checks
def test_a_delayed_scaling_weight_overflow_starting_on_a_check_step_is_in_that_check():
    """fp8_delayed: a weight 1000x larger from a check step on saturates under the scale its
    history gives; that check reports the saturation (the backward reuses the forward's
    quantization, so its statistics stand), and the check before it saw none."""
    model, state = prepared("fp8_delayed")
    mon = monitor(state, check_every=5)
    for step in range(5):
        train_step(mon, model, step, inputs(seed=step))
    assert mon.check(4).sites["2"].saturated_frac["weight"] == 0.0
    for step in range(5, 10):
        if step == 9:                                      # the check step
            with torch.no_grad():
                model[2].weight.mul_(1000.0)   # site "2" runs dgrad: its weight^T is needed
        train_step(mon, model, step, inputs(seed=step))
    sig = mon.check(9)
    assert sig.sites["2"].saturated_frac["weight"] > 0.9
    assert sig.sites["0"].saturated_frac["weight"] == 0.0


def test_a_one_step_delayed_scaling_overflow_between_checks_is_counted():
    """fp8_delayed: the scale comes from the amax history, so an input 1000x larger than the
    history saturates in that one step; statistics are off there (not a check step), yet the
    check reports it for the site and the role where it happened, and only once."""
    model, state = prepared("fp8_delayed")
    mon = monitor(state, check_every=5)
    for step in range(5):                                  # history fills with amax ~3
        train_step(mon, model, step, inputs(seed=step))
    first = mon.check(4)
    assert all(not s.overflow_steps for s in first.sites.values())
    for step in range(5, 10):
        train_step(mon, model, step, inputs(scale=1000.0 if step == 6 else 1.0, seed=step))
        if step == 6:
            assert not state.sites["0"].module.collect_stats   # step 6 is no check step
    sig = mon.check(9)
    assert sig.sites["0"].overflow_steps == {"input": 1.0}
    assert sig.sites["0"].flat()["input/overflow_steps"] == 1.0
    for step in range(10, 15):
        train_step(mon, model, step, inputs(seed=step))
    assert not mon.check(14).sites["0"].overflow_steps     # read once, then reset
