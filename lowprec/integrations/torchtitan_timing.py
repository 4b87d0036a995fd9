"""Where a torchtitan step's time goes: lowprec's telemetry laps in torchtitan's Trainer.

`lowprec run` times every step's phases, sorts the wall time into goodput buckets and logs
`time/*` and `throughput/*` with the training metrics, `telemetry/*` at the end and MLflow's
`system/*` beside them (`lowprec.tracking.telemetry`). Under torchtitan's Trainer the
`LowprecTrainer` does the same on rank 0, the rank that tracks (the other ranks run the same
step in lockstep: their times are rank 0's within the collectives' waits), at torchtitan's
steps (`lowprec.integrations.framework_steps`). `StepClock` laps where torchtitan's step
has a seam lowprec can see:

* data: around each batch torchtitan draws from its data iterator (`LowprecTrainer` wraps it);
* forward: when the model's forward returns inside torchtitan's forward-backward step (a
  forward hook on the model, on in the step only: evals, the LR probe and torchtitan's
  validator are not the step's forward); under pipeline parallelism the schedule interleaves
  forwards and backwards of micro-batches, so its whole step is booked as backward, as
  `lowprec run`'s pipeline engine books it;
* backward: when torchtitan's forward-backward step returns;
* optimizer, collectives, monitor, recovery (replays, rewinds), LR probe, snapshots: lapped
  by lowprec's session, as in every host; torchtitan's own clip (a measurement here) falls
  into the optimizer phase, as does its optimizer and scheduler step and its metrics logging;
* checkpoint: torchtitan's `checkpointer.save` (called after every step; it writes at its interval);
* the rest (torchtitan's validator, its garbage collection) is `other`, and the final eval `eval`.

Tokens per step: torchtitan's global count of valid tokens (labels not ignored), summed over
the data-parallel ranks: the run's throughput, not one rank's.
"""

from __future__ import annotations

import contextlib
import functools

from lowprec.state.ranks import process_rank
from lowprec.tracking.phases import NULL_CLOCK, Phase

__all__ = ["StepClock", "rank_telemetry"]


def rank_telemetry(config, *, device, model, state, started: float):
    """Rank 0's `Telemetry` when the run is tracked and `telemetry.enabled` (None otherwise:
    nothing would log it, and no lap is taken)."""
    if process_rank() != 0 or not config.tracking.enabled or not config.telemetry.enabled:
        return None
    from lowprec.tracking.telemetry import Telemetry
    return Telemetry(config.telemetry, device=device, model=model, state=state, started=started)


class StepClock:
    """The laps a LowprecTrainer takes in torchtitan's step (see the module docstring); with
    `telemetry` None every method costs a call and measures nothing."""

    def __init__(self, telemetry, model_parts, checkpointer, *, pipelined: bool):
        self.telemetry = telemetry
        self.clock = telemetry.clock if telemetry is not None else NULL_CLOCK
        self._begun = False
        self._in_step = False
        if telemetry is None:
            return
        if not pipelined:
            for m in model_parts:
                m.register_forward_hook(self._forward_done)
        if getattr(checkpointer, "enable", False):
            checkpointer.save = self._timed(checkpointer.save, Phase.CHECKPOINT)

    def _timed(self, fn, phase: Phase):
        @functools.wraps(fn)
        def timed(*args, **kwargs):
            self.clock.lap(Phase.OTHER)
            try:
                return fn(*args, **kwargs)
            finally:
                self.clock.lap(phase)
        return timed

    def _forward_done(self, module, args, output) -> None:
        if self._in_step:
            self.clock.lap(Phase.FORWARD)

    def step_begins(self) -> None:
        """torchtitan's train_step begins: the first one ends start-up (loading a checkpoint included)."""
        if self.telemetry is None:
            return
        if not self._begun:
            self._begun = True
            self.telemetry.begin()
        else:
            self.clock.lap(Phase.OTHER)

    def drawing(self) -> None:
        self.clock.lap(Phase.OTHER)

    def drawn(self) -> None:
        self.clock.lap(Phase.DATA)

    @contextlib.contextmanager
    def forward_backward(self, recording: bool):
        """torchtitan's forward-backward step of the step's own micro-batches (`recording`):
        its forward and backward lapped; a replay's is inside the session's recovery time."""
        self._in_step = recording
        try:
            yield
        finally:
            self._in_step = False
            if recording:
                self.clock.lap(Phase.BACKWARD)

    def stepped(self) -> None:
        """torchtitan's train_step returned: its optimizer and scheduler step, and its metrics."""
        self.clock.lap(Phase.OPTIMIZER)

    def tokens(self, global_valid_tokens) -> int:
        """The step's tokens over every data-parallel rank (read on the host only when timed)."""
        if self.telemetry is None or global_valid_tokens is None:
            return 0
        return int(global_valid_tokens)
