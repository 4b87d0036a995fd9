"""Files that survive a kill: plain data written, synced and renamed into place.

A reader must only ever find a complete file under its final name, so every writer here
writes a temporary beside it, flushes and fsyncs it, renames it over the final name and
fsyncs the directory (the rename itself must reach the disk). What is written is plain
data that `torch.load(weights_only=True)` accepts; `check_plain` says which entry is not,
before anything is written, rather than leaving the surprise for the resume.

Used by `lowprec.state.checkpoint` (lowprec's own runs) and `lowprec.integrations.state_files`
(the rollout's state inside a framework's checkpoint).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["check_plain", "write_synced", "fsync_dir", "save_atomically"]

_PLAIN = (str, bytes, bytearray, int, float, complex, bool, type(None), torch.Size, torch.dtype,
          torch.device, torch.Tensor, nn.Parameter)


def check_plain(obj: Any, where: str) -> None:
    """Fail now, naming the entry, if `obj` would not load with torch.load(weights_only=True)."""
    if type(obj) in (dict, OrderedDict):
        for k, v in obj.items():
            if type(k) not in _PLAIN:
                raise TypeError(f"{where} has a key of type {type(k).__name__} ({k!r}); use str or int keys")
            check_plain(v, f"{where}[{k!r}]")
    elif type(obj) in (list, tuple, set):
        for i, v in enumerate(obj):
            check_plain(v, f"{where}[{i}]")
    elif type(obj) not in _PLAIN:
        raise TypeError(
            f"{where} is a {type(obj).__module__}.{type(obj).__qualname__}, which "
            f"torch.load(weights_only=True) refuses; state_dict() must hold only tensors, numbers, "
            f"strings, None and lists/tuples/dicts of them (convert enums to .value, arrays to "
            f"tensors, objects to dicts)")


def write_synced(path: Path, obj: Any) -> None:
    """torch.save `obj` to `path`, flushed and fsynced (no rename: see `save_atomically`)."""
    with open(path, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def fsync_dir(directory: Path) -> None:
    """Make a rename durable: fsync the directory entry (POSIX; skipped where unsupported)."""
    try:
        fd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # e.g. Windows cannot open a directory
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_atomically(path: str | os.PathLike, obj: Any,
                    before_replace: Callable[[Path], None] | None = None) -> Path:
    """Write `obj` to `path` so that `path` is either absent, the old file, or the whole new
    one: `path.tmp`, synced, renamed over `path`, the directory synced. `before_replace`
    (a test hook) is called with the complete temporary path just before the rename."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    write_synced(tmp, obj)
    if before_replace is not None:
        before_replace(tmp)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def write_text_synced(path: Path, text: str) -> None:
    """Write `text` (UTF-8) to `path`, flushed and fsynced (no rename)."""
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def replace_durably(tmp: str | os.PathLike, path: str | os.PathLike) -> Path:
    """Rename a complete, synced `tmp` over `path` and fsync the folder: `path` is then the
    old file or the whole new one, also after a crash."""
    path = Path(path)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    return path


def write_text_atomically(path: str | os.PathLike, text: str) -> Path:
    """`save_atomically` for a text file (a written config): `path.tmp`, synced, renamed."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    write_text_synced(tmp, text)
    return replace_durably(tmp, path)
