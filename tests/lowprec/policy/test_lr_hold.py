"""A rising learning-rate sensitivity holds the next promotion (RolloutController._promote)."""

from __future__ import annotations

import math

import pytest

from lowprec.policy.controller import (LR_HISTORY, ControllerConfig, RolloutController, Stage, lr_hold_level,
                                lr_sensitivity_hold)
from lowprec.policy.events import EventKind
from lowprec.policy.monitor import Signals
from lowprec.policy.rollout import parse_rollout

SITES = ["a", "b"]
LADDER = ("fp8_tensorwise", "bf16")


def make(hold_rise=0.04, hold_above=0.0, min_steps=20):
    cfg = ControllerConfig(min_steps=min_steps, lr_hold_rise=hold_rise, lr_hold_above=hold_above)
    return RolloutController({s: LADDER for s in SITES}, {s: "bf16" for s in SITES},
                             [Stage("first", ("a",), "fp8_tensorwise"), Stage("second", ("b",), "fp8_tensorwise")], cfg)


def check(ctl, step, sens=None):
    return ctl.observe_step(step, signals=Signals(step, [2.0] * 10, [1.0] * 10, lr_sensitivity=sens))


def history(*values):
    return [(10 * i + 9, v) for i, v in enumerate(values)]


def test_the_hold_level_is_the_lower_of_hold_above_and_the_recent_median_plus_hold_rise():
    assert LR_HISTORY == 4
    four = history(-0.02, -0.03, -0.01, -0.02)             # median -0.02
    # hold_above applies from the first probe; the rise once four probes came before
    assert lr_hold_level(four[:1], 0.04, 0.0) == (0.0, {"hold_above": 0.0})
    assert lr_hold_level(four, 0.04, None) == (None, {})
    level, how = lr_hold_level(four + [(49, 0.5)], 0.04, 0.1)
    assert level == pytest.approx(-0.02 + 0.04) and how == {"hold_above": 0.1, "median_before": -0.02,
                                                            "hold_rise": 0.04}
    assert lr_hold_level(four + [(49, 0.5)], 0.04, 0.0)[0] == 0.0
    assert lr_hold_level(four + [(49, 0.5)], None, None) == (None, {})
    # only the four values before the newest count, and non-finite ones among them do not
    assert lr_hold_level(history(5.0, math.inf, -0.02, -0.02, -0.02, 0.03), 0.04, None)[1]["median_before"] == -0.02


def test_a_sensitivity_above_its_level_holds_an_infinite_one_too_a_nan_never():
    four = history(-0.02, -0.03, -0.01, -0.02)
    held, ev = lr_sensitivity_hold(four + [(49, 0.0201)], 0.04, None)   # rose 0.0401 above the median
    assert held and ev == {"lr_sensitivity": 0.0201, "probe_step": 49, "hold_level": pytest.approx(0.02),
                           "median_before": -0.02, "hold_rise": 0.04}
    assert not lr_sensitivity_hold(four + [(49, 0.0199)], 0.04, None)[0]
    assert lr_sensitivity_hold(four[:1] + [(19, 0.001)], 0.04, 0.0)[0]    # above 0: held with two probes
    assert not lr_sensitivity_hold(four[:1] + [(19, -0.001)], 0.04, 0.0)[0]
    assert lr_sensitivity_hold(four + [(49, math.inf)], 0.04, 0.0)[0]       # the larger virtual step diverged
    assert not lr_sensitivity_hold(four + [(49, math.nan)], 0.04, 0.0)[0]
    assert lr_sensitivity_hold([], 0.04, 0.0) == (False, {})


def test_the_promotion_waits_until_the_sensitivity_is_back_below_its_level():
    ctl = make()
    for i, v in enumerate([-0.02, -0.02, -0.021, -0.019]):   # probes at checks 9, 19, 29, 39
        check(ctl, 10 * i + 9, v)
    assert ctl.promoted == 1   # at 29 (min_steps 20)
    d = check(ctl, 49, 0.05)   # the next promotion is due at 49: the probe of this check is above 0
    held = [e for e in d.events if e.kind == EventKind.HOLD]
    assert len(held) == 1 and not d.changes and ctl.promoted == 1
    e = held[0]
    assert e.stage == "second" and e.evidence["lr_sensitivity"] == 0.05 and e.evidence["probe_step"] == 49
    assert e.evidence["hold_level"] == 0.0 and "LR sensitivity 0.05" in e.reason
    assert ctl.stable_since == 49   # asked again after another min_steps, as an inconclusive gate
    assert not check(ctl, 59).events   # no probe at this check, too soon anyway
    d = check(ctl, 69)                 # due again; the newest probe (49) is still above: held again
    assert [e.kind for e in d.events] == [EventKind.HOLD]
    assert not check(ctl, 79, -0.01).events
    d = check(ctl, 89, -0.012)   # below 0 and 0.008 above the median of (-0.021, -0.019, 0.05, -0.01)
    assert [e.kind for e in d.events] == [EventKind.PROMOTE] and ctl.promoted == 2


def test_a_rise_alone_holds_with_hold_above_off():
    ctl = make(hold_above=None)
    for i, v in enumerate([-0.05, -0.05, -0.05, -0.05]):
        check(ctl, 10 * i + 9, v)
    d = check(ctl, 49, -0.005)   # below 0 but 0.045 above the median
    assert [e.kind for e in d.events] == [EventKind.HOLD] and d.events[0].evidence["median_before"] == -0.05


def test_without_hold_levels_the_sensitivity_never_holds():
    ctl = make(hold_rise=None, hold_above=None)
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
    off = parse_rollout({"stages": stages}).controller_config()
    assert off.lr_hold_rise is None and off.lr_hold_above is None
    on = parse_rollout({"stages": stages, "lr_probe": {"enabled": True, "hold_rise": 0.1, "hold_above": None}})
    assert on.controller_config().lr_hold_rise == 0.1 and on.controller_config().lr_hold_above is None
    default = parse_rollout({"stages": stages, "lr_probe": True}).controller_config()
    assert (default.lr_hold_rise, default.lr_hold_above) == (0.04, 0.0)
