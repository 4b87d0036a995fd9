"""Atomic checkpoints of a training run: model, optimizer, precision, controller, data, RNG.

A run killed at any moment (SIGKILL, OOM killer, node loss) must resume from its last
*complete* checkpoint and go on exactly as if it had never stopped. So a checkpoint only
ever appears under its final name once every byte of it is on disk:

    single process    torch.save -> step_00000120.pt.tmp, flush, fsync,
                      os.replace -> step_00000120.pt, fsync the directory
    sharded / ranks   dcp.save (fsyncs every file) + one rank_RRRRR.pt per rank
                      -> step_00000120.tmp/, barrier, rank 0 fsyncs and renames it
                      -> step_00000120/, fsyncs the directory, barrier

`torch.distributed.checkpoint` is used whenever a parameter is a DTensor (FSDP2, tensor
parallel) or more than one rank runs: every rank then writes its own shards and its own
RNG and precision state (each rank's RNG differs). `save_checkpoint` is then collective.

A checkpoint holds the model and optimizer state dicts, the `PrecisionState` (formats,
delayed-scaling histories, stochastic-rounding generators), the controller's state, the
data position (whatever the caller's sampler needs, e.g. its generator state and the
batches consumed), free-form `extra`, and the RNG states: torch CPU, CUDA when it is
initialised, Python's `random` and NumPy's legacy global generator. Everything is plain
data that loads with `torch.load(weights_only=True)`; saving checks it and names an
offending entry, rather than leaving the surprise for the resume. Sharded, the optimizer
state is keyed by parameter FQN (`flatten_optimizer_state_dict`), so ranks that hold
different parameters (pipeline stages) each get their own back; an optimizer that has not
stepped yet is saved, and restored, without state, as `optimizer.state_dict()` does.

Every checkpoint carries checksums written atomically with it (`lowprec.state.integrity`): a
file holds the SHA-256 of each tensor and of the whole payload, a directory a
`manifest.json` of its files' SHA-256. `load_checkpoint` verifies them before it changes
anything and refuses a corrupt checkpoint (`CorruptCheckpointError`, naming the file and
the tensors). `latest_checkpoint` ignores temporary names (`*.tmp`) and, newest first,
verifies each candidate (reading every byte) and skips, with a warning naming it, one that
does not open (cut short by a copy or a full disk) or does not match its checksums.
`checkpoint_to_resume` tells "no checkpoint" (None) from "every checkpoint is bad"
(`NoUsableCheckpointError`, naming each one and why).

Saving step s then removes checkpoints beyond the newest `keep` and a killed writer's
temporaries; a save out of space raises `durable.NoSpaceError`, its temporary removed. Checkpoints of steps after s belong to a timeline that a rewind (or a resume
that fell back past a corrupt checkpoint) abandoned: resuming into them would undo the
rewind, yet the rewind may have gone further back than needed, so they are not deleted but
moved to `abandoned/` (out of reach of `latest_checkpoint`, rewinds and pruning; a later
abandonment of the same step replaces its file there). One writer (one run) per directory.
"""

from __future__ import annotations

import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from lowprec.state.checkpoint_fit import _check_model, _check_optim, _check_parts
from lowprec.state.ranks import process_rank, world_size
from lowprec.state.durable import check_plain, fsync_dir, no_space, save_atomically, write_synced
from lowprec.state.rng import check_rng_devices, restore_rng_state, rng_state
from lowprec.state.integrity import CorruptCheckpointError, payload_integrity, verify_manifest, verify_payload, \
    write_manifest

__all__ = ["save_checkpoint", "load_checkpoint", "latest_checkpoint", "list_checkpoints", "rng_state",
           "restore_rng_state", "verify_checkpoint",
           "checkpoint_to_resume", "checkpoint_mismatch", "CorruptCheckpointError", "NoUsableCheckpointError",
           "ABANDONED"]

FORMAT, VERSION = "lowprec.state.checkpoint", 2
_READS = (1, 2)   # version 1: written before checksums, loaded unverified
ABANDONED = "abandoned"
_FINAL = re.compile(r"^step_(\d{8,})(\.pt)?$")
_TEMP = re.compile(r"^step_\d{8,}(\.pt)?(\.old)?\.tmp$")


# ----------------------------------------------------------------------------- saving

def save_checkpoint(directory: str | os.PathLike, step: int, *, model: nn.Module,
                    optimizer: torch.optim.Optimizer, precision=None, controller=None,
                    data_state: dict | None = None, extra: dict | None = None, keep: int | None = 3,
                    _before_replace: Callable[[Path], None] | None = None) -> Path:
    """Write `directory/step_{step:08d}.pt` (or the `step_{step:08d}/` DCP directory) atomically;
    `step` is the step to resume at (steps completed so far).

    precision: the `PrecisionState` from `prepare`; controller: anything with state_dict().
    keep: how many checkpoints to keep (newest by step); None keeps all.
    _before_replace: test hook, called with the complete temporary path just before it is
        renamed to its final name (on rank 0 for a directory).
    Returns the final path. Collective when the model is sharded or several ranks run.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step must be an int >= 0, got {step!r}")
    if keep is not None and keep < 1:
        raise ValueError(f"keep must be >= 1 or None (keep all), got {keep!r}")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    local = {"format": FORMAT, "version": VERSION, "step": step, "world_size": _world()[1],
             "precision": None if precision is None else precision.state_dict(),
             "controller": None if controller is None else controller.state_dict(),
             "data": None if data_state is None else dict(data_state), "extra": extra,
             "rng": rng_state()}
    check_plain(local, "checkpoint")
    if _distributed(model):
        return _save_dcp(directory, step, model, optimizer, local, keep, _before_replace)
    payload = {**local, "model": model.state_dict(), "optim": optimizer.state_dict()}
    check_plain({"model": payload["model"], "optim": payload["optim"]}, "checkpoint")
    payload["integrity"] = payload_integrity(payload)
    final = save_atomically(directory / f"step_{step:08d}.pt", payload, _before_replace)
    _prune(directory, step, keep)
    return final


def _save_dcp(directory: Path, step: int, model, optimizer, local: dict, keep, before_replace) -> Path:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    rank, _ = _world()
    final, tmp = directory / f"step_{step:08d}", directory / f"step_{step:08d}.tmp"
    if rank == 0 and tmp.exists():
        shutil.rmtree(tmp)  # a killed writer's leftovers
    _barrier()
    fresh = not optimizer.state  # before the first step
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_dcp_options())
    if fresh:  # get_state_dict created the state with a zero-lr step (AdamW: step 1, zero moments);
        # forget it and save none, or the next step would be the optimizer's second
        optimizer.state.clear()
        optim_sd = {k: v for k, v in optim_sd.items() if not k.startswith("state.")}
    try:
        dcp.save({"model": model_sd, "optim": optim_sd},
                 storage_writer=dcp.FileSystemWriter(tmp, sync_files=True))
        write_synced(tmp / f"rank_{rank:05d}.pt", {**local, "dcp_optim": {"flat": True, "has_state": not fresh}})
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        raise no_space(e, tmp, final) or e   # a full disk: NoSpaceError, the temporary removed
    _barrier()  # every rank's files are on disk
    if rank == 0:
        write_manifest(tmp)   # the SHA-256 of every rank's files
        fsync_dir(tmp)
        if before_replace is not None:
            before_replace(tmp)
        aside = None
        if final.exists():  # the same step after a rewind; a kill between the renames leaves
            # the older checkpoints, and the previous step N under a temporary name
            aside = directory / f"step_{step:08d}.old.tmp"
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
        os.replace(tmp, final)
        fsync_dir(directory)
        if aside is not None:
            shutil.rmtree(aside)
        _prune(directory, step, keep)
    _barrier()  # nobody returns before the checkpoint is visible
    return final


def _dcp_options(flat: bool = True):
    """Optimizer state dicts keyed by parameter FQN throughout (`state.<fqn>.exp_avg`,
    `param_groups.<fqn>.lr`): unflattened, `param_groups` holds each group's list of FQNs,
    which DCP, keeping one copy of a non-tensor entry for all ranks, would give a rank that
    holds other parameters (a pipeline stage) as its own."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions
    return StateDictOptions(flatten_optimizer_state_dict=flat)


def _prune(directory: Path, step: int, keep: int | None) -> None:
    found = list_checkpoints(directory)
    stale = [p for p in directory.iterdir() if _TEMP.match(p.name)]  # a killed writer's
    older = [p for s, p in found if s <= step]
    stale += older[:-keep] if keep is not None else []
    newer = [p for s, p in found if s > step]  # a timeline abandoned by a rewind: kept aside
    if newer:
        aside = directory / ABANDONED
        aside.mkdir(exist_ok=True)
        for p in newer:
            _remove(aside / p.name)
            os.replace(p, aside / p.name)
        fsync_dir(aside)
        fsync_dir(directory)
    for p in stale:
        _remove(p)


def _remove(p: Path) -> None:
    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)


# ----------------------------------------------------------------------------- finding

def list_checkpoints(directory: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, path) of every checkpoint under its final name, oldest first (not verified)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in directory.iterdir()  # step_N.pt files, step_N dirs
                  if (m := _FINAL.match(p.name)) and p.is_dir() != bool(m.group(2)))


class NoUsableCheckpointError(ValueError):
    """The directory holds checkpoints, and not one of them can be loaded."""

    def __init__(self, directory: Path, bad: list[tuple[Path, Exception]]):
        self.directory, self.bad = Path(directory), [p for p, _ in bad]
        why = "; ".join(f"{p.name}: {e}" for p, e in bad)
        super().__init__(f"every checkpoint in {directory} is unusable ({len(bad)}): {why}. Nothing to resume "
                         f"from: restore a checkpoint from a copy, or start the run afresh in a new folder")


def verify_checkpoint(path: str | os.PathLike) -> dict:
    """Read `path` and check it against its checksums (every byte); its header (rank 0's for
    a directory). Raises CorruptCheckpointError (torn, damaged, checksums differ) or
    ValueError (not a lowprec checkpoint, another version)."""
    path = Path(path)
    if path.is_dir():
        header = _read_header(path / "rank_00000.pt", mmap=True)
        if header["version"] >= 2:
            verify_manifest(path)
        elif not (path / ".metadata").is_file():
            raise CorruptCheckpointError(path, "it has no .metadata file")
        return header
    header = _read_header(path, mmap=True)
    if header["version"] >= 2:
        verify_payload(header, path)
    return header


def _scan(directory) -> tuple[Path | None, list[tuple[Path, Exception]]]:
    """The newest checkpoint that verifies, and the newer ones that did not (with why)."""
    bad = []
    for _, p in reversed(list_checkpoints(directory)):
        try:
            verify_checkpoint(p)
            return p, bad
        except Exception as e:  # noqa: BLE001 - any failure means "not usable"
            bad.append((p, e))
            warnings.warn(f"skipping checkpoint {p}: {e}", stacklevel=3)
    return None, bad


def latest_checkpoint(directory: str | os.PathLike) -> Path | None:
    """The newest checkpoint in `directory` that opens and matches its checksums, or None.
    Temporaries are ignored; a bad candidate is skipped with a warning naming it."""
    return _scan(directory)[0]


def checkpoint_to_resume(directory: str | os.PathLike) -> Path | None:
    """As latest_checkpoint, but None only when `directory` holds no checkpoint at all;
    when it holds some and every one is bad, NoUsableCheckpointError names them."""
    good, bad = _scan(directory)
    if good is None and bad:
        raise NoUsableCheckpointError(Path(directory), bad)
    return good


def _read_header(path: Path, mmap: bool = False) -> dict:
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except Exception as e:
        if "Weights only load failed" in str(e):   # torch's UnpicklingError: not torn, refused as unsafe
            what = next((ln.strip() for ln in str(e).splitlines() if "GLOBAL" in ln), "objects, not plain data")
            raise CorruptCheckpointError(path, f"it was refused, not loaded: it is an unsafe pickle ({what}), not "
                                               f"plain data, and unpickling it could run arbitrary code (lowprec "
                                               f"loads checkpoints with torch.load(weights_only=True) only)") from None
        raise CorruptCheckpointError(path, f"it is not a complete lowprec checkpoint: torch.load failed "
                                           f"({type(e).__name__}: {str(e)[:200]}); it may be torn (cut short) "
                                           f"or damaged") from e
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{path} is not a lowprec checkpoint (no format={FORMAT!r} entry); "
                         f"write checkpoints with lowprec.state.checkpoint.save_checkpoint")
    if payload.get("version") not in _READS:
        raise ValueError(f"{path} has checkpoint version {payload.get('version')!r}; this lowprec "
                         f"reads versions {list(_READS)}")
    return payload


# ----------------------------------------------------------------------------- loading

def load_checkpoint(path: str | os.PathLike, *, model: nn.Module, optimizer: torch.optim.Optimizer,
                    precision=None, controller=None, restore_rng: bool = True,
                    keep_current: tuple[str, ...] = ()) -> dict:
    """Restore a checkpoint written by `save_checkpoint` into live objects.

    keep_current: parts ("precision", "controller") the checkpoint holds that are
        deliberately not restored; a rewind keeps the precision map and the controller's
        memory of what went wrong, and restores only model, optimizer and data position.

    Model, optimizer, the parts present and the RNG devices are checked against the
    checkpoint before anything is changed. Returns {"step", "data_state",
    "extra", "path"}: resume the loop at `step` and reposition the data with `data_state`.
    Collective for a checkpoint directory (sharded or multi-rank runs).
    """
    path = Path(path)
    if not path.exists():
        found = [p.name for _, p in list_checkpoints(path.parent)]
        raise FileNotFoundError(
            f"no checkpoint at {path}; {path.parent} holds {found or 'no checkpoints'}. "
            f"Use latest_checkpoint({str(path.parent)!r}) to find the newest complete one")
    if path.is_dir():  # dcp.load plans (and checks every key and shape) before it reads
        verify_checkpoint(path)
        payload = _load_dcp(path, model, optimizer, restore_rng, precision, controller, keep_current)
    else:
        if _distributed(model):
            raise ValueError(f"{path} is a single-process checkpoint but this model is sharded or "
                             f"runs on several ranks; resume it in one process, or save sharded "
                             f"runs with save_checkpoint (which writes a directory)")
        payload = _read_header(path)
        if payload["version"] >= 2:
            verify_payload(payload, path)
        _check_parts(payload, path, precision, controller, keep_current)
        _check_model(payload["model"], model, path)
        _check_optim(payload["optim"], optimizer, path)
    if restore_rng:
        check_rng_devices(payload["rng"], path)
    if precision is not None:  # validates sites and format names before switching any
        try:
            precision.load_state_dict(payload["precision"])
        except (ValueError, KeyError) as e:
            raise ValueError(f"precision state in {path} does not fit: {e}") from e
    if controller is not None:
        controller.load_state_dict(payload["controller"])
    if not path.is_dir():
        model.load_state_dict(payload["model"])
        optimizer.load_state_dict(payload["optim"])
    if restore_rng:
        restore_rng_state(payload["rng"])
    return {"step": payload["step"], "data_state": payload["data"], "extra": payload["extra"],
            "path": path}


def _load_dcp(path: Path, model, optimizer, restore_rng: bool, precision, controller, keep_current=()) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    rank, world = _world()
    own = path / f"rank_{rank:05d}.pt"
    local = _read_header(own if own.is_file() else path / "rank_00000.pt")
    if restore_rng and (local["world_size"] != world or not own.is_file()):
        raise ValueError(f"{path} was written by {local['world_size']} ranks, this run has {world}: "
                         f"per-rank RNG states cannot be restored. Resume with {local['world_size']} "
                         f"ranks, or pass restore_rng=False (model and optimizer are resharded)")
    _check_parts(local, path, precision, controller, keep_current)
    if restore_rng:
        check_rng_devices(local["rng"], path)
    layout = local.get("dcp_optim", {"flat": False, "has_state": True})  # as lowprec wrote it before
    options = _dcp_options(layout["flat"])
    model_sd, optim_sd = get_state_dict(model, optimizer, options=options)
    state = {"model": model_sd,  # saved before the first step: param groups only
             "optim": {k: v for k, v in optim_sd.items() if layout["has_state"] or not k.startswith("state.")}}
    try:
        dcp.load(state, storage_reader=dcp.FileSystemReader(path))
    except (Exception, CheckpointException) as e:  # CheckpointException is a BaseException
        failures = getattr(e, "failures", None)
        cause = next(iter(failures.values())) if failures else e  # rank -> (exception, trace)
        cause = cause[0] if isinstance(cause, tuple) else cause
        raise ValueError(f"{path} does not fit this model/optimizer ({type(cause).__name__}: "
                         f"{str(cause)[:300]}); build the model with the config that wrote it, prepare "
                         f"and shard it the same way, and create the same optimizer") from e
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict={**optim_sd, **state["optim"]}, options=options)
    if not layout["has_state"]:
        optimizer.state.clear()  # as it was when saved: the next step is its first
    return local


def checkpoint_mismatch(path: str | os.PathLike, model: nn.Module) -> str | None:
    """Where the checkpoint at `path` does not fit `model`, in a few words (the first parameter
    whose shape differs, or that one side lacks), or None when it fits. Reads the file with mmap,
    changes nothing; a sharded (directory) checkpoint is not read here (None)."""
    path = Path(path)
    if path.is_dir():
        return None
    saved, live = _read_header(path, mmap=True)["model"], model.state_dict()
    for k, t in live.items():
        if k not in saved:
            return f"the model has {k}, which the checkpoint {path.name} lacks"
        if isinstance(t, torch.Tensor) and isinstance(saved[k], torch.Tensor) and saved[k].shape != t.shape:
            return f"{k} is {tuple(t.shape)} in this model but {tuple(saved[k].shape)} in the checkpoint {path.name}"
    extra = next((k for k in saved if k not in live), None)
    return None if extra is None else f"the checkpoint {path.name} has {extra}, which this model lacks"


# ----------------------------------------------------------------------------- distributed

def _world() -> tuple[int, int]:
    return process_rank(), world_size()


def _barrier() -> None:
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _distributed(model: nn.Module) -> bool:
    """Sharded parameters (DTensor: FSDP2, tensor parallel) or several ranks: use DCP."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        DTensor = ()
    return _world()[1] > 1 or any(isinstance(p, DTensor) for p in model.parameters())
