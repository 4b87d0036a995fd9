"""This process's rank and the number of ranks, with or without torch.distributed.

The one place every module asks (the loop's per-rank files, the framework integrations'
state files, checkpoints, tracking on rank 0): 0 and 1 when no process group is up; and
`from_rank_0`, how rank 0's outcome (an eval's: lm-eval's results exist on rank 0 only) reaches
every rank, so that every rank's controller decides alike.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["process_rank", "world_size", "from_rank_0"]


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
