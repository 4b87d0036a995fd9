"""A rising learning-rate sensitivity holds the next promotion (RolloutController._promote)."""

from __future__ import annotations

import math

import pytest

from lowprec.controller import LR_HISTORY, ControllerConfig, RolloutController, Stage, lr_sensitivity_rising
from lowprec.events import EventKind
from lowprec.monitor import Signals
from lowprec.rollout import parse_rollout

SITES = ["a", "b"]
LADDER = ("fp8_tensorwise", "bf16")


def make(hold_rise=0.04, min_steps=20):
    cfg = ControllerConfig(min_steps=min_steps, lr_hold_rise=hold_rise)
    return RolloutController({s: LADDER for s in SITES}, {s: "bf16" for s in SITES},
                             [Stage("first", ("a",), "fp8_tensorwise"), Stage("second", ("b",), "fp8_tensorwise")], cfg)


def check(ctl, step, sens=None):
    return ctl.observe_step(step, signals=Signals(step, [2.0] * 10, [1.0] * 10, lr_sensitivity=sens))


def test_rising_is_the_newest_value_above_the_median_of_the_ones_before_by_more_than_hold_rise():
    h = [(i, v) for i, v in enumerate([-0.02, -0.03, -0.01, -0.02])]
    assert lr_sensitivity_rising(h, 0.04) == (False, {})                      # not judged before LR_HISTORY + 1
    assert LR_HISTORY == 4
    median = -0.02   # of -0.02, -0.03, -0.01, -0.02
    rising, ev = lr_sensitivity_rising(h + [(4, median + 0.0401)], 0.04)
    assert rising and ev == {"lr_sensitivity": median + 0.0401, "probe_step": 4, "median_before": median,
                             "hold_rise": 0.04}
    assert not lr_sensitivity_rising(h + [(4, median + 0.0399)], 0.04)[0]
    assert lr_sensitivity_rising(h + [(4, math.inf)], 0.04)[0]               # the larger virtual step diverged
    assert not lr_sensitivity_rising(h + [(4, math.nan)], 0.04)[0]
    # only the LR_HISTORY values before the newest count, and non-finite ones among them do not
    old = [(0, 5.0)] + [(i + 1, v) for i, v in enumerate([math.inf, -0.02, -0.02, -0.02])]
    assert lr_sensitivity_rising(old + [(5, 0.03)], 0.04)[1]["median_before"] == -0.02


def test_a_rising_sensitivity_holds_the_promotion_until_it_stops_rising():
    ctl = make()
    for i, v in enumerate([-0.02, -0.02, -0.021, -0.019]):   # probes at checks 9, 19, 29, 39
        d = check(ctl, 10 * i + 9, v)
    assert ctl.promoted == 1   # promoted at 29 (min_steps 20), before any judgement was possible
    d = check(ctl, 49, 0.05)   # rose 0.07 above the median of the four before it
    held = [e for e in d.events if e.kind == EventKind.HOLD]
    assert len(held) == 1 and not d.changes and ctl.promoted == 1
    e = held[0]
    assert e.stage == "second" and e.evidence["lr_sensitivity"] == 0.05 and e.evidence["probe_step"] == 49
    assert e.evidence["median_before"] == pytest.approx(-0.02) and "LR sensitivity" in e.reason
    assert ctl.stable_since == 49   # asked again after another min_steps, as an inconclusive gate
    assert not check(ctl, 59).events   # no probe at this check, too soon anyway
    d = check(ctl, 69)                 # due again; the newest probe (49) still rose: held again
    assert [e.kind for e in d.events] == [EventKind.HOLD]
    assert not check(ctl, 79, 0.05).events   # the probes level off at the new value
    d = check(ctl, 89, 0.05)   # 0.05 is 0.0345 above the median of (-0.021, -0.019, 0.05, 0.05): not rising
    assert [e.kind for e in d.events] == [EventKind.PROMOTE] and ctl.promoted == 2


def test_without_hold_rise_the_sensitivity_never_holds():
    ctl = make(hold_rise=None)
    for i, v in enumerate([-0.02] * 4 + [5.0]):
        check(ctl, 10 * i + 9, v)
    assert ctl.promoted == 2


def test_the_probe_history_rides_in_the_state_dict():
    ctl = make()
    for i, v in enumerate([-0.02, -0.01, 0.0, 0.01, 0.02, 0.03]):
        check(ctl, 10 * i + 9, v)
    sd = ctl.state_dict()
    assert sd["lr_history"] == [[19, -0.01], [29, 0.0], [39, 0.01], [49, 0.02], [59, 0.03]]   # the last five
    other = make()
    other.load_state_dict(sd)
    assert other.lr_history == ctl.lr_history
    del sd["lr_history"]   # a state written before the probe existed
    other.load_state_dict(sd)
    assert other.lr_history == []


def test_the_rollout_section_turns_the_hold_on_with_the_probe():
    stages = [{"select": {"glob": "*"}, "format": "fp8_tensorwise"}]
    assert parse_rollout({"stages": stages}).controller_config().lr_hold_rise is None
    on = parse_rollout({"stages": stages, "lr_probe": {"enabled": True, "hold_rise": 0.1}})
    assert on.controller_config().lr_hold_rise == 0.1
    assert parse_rollout({"stages": stages, "lr_probe": True}).lr_probe.enabled
