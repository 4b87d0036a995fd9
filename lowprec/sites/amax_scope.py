"""Where a distributed run reduces the amaxes behind its FP8 scales: `precision.amax_scope`.

* `group`: every tensor-wise (and row-wise, delayed) amax is the amax of the whole tensor
  the one-process run would cast: reduced (MAX) over the data-parallel group given to
  `prepare(..., amax_group=...)` for activations and gradients, and over the tensor-parallel
  shard groups of DTensor operands. The numerics are one process's; each reduction is a
  small all-reduce on the forward/backward critical path.
* `local`: each rank scales its own activations, gradients and weight shards by their own
  amaxes (Transformer Engine's and torchao's current scaling). No collective per cast;
  the numerics equal one process run rank by rank on each rank's shard.

Either way the controller's statistics are reduced once per check step for all sites
(`lowprec.policy.monitor`), so every rank takes the same decisions.
"""

from __future__ import annotations

import enum

__all__ = ["AmaxScope", "AMAX_SCOPES"]


class AmaxScope(enum.Enum):
    LOCAL = "local"
    GROUP = "group"


AMAX_SCOPES = tuple(s.value for s in AmaxScope)
