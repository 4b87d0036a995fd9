"""The process's random states, taken and put back as plain data.

What a resume needs to go on bit for bit: torch's CPU generator, every CUDA device's when
CUDA is initialised, Python's `random` and NumPy's legacy global generator (when NumPy is
installed). `rng_state()` returns tensors and numbers only, so it is saved with everything
else and loads with `torch.load(weights_only=True)`. Used by checkpoints, rewind
snapshots and the LR probe.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

__all__ = ["rng_state", "restore_rng_state", "check_rng_devices"]


def rng_state() -> dict:
    """Torch (CPU; CUDA when initialised), Python and NumPy random states, as plain tensors and numbers."""
    version, internal, gauss = random.getstate()
    state = {"torch": torch.get_rng_state(),
             "python": {"version": version, "state": torch.tensor(internal, dtype=torch.int64),
                        "gauss_next": gauss}}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    np = _numpy()
    if np is not None:
        name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
        state["numpy"] = {"bit_generator": name, "keys": torch.from_numpy(keys.astype("int64")),
                          "pos": int(pos), "has_gauss": int(has_gauss), "cached_gaussian": float(cached)}
    return state


def check_rng_devices(state: dict, path: Path) -> None:
    """Refuse, naming `path`, RNG states this process cannot take: other CUDA devices, NumPy missing."""
    fix = "or pass restore_rng=False (the run then does not continue bit for bit)"
    if "cuda" in state and (not torch.cuda.is_available()
                            or torch.cuda.device_count() != len(state["cuda"])):
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        raise ValueError(f"{path} holds RNG states of {len(state['cuda'])} CUDA devices, this "
                         f"process has {have}; resume on the same devices {fix}")
    if "numpy" in state and _numpy() is None:
        raise ValueError(f"{path} holds NumPy's RNG state but NumPy is not installed; install it {fix}")


def restore_rng_state(state: dict) -> None:
    """Put back what `rng_state` took."""
    torch.set_rng_state(state["torch"])
    if "cuda" in state:
        torch.cuda.set_rng_state_all(state["cuda"])
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss_next"]))
    if "numpy" in state:
        n, np = state["numpy"], _numpy()
        np.random.set_state((n["bit_generator"], n["keys"].numpy().astype("uint32"), n["pos"],
                             n["has_gauss"], n["cached_gaussian"]))


def _numpy():
    try:
        import numpy
        return numpy
    except ImportError:
        return None
