"""Checksums of checkpoints: a flipped bit is refused on load, naming the file (and tensor).

Two forms, both written atomically with the checkpoint they describe:

* a single-file checkpoint carries its own: `payload["integrity"]` holds the SHA-256 of
  every tensor's bytes (keyed by its path in the payload, e.g. `model/blocks.0.mlp.fc.weight`)
  and one over the whole structure (keys, numbers, strings, and each tensor's dtype, shape
  and digest), so a flip in a weight, an Adam moment, an RNG state or the list of losses
  in `extra` all show;
* a checkpoint directory (DCP) holds `manifest.json`: the size and SHA-256 of every other
  file in it, written by rank 0 into the temporary directory before it is renamed.

Verifying reads every byte (SHA-256 runs at about 1-2 GB/s per core).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Iterator

import torch

__all__ = ["CorruptCheckpointError", "payload_integrity", "verify_payload", "write_manifest",
           "verify_manifest", "MANIFEST"]

ALGORITHM = "sha256"
MANIFEST = "manifest.json"
_CHUNK = 1 << 22


class CorruptCheckpointError(ValueError):
    """A checkpoint that does not open or whose contents do not match its checksums."""

    def __init__(self, path: Path, detail: str):
        self.path = Path(path)
        super().__init__(f"checkpoint {path} is corrupt: {detail}. It cannot be loaded; resume from "
                         f"an older one (latest_checkpoint skips corrupt checkpoints) or restore it from a copy")


def _tensor_digest(t: torch.Tensor) -> str:
    t = t.detach()
    if hasattr(t, "to_local"):
        t = t.to_local()
    t = t.cpu().contiguous().reshape(-1)
    raw = t.view(torch.uint8) if t.dtype != torch.uint8 else t
    try:
        buf = memoryview(raw.numpy())
    except (RuntimeError, TypeError):  # no NumPy: copy the bytes out of the storage
        buf = bytes(raw.clone().untyped_storage())
    return hashlib.sha256(buf).hexdigest()


def _walk(obj: Any, path: str, out: list[str], tensors: dict[str, str]) -> None:
    """A canonical text of `obj` (into `out`) and the digest of every tensor (into `tensors`)."""
    if isinstance(obj, torch.Tensor):
        d = tensors[path] = _tensor_digest(obj)
        out.append(f"T({obj.dtype},{tuple(obj.shape)},{d})")
    elif isinstance(obj, dict):
        out.append("{")
        for k in sorted(obj, key=repr):
            out.append(repr(k) + ":")
            _walk(obj[k], f"{path}/{k}" if path else str(k), out, tensors)
        out.append("}")
    elif isinstance(obj, (list, tuple)):
        out.append("[")
        for i, v in enumerate(obj):
            _walk(v, f"{path}/{i}", out, tensors)
        out.append("]")
    elif isinstance(obj, (set, frozenset)):
        out.append("s" + repr(sorted(map(repr, obj))))
    else:
        out.append(repr(obj))
    out.append(",")


def _digests(payload: dict) -> tuple[str, dict[str, str]]:
    out: list[str] = []
    tensors: dict[str, str] = {}
    _walk({k: v for k, v in payload.items() if k != "integrity"}, "", out, tensors)
    return hashlib.sha256("".join(out).encode()).hexdigest(), tensors


def payload_integrity(payload: dict) -> dict:
    """The `integrity` entry of a single-file checkpoint's payload."""
    whole, tensors = _digests(payload)
    return {"algorithm": ALGORITHM, "payload": whole, "tensors": tensors}


def verify_payload(payload: dict, path: Path) -> None:
    """Raise CorruptCheckpointError unless `payload` matches its `integrity` entry."""
    want = payload.get("integrity")
    if not isinstance(want, dict) or want.get("algorithm") != ALGORITHM:
        raise CorruptCheckpointError(path, "its checksums (the 'integrity' entry) are missing or unreadable")
    whole, tensors = _digests(payload)
    stored = want.get("tensors") or {}
    bad = sorted(k for k in set(tensors) | set(stored) if tensors.get(k) != stored.get(k))
    if bad:
        raise CorruptCheckpointError(path, f"{len(bad)} tensor(s) do not match their SHA-256: "
                                           f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}")
    if whole != want.get("payload"):
        raise CorruptCheckpointError(path, "its non-tensor contents (step, data position, controller, "
                                           "extra, ...) do not match their SHA-256")


def _file_digest(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _files(directory: Path) -> Iterator[Path]:
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.relative_to(directory).as_posix() != MANIFEST:
            yield p


def write_manifest(directory: Path) -> None:
    """Write `directory/manifest.json` (size and SHA-256 of every other file), fsynced."""
    files = {p.relative_to(directory).as_posix(): {"bytes": p.stat().st_size, ALGORITHM: _file_digest(p)}
             for p in _files(directory)}
    with open(directory / MANIFEST, "w") as f:
        json.dump({"algorithm": ALGORITHM, "files": files}, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())


def verify_manifest(directory: Path) -> None:
    """Raise CorruptCheckpointError naming the files of `directory` that do not match its manifest."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
        files = manifest["files"]
        assert manifest["algorithm"] == ALGORITHM and isinstance(files, dict)
    except FileNotFoundError:
        raise CorruptCheckpointError(directory, f"it has no {MANIFEST} (the checksums of its files)") from None
    except Exception as e:  # noqa: BLE001 - any damage to the manifest itself
        raise CorruptCheckpointError(directory, f"its {MANIFEST} does not read ({type(e).__name__})") from None
    bad = []
    for name, want in sorted(files.items()):
        p = directory / name
        if not p.is_file():
            bad.append(f"{p} (missing)")
        elif p.stat().st_size != want.get("bytes"):
            bad.append(f"{p} ({p.stat().st_size} bytes, {want.get('bytes')} written)")
        elif _file_digest(p) != want.get(ALGORITHM):
            bad.append(f"{p} (SHA-256 differs)")
    if bad:
        raise CorruptCheckpointError(directory, "files do not match its manifest: " + ", ".join(bad))
