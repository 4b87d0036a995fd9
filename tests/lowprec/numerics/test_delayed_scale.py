"""Delayed scaling's scale is `(max / amax) / 2**margin` correctly rounded to FP32, as
`DelayedScalingConfig` documents it: against a float64 quotient rounded once to FP32 over
every FP32 amax of one binade (a power of two scales the quotient exactly, so one binade
holds every rounding case), and against exact rational arithmetic (fractions.Fraction, the
nearest FP32 chosen among the neighbours, ties to even) on amaxes hypothesis draws over
the whole range. PyTorch's `float / tensor` (reciprocal, then a product) was 1 ulp off for
about a quarter of amaxes (amax 0.7598235607147217: 589.6105346679688, not 589.610595703125).
"""

from __future__ import annotations

from fractions import Fraction

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lowprec.numerics.delayed import AmaxHistory, history_scale
from lowprec.numerics.formats import E4M3, E5M2, DelayedScalingConfig

ELEMS = [E4M3, E5M2]


def _scales(amaxes: torch.Tensor, elem, margin: int) -> torch.Tensor:
    """history_scale of a one-entry history per amax (most_recent: that entry)."""
    return torch.stack([history_scale(a.reshape(1), torch.tensor(1), elem, margin, True) for a in amaxes])


def _nearest_fp32(q: Fraction) -> float:
    """The FP32 nearest to the rational q > 0 (ties to the even significand), by exact comparison."""
    c = np.float32(float(q))
    cands = {c, np.nextafter(c, np.float32(0)), np.nextafter(c, np.float32(np.inf))}
    cands = [x for x in cands if np.isfinite(x)]
    best = min(abs(Fraction(float(x)) - q) for x in cands)
    tied = [x for x in cands if abs(Fraction(float(x)) - q) == best]
    return float(min(tied, key=lambda x: int(np.array(x).view(np.int32)) & 1))


def test_the_example_of_the_issue():
    a = torch.tensor([0.7598235607147217])
    assert _scales(a, E4M3, 0).item() == 589.610595703125


@pytest.mark.parametrize("elem", ELEMS, ids=lambda e: e.name)
def test_every_amax_of_a_binade(elem):
    """All 2**23 FP32 amaxes in [1, 2), each a history of its own (history_scale vmapped over
    them), against the float64 quotient rounded once; a sample again through plain calls."""
    amax = torch.arange(0x3F800000, 0x40000000, dtype=torch.int32).view(torch.float32)
    want = torch.from_numpy((np.float64(elem.max) / amax.double().numpy()).astype(np.float32))
    count = torch.tensor(1)
    got = torch.vmap(lambda a: history_scale(a.reshape(1), count, elem, 0, True))(amax)
    bad = (got != want).sum().item()
    assert bad == 0, f"{bad} of {amax.numel()} amaxes off for {elem.name}"
    assert torch.equal(_scales(amax[::4099], elem, 1), want[::4099] / 2)


@settings(max_examples=500, deadline=None, derandomize=True)
@given(amax=st.floats(min_value=2.0 ** -126, max_value=float(np.finfo(np.float32).max), width=32), margin=st.integers(0, 4),
       elem=st.sampled_from(ELEMS))
def test_against_exact_rational_arithmetic(amax, margin, elem):
    got = _scales(torch.tensor([amax], dtype=torch.float32), elem, margin).item()
    q = Fraction(elem.max) / Fraction(amax)
    if q >= Fraction(float(np.finfo(np.float32).max)) + 2 ** 103:   # max / amax rounds to infinity in FP32
        assert got == 1.0   # an infinite scale: 1, as for an empty history
        return
    want = _nearest_fp32(q) / 2 ** margin   # exact but where it leaves the normal range
    assert got == np.float32(want), (amax, margin, elem.name, got, want)


def test_amax_history_uses_it():
    hist = AmaxHistory(DelayedScalingConfig(history_len=4, margin=1), E4M3)
    hist.record(torch.tensor(0.25))
    hist.record(torch.tensor(0.7598235607147217))
    assert hist.scale().item() == 589.610595703125 / 2
