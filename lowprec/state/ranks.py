"""This process's rank and the number of ranks, with or without torch.distributed.

The one place every module asks (the loop's per-rank files, the framework integrations'
state files, checkpoints, tracking on rank 0): 0 and 1 when no process group is up; and
`from_rank_0`, how rank 0's outcome (an eval's: lm-eval's results exist on rank 0 only) reaches
every rank, so that every rank's controller decides alike; `from_every_rank`, every rank's
object on every rank, and `on_any_rank`, whether a condition holds on some rank (what rank 0
reports of state every rank holds a part of); `largest_on_any_rank`, one all-reduce of an int,
cheap enough for every step (whether any rank was told to stop).
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["process_rank", "world_size", "from_rank_0", "from_every_rank", "on_any_rank", "largest_on_any_rank"]


def process_rank() -> int:
    """This process's rank (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def from_rank_0(payload):
    """Rank 0's `payload` (any picklable object) on every rank; `payload` itself without a
    process group. Every rank must call it (a collective)."""
    if world_size() == 1:
        return payload
    box = [payload if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def from_every_rank(payload, group=None) -> list:
    """Every rank's `payload` (any picklable object) in rank order within `group` (None: every
    rank), on every rank of it; `[payload]` without a process group. Every rank of `group` must
    call it (a collective)."""
    if world_size() == 1:
        return [payload]
    parts: list = [None] * dist.get_world_size(group)
    dist.all_gather_object(parts, payload, group=group)
    return parts


def on_any_rank(flag: bool) -> bool:
    """True when `flag` is true on some rank; `flag` itself without a process group. Every
    rank must call it (a collective)."""
    return any(from_every_rank(bool(flag)))


def largest_on_any_rank(value: int) -> int:
    """The largest of every rank's `value` (an int), on every rank; `value` itself without a
    process group. One all-reduce of one number, on the GPU under NCCL. Every rank must call it
    (a collective)."""
    if world_size() == 1:
        return int(value)
    import torch
    nccl_only = dist.get_backend() == "nccl"   # "cpu:gloo,cuda:nccl" and gloo take a CPU tensor
    device = torch.device("cuda", torch.cuda.current_device()) if nccl_only else torch.device("cpu")
    t = torch.tensor([int(value)], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
