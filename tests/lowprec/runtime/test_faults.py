"""`nan_one`: one NaN element, the first row's first column, in one process (rank 0).

Under torchrun it lands on rank 0 only: tests/lowprec/sites/fast_path/test_fast_path_faults.py
(DP 2 x TP 2, every rank decides the same fallback at the same step).
"""

from __future__ import annotations

import torch
from torch import nn

from lowprec.runtime.faults import FaultKind, Faults, parse_injection


def test_nan_one_plants_one_element_of_the_site_output():
    j = parse_injection("nan_one:lin:1:2")
    assert j.kind is FaultKind.NAN_ONE and j.site == "lin"
    model = nn.Sequential()
    model.add_module("lin", nn.Linear(4, 3))
    model.lin.format = type("F", (), {"is_high_precision": False})()   # a low-precision site
    faults = Faults(model, [j])
    x = torch.randn(2, 5, 4)
    clean = model(x)
    faults.tick(1)
    out = model(x)
    bad = torch.isnan(out)
    assert bad.sum() == 1 and bad[0, 0, 0]
    assert torch.equal(out[~bad], clean[~bad])
    faults.tick(2)
    assert not torch.isnan(model(x)).any()
