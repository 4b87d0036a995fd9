"""A checkpoint that is an unsafe pickle is reported as refused (not as "torn")."""

from __future__ import annotations

import os
import warnings

import pytest
import torch
from torch import nn

from lowprec.state.checkpoint import latest_checkpoint, load_checkpoint


class _Evil:
    def __reduce__(self):
        return (os.getcwd, ())   # harmless here; a real attack would name os.system


def test_unsafe_pickle_is_refused_and_says_so(tmp_path):
    path = tmp_path / "step_00000003.pt"
    torch.save({"format": "lowprec", "payload": _Evil()}, path)
    model = nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(ValueError) as e:
        load_checkpoint(path, model=model, optimizer=opt)
    msg = str(e.value)
    assert "refused" in msg and "unsafe pickle" in msg and "getcwd" in msg, msg
    assert "torn" not in msg and "not a complete" not in msg
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert latest_checkpoint(tmp_path) is None
    text = " ".join(str(x.message) for x in w)
    assert "refused" in text and "torn" not in text, text
