"""Training batches for `lowprec run`: a token stream cut into seeded random windows.

`data.factory` in a config returns either a 1-D integer tensor of tokens, which
`TokenBatches` cuts into batches of `train.batch_size` windows of `data.block_size + 1`
tokens (inputs and next-token targets), or any object with the `BatchSource` methods.
A batch is a pure function of (seed, index): its position is all the state there is,
so resuming and rewinding are exact, and each data-parallel rank reads rows
rank::world of the same global batch.
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["BatchSource", "TokenBatches", "as_batch_source"]


class BatchSource(Protocol):
    def next(self) -> tuple[torch.Tensor, torch.Tensor]: ...

    def skip(self, n: int) -> None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, s: dict) -> None: ...


class TokenBatches:
    """Deterministic random windows of a token stream; its position is checkpointable."""

    def __init__(self, tokens: torch.Tensor, batch_size: int, block_size: int, seed: int = 0,
                 rank: int = 0, world: int = 1):
        if tokens.ndim != 1 or tokens.is_floating_point():
            raise ValueError(f"tokens must be a 1-D integer tensor, got {tokens.dtype} of shape {tuple(tokens.shape)}")
        if len(tokens) <= block_size + 1:
            raise ValueError(f"{len(tokens)} tokens are too few for windows of block_size {block_size}; "
                             f"give more data or a smaller data.block_size")
        self.tokens, self.batch_size, self.block_size = tokens.long(), batch_size, block_size
        self.seed, self.rank, self.world = seed, rank, world
        self.position = 0   # batches drawn so far

    def batch(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The index-th global batch, this rank's share of it (rows rank::world)."""
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        ix = torch.randint(0, len(self.tokens) - self.block_size - 1, (self.batch_size,), generator=g)
        ix = ix[self.rank::self.world]
        x = torch.stack([self.tokens[i:i + self.block_size] for i in ix])
        y = torch.stack([self.tokens[i + 1:i + self.block_size + 1] for i in ix])
        return x, y

    def next(self) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.batch(self.position)
        self.position += 1
        return out

    def skip(self, n: int) -> None:
        self.position += n

    def state_dict(self) -> dict:
        return {"position": self.position, "seed": self.seed}

    def load_state_dict(self, s: dict) -> None:
        self.position, self.seed = int(s["position"]), int(s["seed"])


def as_batch_source(obj, *, batch_size: int, block_size: int, seed: int, rank: int = 0,
                    world: int = 1) -> BatchSource:
    """What `data.factory` returned, as a BatchSource (see the module docstring)."""
    if isinstance(obj, torch.Tensor):
        return TokenBatches(obj, batch_size, block_size, seed=seed, rank=rank, world=world)
    missing = [m for m in ("next", "skip", "state_dict", "load_state_dict") if not callable(getattr(obj, m, None))]
    if missing:
        raise TypeError(f"data.factory returned a {type(obj).__name__}, which lacks {', '.join(missing)}; return "
                        f"a 1-D integer token tensor, or an object with next(), skip(n), state_dict() and "
                        f"load_state_dict()")
    return obj
