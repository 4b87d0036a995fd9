"""Amax histories for delayed scaling, as Transformer Engine's `DelayedScaling` keeps them.

A delayed-scaling operand is quantized with a scale computed from the amaxes of
*earlier* iterations: `scale = (max / amax_h) / 2**margin`, where `amax_h` is the
maximum of the history or its most recent entry. The current amax is recorded after
use. Everything stays on the device: no host sync per step.

Two deliberate differences from Transformer Engine (NVIDIA/TransformerEngine issue #982: a layer
switched back to FP8 under delayed scaling reuses its stale scale and amax history there):
a history is reset, not reused, when a site is promoted again (a stale history from
before a fallback would scale the new format with numbers from another regime), and
the state is plain tensors (`state_dict()` loads with `weights_only=True`).
"""

from __future__ import annotations

import torch

from lowprec.numerics.block_scales import _div
from lowprec.numerics.formats import DelayedScalingConfig, ElementFormat

__all__ = ["AmaxHistory", "history_scale", "history_record"]


def history_scale(history: torch.Tensor, count: torch.Tensor, element: ElementFormat, margin: int,
                  most_recent: bool) -> torch.Tensor:
    """The scale a history gives now: (max / amax) / 2**margin, amax the history's maximum
    or its most recent entry; 1.0 while the history is empty or all zero (as TE does).
    max / amax is correctly rounded to FP32: divided in FP64 and rounded once (innocuous
    double rounding for a quotient: 53 >= 2 * 24 + 2), not PyTorch's `float / tensor`, which
    computes reciprocal(amax) * max and is 1 ulp off for about a quarter of amaxes; the
    division by 2**margin is then exact (but where it leaves the normal range). The Triton
    delayed cast (`lowprec.numerics.kernels.cast_transpose`) computes it alike."""
    if most_recent:
        amax = history[(count - 1).clamp(min=0) % history.numel()]
    else:
        amax = history.amax()
    scale = _div(element.max, amax) / (2.0 ** margin)
    return torch.where((amax > 0) & torch.isfinite(scale), scale, torch.ones_like(scale))


def history_record(history: torch.Tensor, count: torch.Tensor, amax: torch.Tensor) -> None:
    """Append `amax` to the ring (in place; a non-finite amax is recorded as 0: it never
    reaches a scale, the quantizer's statistics count it instead)."""
    amax = amax.detach().to(device=history.device, dtype=torch.float32).reshape(())
    amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
    idx = count % history.numel()
    history.index_put_((idx.reshape(1),), amax.reshape(1))
    count += 1


def static_address(t: torch.Tensor) -> torch.Tensor:
    """Mark `t`, state a compiled step updates in place, as a tensor whose address stays put
    across calls: what `torch._dynamo.mark_static_address(t)` sets (guard=False), without
    importing Dynamo for it. CUDA graphs (`mode="reduce-overhead"`) then replay the in-place
    update into `t` itself; an input a graph mutates that is not static makes cudagraph trees
    skip the graph (`check_for_mutation` in torch/_inductor/cudagraph_utils.py)."""
    t._dynamo_static_input_type = "unguarded"
    return t


class AmaxHistory:
    """A ring of the last `config.history_len` amaxes of one operand, on one device."""

    def __init__(self, config: DelayedScalingConfig, element: ElementFormat,
                 device: torch.device | str = "cpu"):
        self.config = config
        self.element = element
        self.history = static_address(torch.zeros(config.history_len, dtype=torch.float32, device=device))
        self.count = static_address(torch.zeros((), dtype=torch.int64, device=device))  # amaxes recorded so far
        self._scratch(device)

    def _scratch(self, device) -> None:
        """The fused delayed cast's scratch scalars (its running amax and its finishing
        ticket, zero between calls; `lowprec.numerics.kernels.cast_transpose`): not state."""
        self.scratch = static_address(torch.zeros((), dtype=torch.float32, device=device))
        self.ticket = static_address(torch.zeros((), dtype=torch.int32, device=device))

    def scale(self) -> torch.Tensor:
        """The scale to use now; 1.0 while the history is empty or all zero (as TE does)."""
        return history_scale(self.history, self.count, self.element, self.config.margin,
                             self.config.algo == "most_recent")

    def record(self, amax: torch.Tensor) -> None:
        """Append this iteration's amax (non-finite values are not recorded)."""
        history_record(self.history, self.count, amax)

    def reset(self) -> None:
        self.history.zero_()
        self.count.zero_()

    def to(self, device: torch.device | str) -> "AmaxHistory":
        self.history = static_address(self.history.to(device))
        self.count = static_address(self.count.to(device))
        self._scratch(device)
        return self

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {"history": self.history.clone(), "count": self.count.clone()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        hist = state["history"]
        if hist.shape != self.history.shape:
            raise ValueError(
                f"amax history of length {hist.shape[0]} cannot be loaded into a history of "
                f"length {self.history.shape[0]}: the checkpoint was written with another "
                f"DelayedScalingConfig.history_len; use the same config to resume")
        self.history.copy_(hist)
        self.count.copy_(state["count"])
