"""Telemetry's phases under FSDP2, the engine of `lowprec run`'s data parallelism (`FullyShardedDP`
alone, and on `build_mesh`'s mesh through `data_parallel`, as every layout but pp runs): a
forward's time is lapped as forward and a backward's as backward (before, the whole step was
reported as backward). One rank, gloo."""

import time

import torch
from torch import nn

from lowprec.tracking.phases import CpuLapClock, Phase

FORWARD_S, BACKWARD_S = 0.08, 0.04


class _Slow(nn.Module):
    """A block whose forward takes FORWARD_S and whose backward takes BACKWARD_S (sleeps)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h):
        time.sleep(FORWARD_S)
        h = self.fc(h)
        if h.requires_grad:
            h.register_hook(lambda g: time.sleep(BACKWARD_S))
        return h


class _Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Slow()])

    def forward(self, x, y):
        return nn.functional.mse_loss(self.blocks[0](x), y)


def _engines():
    from lowprec.runtime.engines.fsdp import FullyShardedDP
    from lowprec.runtime.engines.mesh import build_mesh
    from lowprec.runtime.engines.parallel import data_parallel
    clock = CpuLapClock()
    yield "hsdp_tp", data_parallel(_Model(), build_mesh("cpu"), 1, clock=clock), clock
    clock = CpuLapClock()
    yield "fsdp2", FullyShardedDP(_Model(), clock=clock), clock


def test_forward_and_backward_are_lapped_as_such(one_rank):
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    for name, engine, clock in _engines():   # each engine gets its clock at construction
        engine.forward_backward(x, y)   # the first step: FSDP2's lazy initialisation
        clock.end_pass()
        clock.flush()                   # its laps are dropped
        engine.forward_backward(x, y)
        clock.end_pass()
        laps = clock.flush()[0]
        shown = {p.value: round(s, 3) for p, s in laps.items()}
        assert laps.get(Phase.FORWARD, 0.0) >= FORWARD_S, (name, shown)
        assert BACKWARD_S <= laps.get(Phase.BACKWARD, 0.0) < FORWARD_S, (name, shown)
