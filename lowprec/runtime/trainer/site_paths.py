"""Which path each site's GEMMs took and how FSDP2 gathered its weight, for summary.json and MLflow.

    paths = site_paths(state, engine)     # a collective under torchrun: every rank calls it
    paths["blocks.0.mlp.fc"]  ->  {"fast_calls": 40, "slow_calls": 0, "all_gather": "float8_e4m3fn"}

`fast_calls` / `slow_calls`: the forwards of the site's PrecisionLinear that ran the FP8 fast
path (plain tensors, DTensor shards and data-parallel amaxes alike) or the reference
quantized GEMMs (`lowprec.sites.layers`) over the whole run (replays and eval forwards
included; the counts up to a checkpoint are in its precision state, so a resumed run counts
from the start, not from the resume), summed over the ranks.
`all_gather`: the dtype FSDP2 gathers the site's weight in from the next step: an FP8 dtype
under `parallel.fp8_all_gather` while the site runs tensor-wise FP8, else the weight's own
dtype; null where no FSDP2 shards the model (one process, replicated data parallel, tp, pp),
and for an expert site (`lowprec.sites.experts`: its projections' forwards on the grouped FP8
kernel or the emulated grouped GEMM; its weights are its experts module's 3-D parameters,
gathered whole). Sites of a backend without these counters (torchao, te) are left out.

Rank 0 writes them to summary.json (`site_paths`) and logs them to MLflow as metrics at the
last step (`path/<site>/fast_calls`, `path/<site>/slow_calls`) and as the tag
`lowprec.all_gather` (the sites by gathered dtype).
"""

from __future__ import annotations

from collections import defaultdict

__all__ = ["site_paths", "path_metrics", "all_gather_tag"]


def _dtype_name(dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _local(engine, state) -> dict[str, dict]:
    from torch.distributed.fsdp import FSDPModule
    from lowprec.sites.fp8_allgather import fp8_gather_dtype
    sharded = isinstance(engine.module, FSDPModule)
    fp8_sites = set(getattr(engine, "fp8_gathered", ()) or ())
    out = {}
    for fqn, site in state.sites.items():
        m = site.module
        if not hasattr(m, "fast_calls"):
            continue
        gathered = None
        if sharded and hasattr(m, "weight"):   # an expert site's weights are its experts module's, gathered whole
            fp8 = fp8_gather_dtype(m) if fqn in fp8_sites else None
            gathered = _dtype_name(fp8 if fp8 is not None else m.weight.dtype)
        out[fqn] = {"fast_calls": int(m.fast_calls), "slow_calls": int(m.slow_calls), "all_gather": gathered}
    return out


def site_paths(state, engine) -> dict[str, dict]:
    """Every site's calls by path (summed over the ranks) and its all-gather dtype; see the module docstring."""
    from lowprec.state.ranks import from_every_rank
    merged: dict[str, dict] = {}
    for part in from_every_rank(_local(engine, state)):
        for fqn, row in part.items():
            have = merged.setdefault(fqn, {"fast_calls": 0, "slow_calls": 0, "all_gather": None})
            have["fast_calls"] += row["fast_calls"]
            have["slow_calls"] += row["slow_calls"]
            have["all_gather"] = have["all_gather"] or row["all_gather"]
    return merged


def path_metrics(paths: dict[str, dict]) -> dict[str, float]:
    """MLflow metrics of `site_paths`: `path/<site>/fast_calls` and `path/<site>/slow_calls`."""
    return {f"path/{fqn}/{k}": float(row[k]) for fqn, row in paths.items() for k in ("fast_calls", "slow_calls")}


def all_gather_tag(paths: dict[str, dict]) -> dict[str, str]:
    """The `lowprec.all_gather` tag, `float8_e4m3fn: blocks.0.mlp.fc, ...; float32: ...`, or none without FSDP2."""
    by_dtype: dict[str, list[str]] = defaultdict(list)
    for fqn, row in paths.items():
        if row["all_gather"] is not None:
            by_dtype[row["all_gather"]].append(fqn)
    if not by_dtype:
        return {}
    return {"lowprec.all_gather": "; ".join(f"{d}: {', '.join(sites)}" for d, sites in sorted(by_dtype.items()))}
