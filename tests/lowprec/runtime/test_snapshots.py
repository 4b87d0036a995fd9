"""In-memory and disk snapshots: what a rewind restores, how many are kept, which one is picked."""

from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from lowprec.state.checkpoint import save_checkpoint
from lowprec.runtime.trainer.data import TokenBatches
from lowprec.runtime.session.snapshots import DiskSnapshots, MemorySnapshots


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 4))
    data = TokenBatches(torch.arange(500) % 50, batch_size=4, block_size=8)
    return model, opt, sched, data


def _train_step(model, opt, sched, data):
    x, _ = data.next()
    model(x.float()).pow(2).mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_memory_snapshot_restores_model_optimizer_scheduler_and_rng_bit_for_bit():
    model, opt, sched, data = _setup()
    snaps = MemorySnapshots(model, opt, every=5, keep=2, margin=5, scheduler=sched, data=data)
    for step in range(10):
        snaps.after_step(step)
        _train_step(model, opt, sched, data)
        if step == 4:   # the state after 5 steps, which the snapshot at 5 must give back
            want = ({k: v.clone() for k, v in model.state_dict().items()},
                    {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()},
                    sched.state_dict(), torch.get_rng_state().clone(), random.getstate())
    assert snaps.steps == [0, 5]
    position = data.position
    back = snaps.restore(step=10, skip_batches=3)
    assert back == 5
    assert _same(model.state_dict(), want[0])
    for i, s in opt.state_dict()["state"].items():
        assert _same(s, want[1][i])
    assert sched.state_dict() == want[2] and opt.param_groups[0]["lr"] == sched.get_last_lr()[0]
    assert torch.equal(torch.get_rng_state(), want[3]) and random.getstate() == want[4]
    assert data.position == position + 3   # the data goes on, past the skipped batches
    # the live parameters are the same objects (the optimizer still steps them)
    assert all(p is q for p, q in zip(model.parameters(), opt.param_groups[0]["params"]))


def test_memory_snapshots_keep_a_bounded_number_and_pick_one_old_enough():
    model, opt, sched, data = _setup()
    snaps = MemorySnapshots(model, opt, every=5, keep=3, margin=10, scheduler=sched, data=data)
    for step in range(31):
        snaps.after_step(step)
        if step < 30:
            _train_step(model, opt, sched, data)
    assert snaps.steps == [20, 25, 30]
    assert snaps.nbytes() > 0
    assert snaps.restore(step=29, skip_batches=0) is None    # none is 10 steps back
    assert snaps.restore(step=36, skip_batches=0) == 25       # the newest old enough
    assert snaps.steps == [20, 25]                             # newer ones are abandoned
    snaps.take(27)
    assert snaps.steps == [20, 25, 27]


def test_memory_snapshots_refuse_nonsense():
    model, opt, _, _ = _setup()
    with pytest.raises(ValueError, match="every >= 1"):
        MemorySnapshots(model, opt, every=0)


def test_disk_snapshots_rewind_through_checkpoints(tmp_path):
    model, opt, sched, data = _setup()
    for step in range(12):
        if step % 4 == 0:
            save_checkpoint(tmp_path, step, model=model, optimizer=opt, data_state=data.state_dict(),
                            extra={"scheduler": sched.state_dict()})
            if step == 4:
                want = {k: v.clone() for k, v in model.state_dict().items()}, sched.state_dict()
        _train_step(model, opt, sched, data)
    snaps = DiskSnapshots(tmp_path, model, opt, margin=6, scheduler=sched, data=data)
    assert snaps.restore(step=11, skip_batches=2) == 4
    assert _same(model.state_dict(), want[0]) and sched.state_dict() == want[1]
