"""The distributed ledger of the traffic harness: the collectives one rank issues per step.

`experiments.traffic` counts the kernels and bytes a program moves; this module counts
its collectives. `CollectiveLedger` is a `TorchDispatchMode` that sees every c10d
collective (the process-group ops `c10d.*` FSDP2, the engines and lowprec issue, and the
functional `_c10d_functional.*` ones DTensor issues) and records, per collective, its
kind, the bytes this rank sends (its input), the reduce op, and the phase the caller was
in (`with ledger.phase("step"): ...`). Each is classed as

* `weight_all_gather` / `grad_reduce_scatter`: FSDP2's; they overlap compute (FSDP2
  prefetches the next unit's gather and reduce-scatters a unit while the backward goes
  on): off the critical path on a GPU;
* `amax_all_reduce`: a MAX all-reduce in the forward/backward (`amax_scope: group`, or a
  weight's amax under FP8 all-gather): the cast waits for it, on the critical path;
* `tp_all_reduce` / `tp_all_gather`: DTensor's, the row-parallel output and the
  column-parallel input gradient: on the critical path;
* `stats_<kind>`: what the controller's check issues (phase `check`): one all-gather of
  every site's statistics per check step;
* `step_all_reduce`: any other all-reduce (the loss, the gradient norm).

    ledger = CollectiveLedger()
    with ledger, ledger.phase("fwd_bwd"):
        engine.forward_backward(x, y)
    ledger.table()           # kind -> (count, bytes, critical count)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["Collective", "CollectiveLedger", "classify"]

_KINDS = {"allreduce_": "all_reduce", "all_reduce": "all_reduce", "all_reduce_": "all_reduce",
          "_allgather_base_": "all_gather", "allgather_": "all_gather", "all_gather_into_tensor": "all_gather",
          "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_": "reduce_scatter",
          "reduce_scatter_tensor": "reduce_scatter", "broadcast_": "broadcast", "allgather_into_tensor_coalesced_":
          "all_gather", "allreduce_coalesced_": "all_reduce"}
CRITICAL = ("amax_all_reduce", "tp_all_reduce", "tp_all_gather")


@dataclass(frozen=True)
class Collective:
    kind: str          # all_reduce, all_gather, reduce_scatter, broadcast
    op: str            # MAX, SUM, ... ("" when none)
    bytes: int         # what this rank sends
    phase: str
    functional: bool   # DTensor's functional collective

    @property
    def role(self) -> str:
        return classify(self)

    @property
    def critical(self) -> bool:
        return self.role in CRITICAL


def classify(c: Collective) -> str:
    if c.phase == "check":
        return f"stats_{c.kind}"
    if c.kind == "all_gather":
        return "tp_all_gather" if c.functional else "weight_all_gather"
    if c.kind == "reduce_scatter":
        return "tp_reduce_scatter" if c.functional else "grad_reduce_scatter"
    if c.kind == "all_reduce" and c.phase == "fwd_bwd":
        if "MAX" in c.op.upper():
            return "amax_all_reduce"
        if c.functional:
            return "tp_all_reduce"
    return "step_all_reduce" if c.kind == "all_reduce" else c.kind


def _bytes(tree) -> int:
    from torch.utils._pytree import tree_leaves
    return sum(t.numel() * t.element_size() for t in tree_leaves(tree) if isinstance(t, torch.Tensor))


def _op_name(args) -> str:
    import torch.distributed as dist
    names = {int(getattr(dist.ReduceOp, n)): n for n in ("SUM", "MAX", "MIN", "PRODUCT", "AVG")}
    for a in args:
        if isinstance(a, torch.ScriptObject) and a._has_method("op"):   # c10d's ReduceOp
            return names.get(int(a.op()), str(a.op()))
        if isinstance(a, str) and a.lower() in ("sum", "max", "min", "avg", "product"):
            return a.upper()
    return ""


class CollectiveLedger(TorchDispatchMode):
    """Records every collective dispatched while it is active (see the module docstring)."""

    def __init__(self):
        super().__init__()
        self.entries: list[Collective] = []
        self._phase = "other"

    @contextlib.contextmanager
    def phase(self, name: str):
        old, self._phase = self._phase, name
        try:
            yield self
        finally:
            self._phase = old

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional"):
            short = func._schema.name.split("::")[-1]
            kind = _KINDS.get(short)
            if kind is not None:
                payload = args[1] if short in ("_allgather_base_", "_reduce_scatter_base_") else args[0]
                self.entries.append(Collective(kind, _op_name(args), _bytes(payload), self._phase,
                                               ns == "_c10d_functional"))
        return func(*args, **(kwargs or {}))

    def table(self, phase: str | None = None) -> dict[str, tuple[int, int, int]]:
        """role -> (count, bytes, count on the critical path)."""
        out: dict[str, list[int]] = {}
        for c in self.entries:
            if phase is not None and c.phase != phase:
                continue
            row = out.setdefault(c.role, [0, 0, 0])
            row[0] += 1
            row[1] += c.bytes
            row[2] += c.critical
        return {k: tuple(v) for k, v in sorted(out.items())}
