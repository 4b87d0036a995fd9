"""`tracked_map`: the one rule both hosts use for the precision map they report, in one process.

Two pipeline ranks' gather (each rank's own sites, a fallback on the rank that holds the site)
runs in tests/lowprec/integrations/test_torchtitan_trainer.py's pipeline launch; here the
choice itself and the gathered map's reading of live formats, its order and its refusal.
"""

from __future__ import annotations

import pytest
from torch import nn

from lowprec.sites.plan import PrecisionPlan
from lowprec.runtime.engines.parallel import local_state
from lowprec.runtime.session.tracked_map import GatheredPrecisionMap, regather, tracked_map
from lowprec.sites.precision_state import StagedPrecisionMap, prepare


def _state():
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 32), nn.Linear(32, 16))
    plan = PrecisionPlan.from_dict({"default": "fp8_tensorwise", "backend": "emulated"})
    return prepare(model, plan)


class _Controller:
    def __init__(self, current):
        self.current = current


def test_one_rank_holding_every_site_reports_its_own_state():
    state = _state()
    assert tracked_map(state) is state
    assert tracked_map(state, None, _Controller({})) is state


def test_stages_with_a_controller_report_its_record_over_the_whole_model():
    whole = _state()
    record = {**whole.formats(), "2": "bf16"}
    got = tracked_map(local_state(whole, ["0"]), whole, _Controller(record))
    assert isinstance(got, StagedPrecisionMap) and got.formats() == record
    assert got.flops_share() == whole.flops_share(record)


def test_stages_without_a_controller_report_the_sites_held_as_they_run_once_regathered():
    whole = _state()
    local = local_state(whole, ["3", "0", "2"])   # the ranks' sites: here one rank holds all
    got = tracked_map(local, whole)
    assert isinstance(got, GatheredPrecisionMap)
    assert list(got.formats()) == ["0", "2", "3"] and set(got.formats().values()) == {"fp8_tensorwise"}
    local.set_format("2", "bf16")             # a format loaded from a checkpoint: read again by regather
    assert got.formats()["2"] == "fp8_tensorwise"
    regather(got)
    assert got.formats() == {"0": "fp8_tensorwise", "2": "bf16", "3": "fp8_tensorwise"}
    assert got.flops_share() == whole.flops_share(got.formats()) and 0 < got.flops_share()["bf16"] < 1


def test_a_site_held_by_no_rank_is_refused():
    whole = _state()
    with pytest.raises(ValueError, match=r"1 of the model's 3 sites are held by no rank \(e.g. 2\)"):
        tracked_map(local_state(whole, ["0", "3"]), whole)
