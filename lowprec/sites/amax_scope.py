"""Where a distributed run reduces the amaxes behind its FP8 scales: `precision.amax_scope`.

* `local` (the default): each rank scales its own activations, gradients and weight
  shards by their own amaxes, as Transformer Engine's and torchao's current scaling do.
  Under data parallelism each rank's GEMM is its own, so nothing needs reducing. Reduced
  only where one cast serves a GEMM split over ranks: a sequence-parallel input gathered as
  FP8 bytes (its amax over the tensor-parallel group, once for all the sites reading that
  input: `lowprec.sites.shared_amax`) and FSDP2's FP8-gathered weights (one all-reduce per
  step for all of them). The numerics equal one process rank by rank on each rank's shard.
* `group`: every tensor-wise (and row-wise, delayed) amax is the amax of the whole tensor
  the one-process run would cast: reduced (MAX) over the data-parallel group given to
  `prepare(..., amax_group=...)` for activations and gradients, and over the tensor-parallel
  shard groups of DTensor operands. The numerics are one process's (the bit-for-bit parity
  mode); each reduction is a small all-reduce on the forward/backward critical path.

Either way the controller's statistics are reduced once per check step for all sites
(`lowprec.policy.monitor`), so every rank takes the same decisions.
"""

from __future__ import annotations

import enum

__all__ = ["AmaxScope", "AMAX_SCOPES", "DEFAULT_AMAX_SCOPE"]


class AmaxScope(enum.Enum):
    LOCAL = "local"
    GROUP = "group"


AMAX_SCOPES = tuple(s.value for s in AmaxScope)
DEFAULT_AMAX_SCOPE = AmaxScope.LOCAL   # torchao's and TE's behaviour; `group` for one-process parity
