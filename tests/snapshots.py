"""What a folder holds, for tests that check a refused command wrote and removed nothing.

Left out: lock files (they name their latest holder) and Python's bytecode caches (`__pycache__`:
an imported model-factory module's compiled code is Python's, written wherever bytecode writing is
on, not the run's).
"""

from __future__ import annotations

from pathlib import Path


def folder_snapshot(root: Path, *, contents: bool = True) -> dict:
    """relative path -> the file's bytes (contents) or (size, mtime_ns) for every file under `root`."""
    out = {}
    for p in sorted(root.rglob("*")):
        if not p.is_file() or p.suffix == ".lock" or "__pycache__" in p.relative_to(root).parts:
            continue
        st = p.stat()
        out[str(p.relative_to(root))] = p.read_bytes() if contents else (st.st_size, st.st_mtime_ns)
    return out
