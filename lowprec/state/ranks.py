"""This process's rank and the number of ranks, with or without torch.distributed.

The one place every module asks (the loop's per-rank files, the framework integrations'
state files, checkpoints, tracking on rank 0): 0 and 1 when no process group is up.
"""

from __future__ import annotations

import torch.distributed as dist

__all__ = ["process_rank", "world_size"]


def process_rank() -> int:
    """This process's rank (0 without torch.distributed)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    """The number of ranks (1 without torch.distributed)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
