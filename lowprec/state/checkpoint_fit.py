"""Whether a checkpoint's contents fit what it is loaded into, checked before anything is
restored: the model's keys and shapes, the optimizer's parameter groups, and the parts
(precision state, rollout controller) the caller passed against those the checkpoint holds.
Each mismatch is a ValueError that says what differs and how to build what fits."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

__all__: list[str] = []


def _check_parts(payload: dict, path: Path, precision, controller, keep_current=()) -> None:
    unknown = set(keep_current) - {"precision", "controller"}
    if unknown:
        raise ValueError(f"keep_current names {sorted(unknown)}; it takes 'precision' and 'controller'")
    for key, given, how in (("precision", precision, "the PrecisionState returned by prepare()"),
                            ("controller", controller, "the rollout controller")):
        if key in keep_current:
            if given is not None:
                raise ValueError(f"{key}= was given and keep_current names {key!r}: choose one")
            continue
        if payload[key] is not None and given is None:
            raise ValueError(f"{path} holds {key} state but no {key}= was given; pass {how}, as "
                             f"the run that wrote it did, or the run will not continue as it was")
        if payload[key] is None and given is not None:
            raise ValueError(f"{path} holds no {key} state (it was saved without {key}=) but a "
                             f"{key} was given; pass {key}=None or resume from a checkpoint that has one")


def _check_model(saved: dict, model: nn.Module, path: Path) -> None:
    live = model.state_dict()
    missing = sorted(set(live) - set(saved))
    unknown = sorted(set(saved) - set(live))
    shapes = [f"{k} (checkpoint {tuple(saved[k].shape)}, model {tuple(live[k].shape)})"
              for k in live if k in saved and isinstance(saved[k], torch.Tensor)
              and saved[k].shape != live[k].shape]
    if missing or unknown or shapes:
        raise ValueError(f"{path} does not fit this model: keys missing from the checkpoint "
                         f"{missing[:5]}, keys the model lacks {unknown[:5]}, shapes that differ "
                         f"{shapes[:5]}; build the model with the config that wrote the checkpoint "
                         f"(and prepare it with the same plan) before loading")


def _check_optim(saved: dict, optimizer: torch.optim.Optimizer, path: Path) -> None:
    want = [len(g["params"]) for g in optimizer.param_groups]
    got = [len(g["params"]) for g in saved.get("param_groups", [])]
    if want != got:
        raise ValueError(f"{path} has optimizer parameter groups of sizes {got}, this optimizer "
                         f"has {want}; create the optimizer over the same parameters and groups "
                         f"as the run that wrote the checkpoint")
