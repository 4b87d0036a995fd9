"""Replaying an anomalous step exactly: the same batch, weights, RNG and scaling state.

`StepReplayer` is the session's half of `lowprec.policy.attribution`. When every step's first
forward begins (a forward pre-hook, armed by the session between steps), it keeps what a replay needs to start where the step started and
that the step itself changes: the torch RNG states (CPU and CUDA; dropout), each
site's stochastic-rounding generator, and the delayed-scaling amax histories (the
step's forward records into them). That is a few small copies per step, no device sync.

After backward, when the step is anomalous and before anything is applied,
`replay(closure, sites)` puts `sites` (this rank's part of them) in high precision,
restores the step-start state, zeroes the gradients, runs the caller's `closure` (the
same forward and backward on the same batch: the weights have not moved) and measures
the loss and the global grad norm as the step did. `finish()` then puts back the state
as the anomalous step left it (its RNG position, its amax histories), so that a run
with replays continues exactly as one without them would; the caller discards the
gradients. Quantizer statistics are off during replays, so they never mix into the
monitor's window.
"""

from __future__ import annotations

from typing import Callable

import torch

__all__ = ["StepReplayer"]


def _rng() -> dict:
    out = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _set_rng(s: dict) -> None:
    torch.set_rng_state(s["cpu"])
    if "cuda" in s:
        torch.cuda.set_rng_state_all(s["cuda"])


class StepReplayer:
    """Replays of the current step with chosen sites in high precision (see the module docstring)."""

    def __init__(self, state, optimizer: torch.optim.Optimizer, measure: Callable[[torch.Tensor], tuple[float, float]]):
        """state: the PrecisionState (this rank's sites). measure(loss) -> (loss, grad norm)
        on the host, as the session measures a step (clip, then the global values)."""
        self.state, self.optimizer, self.measure = state, optimizer, measure
        self._start: dict | None = None
        self._end: dict | None = None
        self._armed = False
        self._hook = None
        self.replays = 0

    def attach(self, model: torch.nn.Module) -> None:
        """Take the step-start state when the step's first forward begins (after the loop drew
        its batch, which may itself use the RNG): a pre-hook on `model`, armed by `arm()`;
        forwards without autograd (evaluations between steps) do not count."""
        def pre(module, args):
            if self._armed and torch.is_grad_enabled():   # an evaluation's forward is not the step's
                self.begin_step()
        self._hook = model.register_forward_pre_hook(pre)

    def arm(self) -> None:
        """A new step begins: its first forward keeps the step-start state."""
        self._armed = True

    def close(self) -> None:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None

    def _capture(self) -> dict:
        return {"rng": _rng(), "scaling": self.state.scaling_state()}

    def _restore(self, snap: dict) -> None:
        _set_rng(snap["rng"])
        self.state.load_scaling_state(snap["scaling"])

    def begin_step(self) -> None:
        """Keep the step-start state (call before the step's forward; the armed pre-hook does,
        and a caller whose step begins before the model's first forward may do it earlier,
        which disarms the hook)."""
        self._armed = False
        self._start = self._capture()
        self._end = None

    def replay(self, closure: Callable[[], torch.Tensor], sites: tuple[str, ...]) -> tuple[float, float]:
        """(loss, grad norm) of the step run again with `sites` in high precision."""
        if self._start is None:
            raise RuntimeError("replay() needs begin_step() at the start of the step")
        if self._end is None:
            self._end = self._capture()
        local = [s for s in sites if s in self.state.sites]
        with self.state.collecting_stats(False), self.state.high_precision(local):
            self._restore(self._start)
            self.optimizer.zero_grad(set_to_none=True)
            loss = closure()
            values = self.measure(loss)
        self.replays += 1
        return values

    def finish(self) -> None:
        """After the replays: the state as the anomalous step left it; gradients zeroed."""
        if self._end is not None:
            self._restore(self._end)
            self._end = None
        self.optimizer.zero_grad(set_to_none=True)
