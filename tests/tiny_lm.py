"""A user's own tiny causal LM, as a module a config names (`tinylm:build`, `tinylm:tokens`).

Tests copy this file into a temporary project folder (the `tiny_lm` fixture of
tests/conftest.py) and run `lowprec plan` / `lowprec run` there, as a user would.
`model(x, y)` returns the loss; `model(x)` the logits (what an evaluator calls).
`step_seconds` makes each training step last that long, so that a test can kill it mid-step;
with `slow_while` (a path) only while that file exists, so that a test can let the same config
(a `--resume` must match it) run at full speed once the slow part is over. `eval_seconds`
and `eval_slow_while` do the same to each logits call (what an evaluator makes), so that a test
can signal a run inside an eval.
"""

import os
import time

import torch
import torch.nn.functional as F
from torch import nn


class TinyLM(nn.Module):
    def __init__(self, vocab: int, width: int, step_seconds: float = 0.0, slow_while: str | None = None,
                 eval_seconds: float = 0.0, eval_slow_while: str | None = None):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)
        self.head = nn.Linear(width, vocab)
        self.step_seconds, self.slow_while = step_seconds, slow_while
        self.eval_seconds, self.eval_slow_while = eval_seconds, eval_slow_while

    def forward(self, x, y=None):
        h = self.embed(x)
        h = h + self.down(F.gelu(self.up(h)))
        if y is None:
            if self.eval_seconds and self.eval_slow_while and os.path.exists(self.eval_slow_while):
                time.sleep(self.eval_seconds)
            return self.head(h)
        if self.step_seconds and (self.slow_while is None or os.path.exists(self.slow_while)):
            time.sleep(self.step_seconds)
        return F.cross_entropy(self.head(h).flatten(0, 1), y.flatten())


def build(vocab=64, width=32, step_seconds=0.0, slow_while=None, eval_seconds=0.0, eval_slow_while=None):
    return TinyLM(vocab, width, step_seconds, slow_while, eval_seconds, eval_slow_while)


def tokens(n=4000, vocab=64, seed=None):
    """`n` tokens: a repeating ramp, or (with a seed) uniform random ones."""
    if seed is None:
        return torch.arange(n) % vocab
    return torch.randint(0, vocab, (n,), generator=torch.Generator().manual_seed(seed))
