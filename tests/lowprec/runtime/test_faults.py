"""`nan_one`: one NaN element, the first row's first column, in one process (rank 0).

Under torchrun it lands on rank 0 only: tests/lowprec/sites/fast_path/test_fast_path_faults.py
(DP 2 x TP 2, every rank decides the same fallback at the same step).
"""

from __future__ import annotations

import torch
from torch import nn

from lowprec.runtime.trainer.faults import FaultKind, Faults, parse_injection


def test_nan_one_plants_one_element_of_the_site_output():
    j = parse_injection("nan_one:lin:1:2")
    assert j.kind is FaultKind.NAN_ONE and j.site == "lin"
    model = nn.Sequential()
    model.add_module("lin", nn.Linear(4, 3))
    model.lin.format = type("F", (), {"is_high_precision": False})()   # a low-precision site
    faults = Faults(model, [j])
    x = torch.randn(2, 5, 4)
    clean = model(x)
    faults.tick(1)
    out = model(x)
    bad = torch.isnan(out)
    assert bad.sum() == 1 and bad[0, 0, 0]
    assert torch.equal(out[~bad], clean[~bad])
    faults.tick(2)
    assert not torch.isnan(model(x)).any()


class _TinyLM(nn.Module):
    """forward(idx, targets) as lowprec's reference model, or (input_ids=, labels=) as a Hugging
    Face one; records what it was called with."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(50, 4)
        self.seen = []

    def forward(self, idx=None, targets=None, input_ids=None, labels=None):
        idx = idx if idx is not None else input_ids
        self.seen.append((idx, targets, labels))
        return self.emb(idx).sum()


def test_random_tokens_replace_the_batch_and_its_labels_the_same_way_at_a_replay():
    j = parse_injection("random_tokens::3:5")
    assert j.kind is FaultKind.RANDOM_TOKENS and not j.kind.needs_site
    model = _TinyLM()
    faults = Faults(model, [j])
    x = torch.zeros(2, 8, dtype=torch.long)
    y = torch.ones(2, 8, dtype=torch.long)
    faults.tick(2)
    model(x, y)
    assert model.seen[-1][0] is x and model.seen[-1][1] is y            # not active yet: untouched
    faults.tick(3)
    model(x, y)
    model(x, y)                                                          # the step's replay
    (ids, tgt, _), (ids2, tgt2, _) = model.seen[-2:]
    assert ids.shape == x.shape and tgt.shape == y.shape and ids.dtype == torch.long
    assert len(ids.unique()) > 5 and int(ids.max()) < 50                 # random, from the vocabulary
    assert torch.equal(ids[:, 1:], tgt[:, :-1])                         # labels: the ids shifted by one
    assert torch.equal(ids, ids2) and torch.equal(tgt, tgt2)            # a replay meets the same batch
    faults.tick(4)
    model(input_ids=x, labels=x.clone())                                 # Hugging Face: labels are the ids
    ids4, _, labels4 = model.seen[-1]
    assert not torch.equal(ids4, ids) and torch.equal(labels4, ids4)     # another iteration, another batch
    faults.tick(5)
    model(x, y)
    assert model.seen[-1][0] is x                                        # over
    faults.remove()
