"""One reduced amax for the sites that read the same input: q, k, v of one block, gate and up.

Under sequence parallelism a column-parallel FP8 site gathers its input as FP8 bytes
(`lowprec.sites.fp8_sequence`), so the whole gathered input needs one scale: its amax
all-reduced over the tensor-parallel group before the cast. Sites that read one tensor
(a block's q, k and v projections read one normed input; an MLP's gate and up another)
would each issue that all-reduce for the same value. `SharedAmax` keeps the last reduced
amax with the tensor it was taken of; the next site that reads the same tensor (same
storage, offset, shape, strides and version, over the same groups) reuses it, one
all-reduce where there were three. torchao's `Float8ColwiseParallel` casts such a shared
input once for the same reason.

`prepare` makes one per model and gives it to every site at construction. It holds a
reference to that one tensor (a rank's shard of one activation) until the next input
replaces it, so no other tensor can take its storage while it is kept: a match is the same
tensor, never a new one at a reused address. Every rank runs the same program, so every
rank of a group hits or misses together and the collectives stay matched. Nothing is
shared under `torch.compile` (tracing sees no storage) or for inference-mode tensors
(they have no version counter).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

__all__ = ["SharedAmax"]


class SharedAmax:
    """The last input's amax, reduced over its groups, for the next site reading that input."""

    def __init__(self):
        self._held: Tensor | None = None   # the tensor the amax was taken of (kept alive)
        self._key: tuple | None = None
        self._amax: Tensor | None = None

    @staticmethod
    def _key_of(t: Tensor, groups: tuple) -> tuple | None:
        if torch.compiler.is_compiling() or t.is_inference():
            return None
        return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(), t.dtype,
                t.device, t._version, tuple(id(g) for g in groups))

    def amax(self, t: Tensor, groups: tuple, reduce: Callable[[Tensor, tuple], Tensor]) -> Tensor:
        """`reduce(t, groups)` (t's amax reduced over `groups`), or the one already taken of
        this very tensor over these groups."""
        key = self._key_of(t, groups)
        if key is not None and key == self._key:
            return self._amax
        amax = reduce(t, groups)
        if key is not None:
            self._held, self._key, self._amax = t, key, amax
        return amax
