"""Injected faults, to see the controller act: `lowprec run --inject KIND:SITE:START:STOP[:FACTOR[:EVERY]]`.

Kinds:

* `nan`: NaN in the first output column of `SITE` (a fault of low precision: it fires
  only while the site runs below high precision, so a fallback cures it);
* `nan_one`: as `nan`, in one element only, the first row's first column, and on rank 0
  only (rank 0 reads the global batch's first row and, under tensor parallel, holds the
  first column): a fault on exactly one rank of a data x tensor parallel job (a row-parallel
  site's partial sums carry it to its tp group); one process gets the same element;
* `overflow`: `SITE`'s input scaled by FACTOR (1e4), every EVERY-th step (intermittent
  activation outliers; also only below high precision);
* `input`: `SITE`'s input scaled by FACTOR in every format (a data fault tied to its
  steps: a replay in high precision meets it too, a later one does not);
* `lr_spike`: the learning rate times FACTOR (no site);
* `loss_spike`: the loss, and so its gradients, times FACTOR (no site; a data fault);
* `random_tokens`: the batch's tokens (and its labels with them) replaced by uniformly random
  ones from the model's vocabulary (no site; a data fault: a corrupted shard). Seeded by the
  iteration, so a replay of the step meets the same batch.
* `router`: the router of a mixture-of-experts layer at `SITE` (HF's `mlp.gate`, torchtitan's
  `moe.router`) sends every token to the same top-k experts (0 .. k-1): its chosen expert
  indices replaced, in every format (a router collapse: a fault of routing, not of precision).

START and STOP count loop iterations, not steps: after a rewind the step counter goes
back, time does not, so a fault happens once, as a real one would.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import Enum

import torch
from torch import nn

__all__ = ["FaultKind", "Injection", "parse_injection", "Faults"]


class FaultKind(str, Enum):
    NAN = "nan"
    NAN_ONE = "nan_one"
    OVERFLOW = "overflow"
    INPUT = "input"
    LR_SPIKE = "lr_spike"
    LOSS_SPIKE = "loss_spike"
    RANDOM_TOKENS = "random_tokens"
    ROUTER = "router"

    @property
    def needs_site(self) -> bool:
        return self in (FaultKind.NAN, FaultKind.NAN_ONE, FaultKind.OVERFLOW, FaultKind.INPUT, FaultKind.ROUTER)


@dataclass(frozen=True)
class Injection:
    """A fault of `kind` for iterations [start, stop) (see the module docstring)."""

    kind: FaultKind
    start: int
    stop: int
    site: str = ""
    factor: float = 1e4
    every: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", FaultKind(self.kind))
        if self.start < 0 or self.stop <= self.start or self.every < 1:
            raise ValueError(f"a fault needs 0 <= START < STOP and EVERY >= 1, got {self.start}:{self.stop}"
                             f" every {self.every}")
        if self.kind.needs_site and not self.site:
            raise ValueError(f"a {self.kind.value} fault names a site (a module FQN), e.g. "
                             f"{self.kind.value}:blocks.1.mlp.fc:40:60")

    def active(self, iteration: int, module=None) -> bool:
        # a module that is no site (HF's router) runs in high precision: its faults are no precision's
        low = (module is None or self.kind is FaultKind.INPUT or getattr(module, "format", None) is None
               or not module.format.is_high_precision)
        return self.start <= iteration < self.stop and (iteration - self.start) % self.every == 0 and low


def parse_injection(text: str) -> Injection:
    """`KIND:SITE:START:STOP[:FACTOR[:EVERY]]`; lr_spike, loss_spike and random_tokens leave SITE empty."""
    parts = text.split(":")
    try:
        if len(parts) < 4 or len(parts) > 6:
            raise ValueError(f"{len(parts)} fields")
        kind, site, start, stop = parts[:4]
        extra: list = [float(parts[4])] if len(parts) > 4 else []
        extra += [int(parts[5])] if len(parts) > 5 else []
        return Injection(FaultKind(kind), int(start), int(stop), site, *extra)
    except ValueError as e:
        kinds = ", ".join(k.value for k in FaultKind)
        raise ValueError(f"--inject {text!r}: expected KIND:SITE:START:STOP[:FACTOR[:EVERY]] with KIND one of "
                         f"{kinds}, e.g. nan:blocks.1.mlp.fc:40:200 or loss_spike::60:61:100 ({e})") from None


def _nan_first_column(out: torch.Tensor) -> torch.Tensor:
    """`out` with NaN in its first column; a DTensor output gets it on the rank(s) that hold
    global column 0 (a partial sum: on every rank, NaN either way)."""
    if getattr(out, "device_mesh", None) is None:
        out = out.clone()
        out[..., 0] = float("nan")
        return out
    from torch.distributed.tensor import DTensor
    local = out.to_local().clone()
    last = out.ndim - 1
    if all(not (p.is_shard() and p.dim % out.ndim == last) or out.device_mesh.get_local_rank(i) == 0
           for i, p in enumerate(out.placements)):
        local[..., 0] = float("nan")
    return DTensor.from_local(local, out.device_mesh, out.placements, run_check=False,
                              shape=out.shape, stride=out.stride())


def _nan_one_element(out: torch.Tensor) -> torch.Tensor | None:
    """`out` with NaN in its first element on rank 0 (see `nan_one`); None elsewhere (unchanged)."""
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_rank() != 0:
        return None
    if getattr(out, "device_mesh", None) is None:
        out = out.clone()
        out[(0,) * out.ndim] = float("nan")
        return out
    from torch.distributed.tensor import DTensor
    local = out.to_local().clone()
    local[(0,) * local.ndim] = float("nan")
    return DTensor.from_local(local, out.device_mesh, out.placements, run_check=False,
                              shape=out.shape, stride=out.stride())


def _collapsed_routing(out):
    """A router's output with its chosen expert indices (the integer tensor, (..., k)) replaced
    by experts 0 .. k-1 for every token."""
    if not isinstance(out, tuple) or not any(isinstance(t, torch.Tensor) and not t.is_floating_point() for t in out):
        raise TypeError(f"router: the module's output ({type(out).__name__}) holds no expert indices; name a "
                        f"router (HF's mlp.gate, torchtitan's moe.router)")
    return tuple(torch.arange(t.shape[-1], dtype=t.dtype, device=t.device).expand_as(t).contiguous()
                 if isinstance(t, torch.Tensor) and not t.is_floating_point() else t for t in out)


def _scale_loss(out, factor: float):
    if isinstance(out, torch.Tensor):
        return out * factor
    if isinstance(out, tuple) and out and isinstance(out[-1], torch.Tensor):
        return out[:-1] + (out[-1] * factor,)
    if getattr(out, "loss", None) is not None:   # a Hugging Face ModelOutput
        out.loss = out.loss * factor
        return out
    raise TypeError(f"loss_spike: cannot find the loss in a {type(out).__name__} output")


def _vocab_size(module: nn.Module) -> int:
    """The number of tokens of `module`'s input embedding (a Hugging Face model's, else its first)."""
    get = getattr(module, "get_input_embeddings", None)
    emb = get() if callable(get) else next((m for m in module.modules() if isinstance(m, nn.Embedding)), None)
    if emb is None:
        raise ValueError(f"random_tokens: {type(module).__name__} has no nn.Embedding to take the vocabulary from")
    return int(emb.num_embeddings)


def _random_tokens(args: tuple, kwargs: dict, vocab: int, iteration: int):
    """(args, kwargs) of a forward call with the token ids (the first argument or `input_ids`)
    replaced by random ones, seeded by `iteration`, and the labels (the second argument,
    `labels` or `targets`) with them: the same tensor where the labels were the ids (Hugging
    Face shifts them inside), else the ids shifted by one."""
    ids = args[0] if args and isinstance(args[0], torch.Tensor) else kwargs.get("input_ids")
    if ids is None or ids.is_floating_point():
        raise ValueError("random_tokens: the model's first argument (or input_ids) is no tensor of token ids")
    gen = torch.Generator().manual_seed(1_000_003 * (iteration + 1))
    seq = torch.randint(0, vocab, (*ids.shape[:-1], ids.shape[-1] + 1), generator=gen).to(ids.device, ids.dtype)
    new_ids = seq[..., :-1]
    args, kwargs = list(args), dict(kwargs)
    label_key = next((k for k in ("labels", "targets") if isinstance(kwargs.get(k), torch.Tensor)), None)
    labels = args[1] if len(args) > 1 and isinstance(args[1], torch.Tensor) else kwargs.get(label_key)
    new_labels = None if labels is None else new_ids if torch.equal(labels, ids) else seq[..., 1:]
    if args and isinstance(args[0], torch.Tensor):
        args[0] = new_ids
    else:
        kwargs["input_ids"] = new_ids
    if len(args) > 1 and isinstance(args[1], torch.Tensor):
        args[1] = new_labels
    elif label_key is not None:
        kwargs[label_key] = new_labels
    return tuple(args), kwargs


class Faults:
    """Injections installed as hooks on `module` (this rank's part of the model).

    `tick(iteration)` before each loop pass; `lr_factor()` is the product of the active
    learning-rate spikes. Sites that live on other ranks (pipeline stages) are ignored here.
    """

    def __init__(self, module: nn.Module, injections: list[Injection] | tuple = (), *, root: bool = True):
        self.injections = list(injections)
        self.iteration = 0
        self._hooks = []
        names = dict(module.named_modules())
        for j in self.injections:
            if j.kind in (FaultKind.NAN, FaultKind.NAN_ONE) and j.site in names:
                self._hooks.append(names[j.site].register_forward_hook(self._nan_hook(j), prepend=True))
            elif j.kind in (FaultKind.OVERFLOW, FaultKind.INPUT) and j.site in names:
                self._hooks.append(names[j.site].register_forward_pre_hook(self._overflow_hook(j)))
            elif j.kind is FaultKind.ROUTER and j.site in names:
                self._hooks.append(names[j.site].register_forward_hook(self._router_hook(j)))
            elif j.kind is FaultKind.LOSS_SPIKE and root:
                self._hooks.append(module.register_forward_hook(self._loss_hook(j)))
            elif j.kind is FaultKind.RANDOM_TOKENS and root:
                self._hooks.append(module.register_forward_pre_hook(self._tokens_hook(j, _vocab_size(module)),
                                                                    with_kwargs=True))

    def _nan_hook(self, j: Injection):
        def hook(mod, args, out):
            if j.active(self.iteration, mod):
                return _nan_first_column(out) if j.kind is FaultKind.NAN else _nan_one_element(out)
        return hook

    def _overflow_hook(self, j: Injection):
        def pre(mod, args):
            if j.active(self.iteration, mod):
                return (args[0] * j.factor,) + tuple(args[1:])
        return pre

    def _router_hook(self, j: Injection):
        def hook(mod, args, out):
            if j.active(self.iteration, mod):
                return _collapsed_routing(out)
        return hook

    def _loss_hook(self, j: Injection):
        def hook(mod, args, out):
            if j.active(self.iteration):
                return _scale_loss(out, j.factor)
        return hook

    def _tokens_hook(self, j: Injection, vocab: int):
        def pre(mod, args, kwargs):
            if j.active(self.iteration):
                return _random_tokens(args, kwargs, vocab, self.iteration)
        return pre

    def tick(self, iteration: int) -> None:
        self.iteration = iteration

    def lr_factor(self) -> float:
        return math.prod(j.factor for j in self.injections if j.kind is FaultKind.LR_SPIKE
                         and j.active(self.iteration))

    def remove(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
