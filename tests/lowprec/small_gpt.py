"""The small GPT configuration and the real-text byte batches that several tests train on
(test_state, test_checkpoint, the tracking rollout, and the distributed and checkpoint
workers, which run as scripts and import this module by path)."""

from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
MODEL = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, d_model=64)


def corpus_bytes(n: int = 200_000) -> torch.Tensor:
    """Byte tokens of real text: a Shakespeare play from ../shared/data when present, else
    this repository's own README and sources (real English text, always present)."""
    play = ROOT.parent / "shared" / "data" / "corpora" / "shakespeare" / "hamlet_gut.txt"
    if play.is_file():
        data = play.read_bytes()[:n]
    else:
        data = b"".join(p.read_bytes() for p in sorted(ROOT.rglob("*.py")))[:n]
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def batches(tokens, steps, batch=8, t=32, seed=0):
    """`steps` (x, y) batches of `batch` random windows of `t` tokens, y shifted by one."""
    g = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        ix = torch.randint(0, len(tokens) - t - 1, (batch,), generator=g)
        yield (torch.stack([tokens[i:i + t] for i in ix]), torch.stack([tokens[i + 1:i + t + 1] for i in ix]))
