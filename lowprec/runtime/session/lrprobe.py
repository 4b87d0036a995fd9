"""`LRProbe`: how much the loss would change if the learning rate were larger or smaller.

From the current weights, on a held batch (the same batch every time, never a training
batch), the probe measures

    L0     the held batch's loss, with its gradients (one forward and backward)
    L_f    for each factor f (default 2 and 0.5): every param group's lr times f, one
           `optimizer.step()` on those gradients, the held loss again (no gradients), and
           everything put back

and reports

    sensitivity = (L_up - L_down) / |L0|

where `up` is the largest factor and `down` the smallest. Below zero, the larger step
lowers the held loss more than the smaller one: the learning rate is on the safe side of
the locally best step size. Above zero, doubling it hurts more than halving it: the step
is past the locally best size, and the loss is close to where a larger learning rate
makes it spike. The number grows as a learning-rate schedule steepens, before the
training loss itself moves (tests/lowprec/runtime/test_lrprobe_signal.py).

Nothing the probe touches stays changed, bit for bit: parameters, optimizer state
(AdamW's moments and step counts), the param groups' learning rates, gradients (the
probe starts from none and gives back what there was), the RNG states
(`lowprec.state.checkpoint.rng_state`), and the precision layers' side effects: quantizer
statistics are off during the probe (`PrecisionState.collecting_stats`: each site's setting and its
last statistics come back as they were), and delayed-scaling amax histories and the sites'
own generators are put back. Each of the three evaluations starts from the same RNG and
precision state, so dropout masks and delayed scales are the same in all of them and
the differences are the learning rate's alone.

The training loop runs it at the start of a check step, before the step's batch: no
gradients exist then (`lowprec.runtime.Session`, `rollout.lr_probe` in docs/config.md).
A Transformer Engine site keeps FP8 state the probe cannot put back; such states are
refused.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from lowprec.state.rng import restore_rng_state, rng_state
from lowprec.runtime.engines.engine import loss_of

__all__ = ["LRProbe", "ProbeResult"]


@dataclass(frozen=True)
class ProbeResult:
    """One probe: the held loss now, after a virtual step at each lr factor, and the signal."""

    step: int
    loss: float                               # L0
    losses: tuple[tuple[float, float], ...]   # (factor, L_factor), in the probe's factor order
    sensitivity: float                        # (L_up - L_down) / |L0|; see the module docstring

    def loss_at(self, factor: float) -> float:
        return dict(self.losses)[factor]


def _sensitivity(l0: float, losses: dict[float, float]) -> float:
    up, down = losses[max(losses)], losses[min(losses)]
    if not (math.isfinite(l0) and math.isfinite(up) and math.isfinite(down)) or l0 == 0:
        return math.inf if not math.isfinite(up) else math.nan
    return (up - down) / abs(l0)


class _Saved:
    """Everything a probe may change, taken before it and put back after (see the docstring)."""

    def __init__(self, params: list[nn.Parameter], optimizer: torch.optim.Optimizer, state):
        self.params, self.optimizer, self.state = params, optimizer, state
        with torch.no_grad():
            self.values = [p.detach().clone() for p in params]
        self.grads = [p.grad for p in params]           # the tensors themselves: the probe sets new ones
        self.lrs = [g["lr"] for g in optimizer.param_groups]
        self.opt_state = {p: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
                          for p, s in optimizer.state.items()}
        self.rng = rng_state()
        self.scaling = state.scaling_state() if state is not None else {}

    def precision_and_rng(self) -> None:
        """Put back the RNG states and the sites' histories and generators (before each evaluation)."""
        restore_rng_state(self.rng)
        if self.state is not None:
            self.state.load_scaling_state(self.scaling)

    @torch.no_grad()
    def weights_and_optimizer(self) -> None:
        """Put back the parameters, the optimizer's state and the learning rates (after a virtual step)."""
        for p, v in zip(self.params, self.values):
            p.copy_(v)
        opt = self.optimizer
        for p in [p for p in opt.state if p not in self.opt_state]:
            del opt.state[p]   # the virtual step was this parameter's first
        for p, saved in self.opt_state.items():
            cur = opt.state[p]
            for k in [k for k in cur if k not in saved]:
                del cur[k]
            for k, v in saved.items():
                old = cur.get(k)
                if isinstance(v, torch.Tensor) and isinstance(old, torch.Tensor) and old.shape == v.shape \
                        and old.dtype == v.dtype and old.device == v.device:
                    old.copy_(v)
                else:
                    cur[k] = v.clone() if isinstance(v, torch.Tensor) else v
        for g, lr in zip(opt.param_groups, self.lrs):
            g["lr"] = lr

    def everything(self) -> None:
        self.weights_and_optimizer()
        self.precision_and_rng()
        for p, g in zip(self.params, self.grads):
            p.grad = g


class LRProbe:
    """Measures the loss change of a virtual optimizer step at other learning rates (see the module docstring)."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                 forward_backward: Callable[[], torch.Tensor], held_loss: Callable[[], torch.Tensor], *,
                 state=None, clip: Callable[[], torch.Tensor] | None = None,
                 factors: tuple[float, ...] = (2.0, 0.5), every_checks: int = 5):
        """forward_backward(): the held batch's loss, its gradients accumulated into `.grad`
        (the same scaling as a training step); held_loss(): the held batch's loss without
        gradients. Both see the same batch every time.
        state: the model's PrecisionState (None: no precision sites to look after).
        clip: what the training step does to the gradients before `optimizer.step()` (the
            session's clip), so that the virtual step is the step training would take.
        factors: learning-rate multipliers, at least two, one above 1 and one below.
        every_checks: the session runs the probe at every this-many-th check step."""
        factors = tuple(float(f) for f in factors)
        if len(factors) < 2 or len(set(factors)) != len(factors) or min(factors) <= 0 \
                or not min(factors) < 1 < max(factors):
            raise ValueError(f"LR probe factors must be distinct, positive, one below 1 and one above "
                             f"(e.g. [2.0, 0.5]); got {list(factors)}")
        if every_checks < 1:
            raise ValueError(f"every_checks must be >= 1, got {every_checks}")
        if state is not None:
            no_history = [f for f, s in state.sites.items() if not hasattr(s.module, "histories")]
            if no_history:
                raise ValueError(f"the LR probe cannot put back the FP8 state of sites such as {no_history[0]!r} "
                                 f"(backend {getattr(state.backend, 'name', state.backend)!r} keeps its own); "
                                 f"turn rollout.lr_probe off with this backend")
        self.model, self.optimizer, self.state = model, optimizer, state
        self.forward_backward, self.held_loss, self.clip = forward_backward, held_loss, clip
        self.factors, self.every_checks = factors, every_checks
        self.results: list[ProbeResult] = []   # every probe run, in order (a rewound stretch probes again)
        ids = {id(p) for p in model.parameters()}
        self.params = list(model.parameters()) + [p for g in optimizer.param_groups for p in g["params"]
                                                   if id(p) not in ids]

    @classmethod
    def for_model(cls, model: nn.Module, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor],
                  **kwargs) -> "LRProbe":
        """A probe on a held batch `(x, y)`, with the loss `model(x, y)` returns (`loss_of`)."""
        x, y = batch

        def forward_backward() -> torch.Tensor:
            loss = loss_of(model(x, y))
            loss.backward()
            return loss.detach()

        def held_loss() -> torch.Tensor:
            return loss_of(model(x, y))
        return cls(model, optimizer, forward_backward, held_loss, **kwargs)

    @classmethod
    def for_engine(cls, engine, optimizer: torch.optim.Optimizer, batch: tuple[torch.Tensor, torch.Tensor],
                   **kwargs) -> "LRProbe":
        """A probe through an engine (`lowprec.runtime.engines.engine`): its `forward_backward(x, y)`
        and its forward-only `loss(x, y)`, which an engine must have for the probe."""
        if not callable(getattr(engine, "loss", None)):
            raise TypeError(f"the LR probe needs a forward-only loss, and the {type(engine).__name__} engine has no "
                            f"loss(x, y) method; give it one (the global batch-mean loss without gradients, on "
                            f"every rank) or turn rollout.lr_probe off")
        x, y = batch
        return cls(engine.module, optimizer, lambda: engine.forward_backward(x, y), lambda: engine.loss(x, y),
                   **kwargs)

    def is_due(self, check_index: int) -> bool:
        """Whether the `check_index`-th regular check (1, 2, ...) runs the probe."""
        return check_index >= 1 and check_index % self.every_checks == 0

    def __call__(self, step: int) -> ProbeResult:
        """Probe from the current weights; afterwards everything is as it was (module docstring)."""
        saved = _Saved(self.params, self.optimizer, self.state)
        # no statistics during the probe; each site's setting and last statistics come back
        with self.state.collecting_stats(False) if self.state is not None else contextlib.nullcontext():
            try:
                for p in self.params:
                    p.grad = None
                l0 = float(self.forward_backward().detach().float())
                if self.clip is not None:
                    self.clip()
                saved.precision_and_rng()
                losses = {}
                for f in self.factors:
                    for g, lr in zip(self.optimizer.param_groups, saved.lrs):
                        g["lr"] = lr * f
                    self.optimizer.step()
                    with torch.no_grad():
                        losses[f] = float(self.held_loss().detach().float())
                    saved.weights_and_optimizer()
                    saved.precision_and_rng()
            finally:
                saved.everything()
        result = ProbeResult(step, l0, tuple(losses.items()), _sensitivity(l0, losses))
        self.results.append(result)
        return result
