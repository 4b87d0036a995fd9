"""Files that survive a kill: plain data written, synced and renamed into place.

A reader must only ever find a complete file under its final name, so every writer here
writes a temporary beside it, flushes and fsyncs it, renames it over the final name and
fsyncs the directory (the rename itself must reach the disk). What is written is plain
data that `torch.load(weights_only=True)` accepts; `check_plain` says which entry is not,
before anything is written, rather than leaving the surprise for the resume.

A write that fails for want of space (ENOSPC, EDQUOT: a full disk, a quota) removes its
temporary, so the space it took is free again and the previous file stays, and raises
`NoSpaceError`, naming the file, the folder, the bytes it had written and the space free
there: a training loop ends on it with one line rather than a traceback.

Used by `lowprec.state.checkpoint` (lowprec's own runs) and `lowprec.integrations.state_files`
(the rollout's state inside a framework's checkpoint).
"""

from __future__ import annotations

import errno
import os
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

__all__ = ["check_plain", "write_synced", "fsync_dir", "save_atomically", "NoSpaceError", "free_bytes", "no_space", "NO_SPACE"]

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)   # the errnos of a full disk or quota


def free_bytes(folder: Path) -> int | None:
    """The bytes free to this user in `folder`'s file system (None where it cannot be read)."""
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None


def _size(n: int | None) -> str:
    if n is None:
        return "an unknown amount"
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if n < 1024 or unit == "TB":
            return f"{n:,} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


class NoSpaceError(OSError):
    """A durable write ran out of space (ENOSPC or EDQUOT). Its temporary is removed and the
    file it was to replace is untouched. `path`: the file it wrote; `written`: the bytes it
    had written when it failed; `free`: the bytes free in its folder afterwards."""

    def __init__(self, path: Path, cause: OSError, written: int | None):
        self.path, self.folder, self.written = Path(path), Path(path).parent, written
        self.free = free_bytes(self.folder)
        had = f"it had written {_size(written)} when the disk filled up; " if written else ""
        super().__init__(cause.errno, f"{self.path.name} could not be written in {self.folder}: "
                                      f"{cause.strerror or 'no space left'} ({had}{_size(self.free)} free there now)")

    def __str__(self) -> str:
        return self.strerror


def no_space(e: BaseException, tmp: Path, final: Path) -> NoSpaceError | None:
    """A NoSpaceError for `final` when `e` (or an error it wraps: DCP's per-rank failures, a
    cause) is a want of space; `tmp` (a file or a folder) is then removed. None otherwise."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, OSError) and x.errno in NO_SPACE:
            err = _failed_write(Path(tmp), x, Path(final))
            return err if isinstance(err, NoSpaceError) else None
        if isinstance(x, tuple):
            todo.extend(x)
            continue
        todo += [x.__cause__, x.__context__, *(getattr(x, "failures", None) or {}).values()]
    return None


def _failed_write(tmp: Path, e: OSError, final: Path) -> OSError:
    """Remove the temporary a failed write left; a want of space becomes NoSpaceError."""
    try:
        written = tmp.lstat().st_size if tmp.is_file() and not tmp.is_symlink() else None
    except OSError:
        written = None
    if tmp.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
    return NoSpaceError(final, e, written) if e.errno in NO_SPACE else e

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
    try:
        write_synced(tmp, obj)
    except OSError as e:
        raise _failed_write(tmp, e, path) from None
    except RuntimeError as e:   # torch.save's zip writer hides a full disk's OSError behind its own error
        full = no_space(e, tmp, path)
        if full is None:
            raise
        raise full from None
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
    try:
        write_text_synced(tmp, text)
    except OSError as e:
        raise _failed_write(tmp, e, path) from None
    return replace_durably(tmp, path)
