"""torchtitan's pipeline stages as lowprec's rollout sees them: this rank's sites, every site of the model, one loss.

Under pipeline parallelism torchtitan (`torchtitan/distributed/pipeline_parallel.py`,
`pipeline_llm`) builds the whole model on the meta device, where lowprec's converter prepares
it (so its PrecisionState names every site and the plan's selectors saw the whole model), and
then deep-copies that model once per stage this rank holds, deleting the other stages'
modules (`model_parts`). Each copy carries a copy of the model's `Prepared`: every site by
name, each Site's module the copy's own, the deleted stages' sites orphaned.

`stages_of` turns that into what `HostedRollout` drives, as `lowprec run`'s pipeline engine
does (`lowprec.runtime.engines.parallel.local_state` and `Session(sites=...)`): a PrecisionState of
the sites this rank's parts hold (found by module identity, so a stage's renumbered block
list does not matter), and a `WholeModel` -- every site in forward order and the whole
model's block lists, kept at build time -- over which the controller decides, alike on every
rank. Format changes apply on the rank that holds the site; statistics of every site reach
every rank through the monitor's one all-gather (each rank packs zeros for sites it lacks).

`last_stage_loss`: torchtitan's schedule computes the loss on the last stage only (the other
stages' `forward_backward_step` returns -1); one broadcast over the pp mesh
(`lowprec.runtime.engines.pipeline_forward.from_last_stage`, as `lowprec run`'s pipeline engine does) gives
every stage the last stage's loss, so every rank measures the same step and decides alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lowprec.integrations.core import WholeModel
from lowprec.runtime.engines.parallel import local_state
from lowprec.runtime.engines.pipeline_forward import from_last_stage

__all__ = ["Stages", "stages_of", "last_stage_loss"]


@dataclass(frozen=True)
class Stages:
    """What a LowprecTrainer hosts on this rank: `model` (its one model part, or its parts in
    an `nn.ModuleList`), `state` (the sites those parts hold) and `whole` (None without
    pipeline parallelism)."""

    model: nn.Module
    state: object
    whole: WholeModel | None


def stages_of(model_parts: list[nn.Module], prepared: list, pipelined: bool) -> Stages:
    """This rank's Stages from torchtitan's `model_parts` and each part's `Prepared`."""
    if not pipelined:
        return Stages(model_parts[0], prepared[0].state, None)
    parts = []
    for part, p in zip(model_parts, prepared):
        mine = {id(m) for m in part.modules()}
        parts.append(local_state(p.state, [f for f, s in p.state.sites.items() if id(s.module) in mine]))
    every = prepared[0].state
    if len(parts) == 1:
        state = parts[0]
    else:   # a looped schedule: several stages on this rank, each part with its own copy of the sites
        from lowprec.sites.precision_state import PrecisionState
        state = PrecisionState([s for st in parts for s in st.sites.values()], every.backend,
                               every.kept_high_precision.items())
    model = model_parts[0] if len(model_parts) == 1 else nn.ModuleList(model_parts)
    return Stages(model, state, WholeModel(every, prepared[0].info))


def last_stage_loss(local: torch.Tensor, pp_mesh) -> torch.Tensor:
    """The last pipeline stage's `local` loss on every stage (one broadcast over `pp_mesh`);
    `local` itself without pipeline parallelism (`pp_mesh` None)."""
    if pp_mesh is None:
        return local
    out = local.detach().reshape(-1).sum().float().clone()   # -1 (shape [1]) on the other stages
    return from_last_stage(out, pp_mesh.get_group(), pp_mesh.size())
