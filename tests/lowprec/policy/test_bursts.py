"""A burst of anomalies (bad batches on consecutive steps) against a new level: no model needed.

The case of issue 54: four random-token batches in a row. Each is an anomaly that a replay
with every site in high precision does not clear (a fault of the data, not of precision).
A burst must not rebase the detectors (a level is accepted only when it outlasts
`accept_after` steps in a row) and each of its steps is skipped: no bad batch applied,
none missed, nothing demoted.
"""

import statistics

import pytest

from lowprec.policy.attribution import Attribution, Replay
from lowprec.policy.controller import Action, ControllerConfig, RolloutController, Stage
from lowprec.policy.detectors import Thresholds
from lowprec.policy.events import EventKind
from lowprec.policy.rollout import parse_rollout

SITES = [f"blocks.{b}.{m}" for b in range(2) for m in ("attn.qkv", "mlp.fc")]


def make(rewind=False):
    th = Thresholds(spike_min_history=8, large_warmup=20)
    cfg = ControllerConfig(min_steps=0, cooldown_steps=50, rewind=rewind, rewind_skip_batches=3, thresholds=th)
    return RolloutController({s: ("fp8_tensorwise", "bf16") for s in SITES}, {s: "fp8_tensorwise" for s in SITES},
                             [Stage("all", tuple(SITES), "fp8_tensorwise")], cfg)


def normal(ctl, steps=40):
    for i in range(steps):                                        # loss ~2, grad norm ~0.7
        assert ctl.detect(i, 2.0 + 0.01 * (i % 5), 0.7 + 0.02 * (i % 7)) is None


def not_precision(a):
    """The replay of the whole model in high precision meets the same bad batch."""
    return Attribution(False, (), (Replay(tuple(SITES), a.loss, a.grad_norm, True),))


# a random-token batch: the loss jumps to about ln(256) and the grad norm with it, or (a batch the
# model finds merely surprising) the grad norm alone
BAD = {"loss and grad norm": (5.6, 9.0), "grad norm alone": (2.0, 9.0)}


@pytest.mark.parametrize("values", BAD.values(), ids=BAD.keys())
def test_four_bad_batches_in_a_row_are_each_skipped_and_rebase_nothing(values):
    ctl = make(rewind=False)
    normal(ctl)
    before = ctl.detectors.state_dict()
    decisions = []
    for step in range(40, 44):
        a = ctl.detect(step, *values)
        assert a is not None, f"bad batch at step {step} not detected"
        decisions.append(ctl.observe_step(step, a, None, not_precision(a)))
    kinds = [e.kind for d in decisions for e in d.events]
    assert [d.action for d in decisions] == [Action.SKIP_STEP] * 4, kinds
    assert EventKind.ACCEPT not in kinds and not any(d.changes for d in decisions)
    assert ctl.detectors.state_dict() == before                  # the burst left no trace in the detectors
    assert ctl.detect(44, 2.01, 0.72) is None                     # the next good batch is normal
    again = ctl.detect(45, *values)                               # and a later bad one is still seen
    assert again is not None and ctl.observe_step(45, again, None, not_precision(again)).action is Action.SKIP_STEP


def test_with_rewind_a_loss_burst_rewinds_and_the_rest_is_skipped():
    """The loss is off and rewind is on: the second bad batch rewinds (`persist_steps`); the
    host's data goes on (the Trainer's does), so the next two bad batches are a new streak:
    skipped, then rewound again. No bad batch is applied, no level accepted."""
    ctl = make(rewind=True)
    normal(ctl)
    actions = []
    for step in (40, 41, 40, 41):                                 # lowprec's step goes back with the rewind
        a = ctl.detect(step, 5.6, 9.0)
        d = ctl.observe_step(step, a, None, not_precision(a))
        actions.append(d.action)
        if d.action is Action.REWIND:
            assert d.rewind_before == step - 2
            ctl.rewound(step - 1)
    assert actions == [Action.SKIP_STEP, Action.REWIND] * 2


def test_a_level_that_outlasts_the_burst_is_accepted_at_its_median():
    ctl = make(rewind=False)
    normal(ctl)
    norms = [8.0, 9.5, 8.6, 9.1, 8.8, 9.3, 8.4, 9.0]              # a new level, noisy
    for step, g in enumerate(norms, start=40):
        a = ctl.detect(step, 2.0, g)
        d = ctl.observe_step(step, a, None, not_precision(a))
        last = step == 40 + len(norms) - 1
        assert d.action is (Action.CONTINUE if last else Action.SKIP_STEP), step
    (acc,) = [e for e in d.events if e.kind == EventKind.ACCEPT]
    assert acc.evidence["level_grad_norm"] == statistics.median(norms)
    mean = statistics.mean(ctl.detectors.grad_spike.reference())
    assert mean == pytest.approx(statistics.median(norms))         # rebased on the level, not the last value
    assert ctl.detect(48, 2.0, 9.2) is None                        # the level is normal now


def test_a_burst_survives_a_checkpoint_and_accept_after_is_validated():
    ctl = make(rewind=False)
    normal(ctl)
    for step in range(40, 47):
        a = ctl.detect(step, 2.0, 9.0)
        ctl.observe_step(step, a, None, not_precision(a))
    again = make(rewind=False)
    again.load_state_dict(ctl.state_dict())
    a = again.detect(47, 2.0, 9.0)
    assert again.observe_step(47, a, None, not_precision(a)).action is Action.CONTINUE   # the 8th in a row
    with pytest.raises(Exception, match="accept_after"):
        parse_rollout({"attribution": {"accept_after": 1}, "stages": []})
    with pytest.raises(ValueError, match="accept_after"):
        ControllerConfig(accept_after=0)
