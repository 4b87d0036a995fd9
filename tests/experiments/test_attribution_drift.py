"""experiments/attribution_drift.py: the planted drift faults reach what they claim to reach.

The eval-gate kinds plant their training fault (an earlier version mapped `eval_scale` to a
kind that did not exist, so the held-out eval never saw it), and a precision fault acts in the
held-out eval's forward as in training, only while its site runs below BF16.
"""

import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from experiments.attribution_bench import PLAN  # noqa: E402
from experiments.attribution_drift import FAULT_AT, OTHER, PRECISION, Drift, PlantedDrift, held_out_loss  # noqa: E402
from experiments.model import build_gpt  # noqa: E402
from lowprec.policy.decisions import Decision, apply_decision  # noqa: E402
from lowprec.runtime import Session  # noqa: E402
from lowprec.sites.plan import PrecisionPlan  # noqa: E402

SITE = "blocks.0.mlp.proj"


def _small():
    torch.manual_seed(0)
    model = build_gpt(vocab_size=256, block_size=32, n_layer=2, n_head=2, d_model=32)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    session = Session.build(model, opt, PrecisionPlan.from_dict(PLAN), None)
    g = torch.Generator().manual_seed(1)
    batch = [(torch.randint(0, 256, (4, 32), generator=g), torch.randint(0, 256, (4, 32), generator=g))]
    return model, session, batch


def test_every_eval_gate_kind_plants_a_training_fault_of_the_campaign():
    for kind in ("eval_scale", "eval_shuffle"):
        fault = Drift(kind, 0, SITE)
        assert fault.eval_gate and fault.base_kind in PRECISION + OTHER and not fault.base_kind.startswith("eval_")
    assert Drift("eval_scale", 0).precision and not Drift("eval_shuffle", 0).precision
    assert Drift("slight_scale", 0).base_kind == "slight_scale" and not Drift("slight_scale", 0).eval_gate


def test_eval_scale_reaches_the_held_out_forward_while_the_site_is_low_precision():
    model, session, batch = _small()
    try:
        apply_decision(session.state, Decision(changes={SITE: "fp8_tensorwise"}))
        clean = held_out_loss(model, batch)
        with session.state.high_precision([SITE]):
            clean_bf16 = held_out_loss(model, batch)
        planted = PlantedDrift(Drift("eval_scale", 0, SITE), model, session.state)
        planted.t = FAULT_AT - 1
        assert held_out_loss(model, batch) == clean            # not active before FAULT_AT
        planted.t = FAULT_AT + 30
        assert held_out_loss(model, batch) != clean            # the wrong scale is in the eval forward
        with session.state.high_precision([SITE]):
            assert held_out_loss(model, batch) == clean_bf16   # and only in the low-precision path
        planted.remove()
        assert held_out_loss(model, batch) == clean
    finally:
        session.close()


def test_step_layer_hits_one_layer_outside_the_first_subset_on_its_fixed_passes():
    from experiments.attribution_drift import FIRST_SUBSET, campaign
    model, session, batch = _small()
    try:
        low = sorted(session.state.sites)
        faults = campaign(low, ["step_layer"])
        assert len(faults) == 3 and not any(FIRST_SUBSET.match(f.site) for f in faults)
        assert FIRST_SUBSET.match("blocks.1.mlp.fc") and FIRST_SUBSET.match("blocks.2.mlp.proj")
        fault = faults[0]
        assert not fault.precision
        clean = held_out_loss(model, batch)
        planted = PlantedDrift(fault, model, session.state)
        for t, active in ((FAULT_AT - 1, False), (FAULT_AT, True), (FAULT_AT + 3, True), (FAULT_AT + 4, False)):
            planted.t = t
            assert (held_out_loss(model, batch) != clean) == active, t
        planted.remove()
        planted.t = FAULT_AT
        assert held_out_loss(model, batch) == clean
    finally:
        session.close()


def test_a_precision_fault_keyed_by_step_follows_the_step_run_not_the_loop_pass():
    """`--onset-by-step`: a window trained again from a snapshot before FAULT_AT (loop pass
    well past it, the steps before it) meets the wrong scale only from FAULT_AT on; keyed by
    loop pass (the default) it meets it from the window's start."""
    model, session, batch = _small()
    try:
        apply_decision(session.state, Decision(changes={SITE: "fp8_tensorwise"}))
        clean = held_out_loss(model, batch)
        by_pass = PlantedDrift(Drift("slight_scale", 0, SITE), model, session.state)
        by_pass.t, by_pass.step = FAULT_AT + 4, FAULT_AT - 5
        assert held_out_loss(model, batch) != clean            # the loop's pass is past FAULT_AT
        by_pass.remove()
        by_step = PlantedDrift(Drift("slight_scale", 0, SITE), model, session.state, by_step=True)
        by_step.t = FAULT_AT + 4
        for step, active in ((FAULT_AT - 5, False), (FAULT_AT - 1, False), (FAULT_AT, True), (FAULT_AT + 3, True)):
            by_step.step = step
            assert (held_out_loss(model, batch) != clean) == active, step
        by_step.remove()
    finally:
        session.close()
