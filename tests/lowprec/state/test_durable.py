"""lowprec.state.durable on a device that is full: the real ENOSPC of /dev/full.

A write whose temporary is `/dev/full` (a symlink to it, where the writer opens its
temporary) gets the operating system's own "No space left on device" as a full disk gives
it, without root or a small file system. The write must remove its temporary, leave the
file it was to replace as it was, and raise NoSpaceError naming the file and its folder.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from lowprec.state.durable import NoSpaceError, save_atomically, write_text_atomically

FULL = Path("/dev/full")
pytestmark = pytest.mark.skipif(not FULL.exists(), reason="no /dev/full on this system")


def _full_temporary(path: Path) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    os.symlink(FULL, tmp)
    return tmp


def test_a_full_device_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "state.pt"
    save_atomically(path, {"a": torch.arange(4)})
    before = path.read_bytes()
    tmp = _full_temporary(path)
    with pytest.raises(NoSpaceError) as info:
        save_atomically(path, {"a": torch.zeros(1 << 16)})
    e = info.value
    assert e.errno == errno.ENOSPC and e.path == path and e.folder == tmp_path
    assert str(e).startswith(f"state.pt could not be written in {tmp_path}: No space left on device (")
    assert "free there now" in str(e) and e.free is not None and e.free > 0
    assert not os.path.lexists(tmp) and path.read_bytes() == before
    _full_temporary(tmp_path / "config.yaml")
    with pytest.raises(NoSpaceError, match="config.yaml could not be written"):
        write_text_atomically(tmp_path / "config.yaml", "x: 1\n" * 10_000)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.pt"]


def test_a_checkpoint_on_a_full_device_names_itself_and_keeps_the_previous(tmp_path):
    from lowprec.state.checkpoint import list_checkpoints, save_checkpoint, verify_checkpoint
    torch.manual_seed(0)
    model = nn.Linear(64, 64)
    opt = torch.optim.AdamW(model.parameters())
    save_checkpoint(tmp_path, 0, model=model, optimizer=opt)
    _full_temporary(tmp_path / "step_00000002.pt")
    with pytest.raises(NoSpaceError, match=r"^step_00000002.pt could not be written in "):
        save_checkpoint(tmp_path, 2, model=model, optimizer=opt)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [0]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_00000000.pt"]
    verify_checkpoint(tmp_path / "step_00000000.pt")
