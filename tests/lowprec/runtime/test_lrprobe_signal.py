"""A steeper learning-rate schedule makes the LR-sensitivity signal rise before the loss spikes.

A small GPT (2 blocks, width 64) trains on Shakespeare bytes with AdamW at lr 1e-3; after 60
steps the lr grows by 6% a step, until the training loss spikes (the first loss above 1.3x
the lowest before it, or a non-finite one). The LR probe runs every 5 steps on a held batch
(`lowprec.runtime.session.lrprobe`), and the signal crosses its hold level by the controller's rule
(`lowprec.policy.controller.lr_sensitivity_hold` with rollout.lr_probe's defaults: above 0, or
0.04 above the median of the 4 probes before). It must cross at least two probes (10
steps) before the spike; at a constant lr it never crosses and the loss never spikes in
the same 200 steps.

Measured when this test was written (seeds 0-5, 6% a step): the sensitivity above 0 at
steps 100-115, risen by 0.04 at 100-120, the spike at 144-155 (34-54 steps after the first
crossing); at 3% a step (seeds 0-2): crossing at 155-205, the spike at 232-240; at a
constant lr 1e-3 (seeds 0-3): neither in 200 steps, the sensitivity at most -0.005 (seed 0:
800 steps, the same).
"""

from __future__ import annotations

import math

import pytest
import torch

from experiments.data import shakespeare_tokens
from experiments.model import build_gpt
from lowprec.policy.controller import lr_sensitivity_hold
from lowprec.policy.rollout import LRProbeConfig
from lowprec.runtime.trainer.data import TokenBatches
from lowprec.runtime.session.lrprobe import LRProbe

pytestmark = pytest.mark.slow   # three training runs of up to 200 steps: about 6 s on one thread

DEFAULTS = LRProbeConfig()
EVERY = 5


@pytest.fixture(autouse=True)
def one_thread():
    """Tensors this small run fastest on one thread (and do not fight the other tests for the cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def first_rise_and_spike(seed: int, growth: float, steps: int = 200, flat: int = 60, lr0: float = 1e-3):
    """(first step at which the probe's sensitivity is above its hold level, first step whose loss
    spikes); None: never."""
    torch.manual_seed(seed)
    tokens = shakespeare_tokens(200_000)
    model = build_gpt(vocab_size=256, block_size=32, n_layer=2, n_head=2, d_model=64)
    data = TokenBatches(tokens, 8, 32, seed=seed)
    held = TokenBatches(tokens, 8, 32, seed=seed + 7919).batch(0)
    opt = torch.optim.AdamW(model.parameters(), lr=lr0, betas=(0.9, 0.95), weight_decay=0.0)

    def clip():
        return torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    probe = LRProbe.for_model(model, opt, held, clip=clip)
    history: list[tuple[int, float]] = []
    rise = spike = None
    lowest = math.inf
    for step in range(steps):
        for g in opt.param_groups:
            g["lr"] = lr0 * growth ** max(0, step - flat)
        if step % EVERY == 0:
            history.append((step, probe(step).sensitivity))
            if rise is None and lr_sensitivity_hold(history, DEFAULTS.hold_rise, DEFAULTS.hold_above)[0]:
                rise = step
        x, y = data.next()
        loss = model(x, y)[1]
        loss.backward()
        clip()
        opt.step()
        opt.zero_grad(set_to_none=True)
        value = loss.item()
        if spike is None and (not math.isfinite(value) or value > 1.3 * lowest):
            spike = step
        lowest = min(lowest, value)
        if rise is not None and spike is not None:
            break
    return rise, spike


@pytest.mark.parametrize("seed", [0, 1])
def test_a_steep_schedule_makes_the_signal_rise_before_the_loss_spikes(seed):
    rise, spike = first_rise_and_spike(seed, growth=1.06)
    assert spike is not None, "the schedule never made the loss spike"
    assert rise is not None and rise <= spike - 2 * EVERY, (rise, spike)


def test_at_a_constant_lr_neither_rises():
    assert first_rise_and_spike(0, growth=1.0) == (None, None)
