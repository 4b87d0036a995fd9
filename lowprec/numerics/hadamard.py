"""Random Hadamard transform in 16x16 blocks, as applied to NVFP4 weight-gradient inputs.

NVIDIA's NVFP4 pretraining recipe (arXiv 2509.25149) multiplies both operands of the
weight-gradient GEMM by the same random orthogonal matrix along the reduction (token)
dimension before quantizing them: outliers are spread over a block, so the 16-element
FP4 blocks see a flatter distribution, and because the matrix is orthogonal the GEMM
result is unchanged, `(x H)^T (g H)`-style products cancel to `x^T g`.

The matrix is `D @ H16 / 4`: a Sylvester Hadamard matrix of order 16, normalised to be
orthonormal, with rows multiplied by random signs `D` drawn from a seeded generator.
`apply` and `invert` act on the last dimension in consecutive blocks of 16.
"""

from __future__ import annotations

import torch

__all__ = ["RandomHadamard", "sylvester_hadamard"]


def sylvester_hadamard(n: int) -> torch.Tensor:
    """The order-n Sylvester Hadamard matrix (entries +-1), n a power of two."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard order must be a power of two, got {n}")
    h = torch.ones(1, 1, dtype=torch.float64, device="cpu")
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


class RandomHadamard:
    """A seeded, invertible random Hadamard transform over blocks of `size` elements."""

    def __init__(self, seed: int = 0, size: int = 16):
        self.seed = int(seed)
        self.size = int(size)
        # on the CPU whatever the default device: a model built under `torch.device("meta")`
        # (torchtitan's, materialized later) would leave a matrix without data
        gen = torch.Generator().manual_seed(self.seed)
        signs = torch.randint(0, 2, (self.size,), generator=gen, dtype=torch.int64, device="cpu") * 2 - 1
        h = sylvester_hadamard(self.size) / self.size**0.5
        self._matrix64 = signs.to(torch.float64)[:, None] * h  # orthonormal: M @ M.T = I
        self._cache: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}

    def matrix(self, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
        key = (torch.device(device), dtype)
        m = self._cache.get(key)
        if m is None:
            m = self._cache[key] = self._matrix64.to(device=device, dtype=dtype)
        return m

    def _check(self, x: torch.Tensor) -> None:
        if x.shape[-1] % self.size:
            raise ValueError(
                f"random Hadamard transform works on blocks of {self.size} along the last "
                f"dimension, but that dimension is {x.shape[-1]} (shape {tuple(x.shape)}); "
                f"use a size that is a multiple of {self.size} or turn the transform off")

    def _blocks(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(*x.shape[:-1], x.shape[-1] // self.size, self.size)

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x @ blockdiag(M): each block of `size` along the last dim times the matrix."""
        self._check(x)
        m = self.matrix(x.device, x.dtype)
        return (self._blocks(x) @ m).reshape(x.shape)

    def invert(self, y: torch.Tensor) -> torch.Tensor:
        """The inverse of `apply` (the matrix is orthonormal, so its transpose)."""
        self._check(y)
        m = self.matrix(y.device, y.dtype)
        return (self._blocks(y) @ m.T).reshape(y.shape)

    def state_dict(self) -> dict:
        return {"seed": self.seed, "size": self.size}

    def __repr__(self) -> str:
        return f"RandomHadamard(seed={self.seed}, size={self.size})"
