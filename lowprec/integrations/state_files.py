"""The rollout's state inside a framework's checkpoint folder, one file per rank.

    checkpoint-120/                  the framework's own files (weights, optimizer, RNG, ...)
        lowprec/rank_00000.pt        rank 0's `HostedRollout.state_dict()`, with its checksums

A framework that resumes from its checkpoint restores the model, the optimizer and the
data position, but not lowprec: without this file every layer would start again in the
plan's format and the controller at its first stage, so a layer that fell back to BF16
would run in FP8 again. Each file is written atomically (`lowprec.state.durable`) with the
SHA-256 of its contents (`lowprec.state.integrity`); reading verifies them and refuses a torn or
altered file, and says what to do about a folder that has no lowprec state.

The Hugging Face callback writes it at `on_save` and reads it when the Trainer resumes.
Lightning keeps the same dict in its own checkpoint (`Callback.state_dict`): it needs no
file. torchtitan's converter keeps no rollout state in torchtitan's checkpoints (a resumed
job starts again from the plan's formats).
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from lowprec.state.durable import check_plain, save_atomically
from lowprec.state.ranks import process_rank
from lowprec.state.integrity import CorruptCheckpointError, payload_integrity, verify_payload

__all__ = ["STATE_DIR", "MissingRolloutStateError", "rollout_state_path", "save_rollout_state",
           "read_rollout_state", "weights_fingerprint", "differing_weights"]

STATE_DIR = "lowprec"


class MissingRolloutStateError(FileNotFoundError):
    """A framework checkpoint without lowprec's state (written without lowprec, or elsewhere)."""


def rollout_state_path(folder: str | Path, rank: int | None = None) -> Path:
    """Where rank `rank` (default: this process's) keeps its state in checkpoint `folder`."""
    return Path(folder) / STATE_DIR / f"rank_{process_rank() if rank is None else rank:05d}.pt"


def save_rollout_state(state: dict, folder: str | Path) -> Path:
    """Write this rank's `HostedRollout.state_dict()` into checkpoint `folder` (which the
    framework has written: a stray folder would look like a checkpoint to its resume)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"no checkpoint folder {folder} to put lowprec's rollout state in; the "
                                f"framework writes it first")
    check_plain(state, "rollout state")
    path = rollout_state_path(folder)
    path.parent.mkdir(exist_ok=True)
    return save_atomically(path, {**state, "integrity": payload_integrity(state)})


def read_rollout_state(folder: str | Path) -> dict:
    """This rank's rollout state from checkpoint `folder`, verified against its checksums."""
    path = rollout_state_path(folder)
    if not path.is_file():
        held = sorted(p.name for p in path.parent.glob("rank_*.pt")) if path.parent.is_dir() else []
        raise MissingRolloutStateError(
            f"{path} does not exist"
            + (f" ({path.parent} holds {', '.join(held)}: saved by another number of ranks?)" if held else
               f": {folder} holds no lowprec rollout state (a checkpoint written without lowprec, or by a "
               f"Trainer whose lowprec callback could not write there)"))
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise CorruptCheckpointError(path, f"torch.load failed ({type(e).__name__}: {str(e)[:200]}); it may be "
                                           f"torn (cut short) or damaged") from e
    if not isinstance(payload, dict):
        raise CorruptCheckpointError(path, f"it holds a {type(payload).__name__}, not a rollout state")
    verify_payload(payload, path)
    return {k: v for k, v in payload.items() if k != "integrity"}


def weights_fingerprint(model: nn.Module) -> dict[str, torch.Tensor]:
    """Per parameter, (sum, sum of squares) in float64: what ties a saved rollout state to the
    weights saved beside it, so that a state from another run or step is not taken for it."""
    out = {}
    for name, p in model.named_parameters():
        t = p.detach()
        t = (t.to_local() if hasattr(t, "to_local") else t).double()
        out[name] = torch.stack([t.sum(), t.square().sum()]).cpu()
    return out


def differing_weights(saved: dict[str, torch.Tensor], model: nn.Module) -> list[str]:
    """The parameters of `model` whose fingerprint is not `saved`'s (names missing on either
    side included); empty when the weights are the ones the state was saved with."""
    now = weights_fingerprint(model)
    names = sorted(set(saved) | set(now))
    return [n for n in names if n not in saved or n not in now
            or not torch.allclose(saved[n], now[n], rtol=1e-9, atol=1e-12)]
