"""Train the small GPT under an FP8 precision plan: one process, DTensor TP, or FSDP2 (gloo).

Used by test_distributed.py, which runs

    python tests/lowprec/dist_worker.py OUT.pt single:FMT ...            (one process)
    python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        tests/lowprec/dist_worker.py OUT.pt tp:FMT fsdp:FMT ...          (2 gloo ranks)

and compares the results (`single` variants may go in the torchrun job too: rank 0 runs
them without a process group). Every run builds the same model (same seed), applies the same
plan (every linear layer of every block in FMT, backend `emulated`) and trains it for
STEPS AdamW steps on the same batches of real text bytes. OUT.pt (written by rank 0,
loadable with weights_only=True) maps each variant to its per-step losses, the weight
gradients of every precision site after the first backward (full tensors, single-process
layout), and facts that show the run was sharded and quantized.

Variants `{mode}:{format}[:noreduce]`:
  single  one process, no process group.
  tp      1-D mesh of 2 ranks; in every block attn.qkv and mlp.fc ColwiseParallel,
          attn.proj and mlp.proj RowwiseParallel; attention runs on each rank's heads
          (qkv's rows are grouped per rank first); every rank sees the full batch.
  fsdp    fully_shard on every block and on the root; each rank gets half of every
          batch; prepare(..., amax_group=WORLD) makes activation/gradient amaxes global.
  :noreduce  the same without the amax reduction (tp: no all-reduce over the shard group;
          fsdp: amax_group=None), CONTROL_STEPS steps: the control that shows the comparison can fail.
  layer   one PrecisionLinear on batch- and sequence-sharded inputs (layer_checks).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
for _p in (str(ROOT), str(HERE)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from experiments.model import build_gpt  # noqa: E402
from lowprec import prepare  # noqa: E402
from lowprec.sites.plan import PrecisionPlan  # noqa: E402
from small_gpt import batches, corpus_bytes  # noqa: E402

MODEL = dict(vocab_size=256, block_size=16, n_layer=2, n_head=2, d_model=32)
BATCH, SEQ, STEPS, LR, DATA_SEED = 4, 16, 20, 1e-3, 0
CONTROL_STEPS = 5   # a `:noreduce` control fails both comparisons from its first steps on
SITES = [f"blocks.{i}.{m}" for i in range(MODEL["n_layer"])
         for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")]


def plan_for(fmt: str) -> PrecisionPlan:
    """Every linear layer of every block in `fmt`; the output head stays high precision."""
    return PrecisionPlan.from_dict({
        "backend": "emulated", "amax_scope": "group",
        "keep_high_precision": [{"fqns": ["lm_head"]}],
        "rules": [{"name": "blocks", "select": {"glob": "blocks.*"}, "format": fmt,
                   "ladder": [fmt, "bf16"]}],
    })


def make_model():
    """The GPT with non-zero biases and LayerNorm parameters (the same in every run), so
    that the bias handling of sharded and partial outputs matters from the first step."""
    torch.manual_seed(0)
    model = build_gpt(**MODEL)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or ".ln" in name or name.startswith("ln_f"):
                p.add_(0.02 * torch.randn(p.shape, generator=g))
    return model


def data():
    return list(batches(corpus_bytes(), STEPS, batch=BATCH, t=SEQ, seed=DATA_SEED))


def _full(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor (a collective: every rank must call it), or t itself."""
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().clone()


def _site_grads(state, unpermute=None) -> dict[str, torch.Tensor]:
    """Full weight and bias gradients of every precision site (collective under DTensor)."""
    out = {}
    for fqn in SITES:
        m = state.site(fqn).module
        for name, p in (("weight", m.weight), ("bias", m.bias)):
            g = _full(p.grad)
            out[f"{fqn}.{name}"] = unpermute(fqn, g) if unpermute else g
    return out


class Reference:
    """A single-process model that redoes every step of a sharded run from its parameters.

    Chaining 20 steps lets FP32 rounding differences (a partial-sum all-reduce, a
    half-batch weight gradient) move a value across an FP8 rounding boundary sooner or
    later, after which two correct runs drift apart by 1e-5 and more. Redoing each step
    from the same parameters compares the numerics of every step without that drift.
    The reference keeps its own delayed-scaling histories: it records the amaxes of the
    same parameter states, so wrongly reduced amaxes in the sharded run would show.
    """

    def __init__(self, fmt: str):
        self.model = make_model()
        self.state = prepare(self.model, plan_for(fmt), seed=1)

    def step(self, params, x, y):
        self.model.load_state_dict(params)
        self.model.zero_grad()
        _, loss = self.model(x, y)
        loss.backward()
        return loss.item(), _site_grads(self.state)


def train(model, state, step_loss, unpermute=None, reference: Reference | None = None,
          is_rank0: bool = True, steps: int = STEPS) -> dict:
    """`steps` AdamW steps: the losses; with a reference, each step compared with it."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, per_step = [], []
    for x, y in data()[:steps]:
        if reference is not None:
            params = {}
            for n, p in model.named_parameters():
                t = _full(p)   # collective
                params[n] = unpermute(n.rsplit(".", 1)[0], t) if unpermute else t
        opt.zero_grad()
        loss, report = step_loss(model, x, y)
        loss.backward()
        if reference is not None:
            grads = _site_grads(state, unpermute)   # collective
            if is_rank0:
                ref_loss, ref_grads = reference.step(params, x, y)
                per_step.append({
                    "loss": report, "ref_loss": ref_loss,
                    # per gradient tensor: max |g - g_ref| / max |g_ref|, and the norm ratio
                    "grad_max": {k: ((grads[k] - g).abs().max() / g.abs().max()).item()
                                 for k, g in ref_grads.items()},
                    "grad_norm": {k: ((grads[k] - g).norm() / g.norm()).item()
                                  for k, g in ref_grads.items()}})
        opt.step()
        losses.append(report)
    stats = state.stats()
    return {"losses": losses, "per_step": per_step,
            "formats": sorted(set(state.formats().values())),
            "sites": sorted(state.sites),
            "sites_with_stats": sorted(stats),
            "stats_roles": sorted({r for s in stats.values() for r in s}),
            "amax_min": min(float(q.amax) for s in stats.values() for q in s.values())}


def single_run(fmt: str) -> dict:
    model = make_model()
    state = prepare(model, plan_for(fmt), seed=1)

    def step(m, x, y):
        _, loss = m(x, y)
        return loss, loss.item()

    return train(model, state, step)


# ----------------------------------------------------------------------------- tensor parallel

def tp_run(fmt: str, reduce: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from experiments.gpt_parallel import apply_tensor_parallel, qkv_rank_order

    import lowprec.sites.quantized_gemms as gemms

    tp = dist.get_world_size()
    mesh = init_device_mesh("cpu", (tp,), mesh_dim_names=("tp",))
    model = make_model()
    # prepare before sharding: parallelize_module hooks the PrecisionLinear modules themselves.
    # apply_tensor_parallel regroups qkv's rows (the same numbers in another order: a
    # tensor-wise amax and the element-wise optimizer do not see it; gradients are put back
    # below) and runs attention on each rank's heads.
    state = prepare(model, plan_for(fmt), seed=1)
    apply_tensor_parallel(model, mesh)
    placements = {fqn: s.module.weight.placements if isinstance(s.module.weight, DTensor) else None
                  for fqn, s in state.sites.items()}
    sharded = all(p is not None and isinstance(p[0], Shard) for p in placements.values())

    def unpermute(fqn, g):
        return g[torch.argsort(qkv_rank_order(g.shape[0], tp))] if fqn.endswith("attn.qkv") else g

    def step(m, x, y):
        _, loss = m(x, y)
        return loss, loss.item()   # the logits are replicated: every rank has this loss

    saved = gemms._shard_groups
    if not reduce:
        gemms._shard_groups = lambda mesh, placements: []
    try:
        out = train(model, state, step, unpermute, Reference(fmt), dist.get_rank() == 0,
                    STEPS if reduce else CONTROL_STEPS)
    finally:
        gemms._shard_groups = saved
    return {**out, "sharded": sharded}


# ----------------------------------------------------------------------------- FSDP2

def fsdp_run(fmt: str, reduce: bool) -> dict:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    model = make_model()
    state = prepare(model, plan_for(fmt), seed=1, amax_group=dist.group.WORLD if reduce else None)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    for m in model.modules():  # sum the gradients: each rank's loss is already divided by world
        if hasattr(m, "set_gradient_divide_factor"):
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
            m.set_gradient_divide_factor(1.0)
    sharded = all(isinstance(p, DTensor) for p in model.parameters())
    per = BATCH // world

    def step(m, x, y):
        _, loss = m(x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per])
        # This rank's share of the global-batch mean (equal shards, world a power of two):
        # every activation gradient is then the single process's, bit for bit. Delayed
        # scaling needs that: its first step uses scale 1, so it is not invariant to a
        # factor of 2 in the gradients as current (tensor-wise) scaling is.
        loss = loss / world
        total = loss.detach().clone()
        dist.all_reduce(total)
        return loss, total.item()

    return {**train(model, state, step, None, Reference(fmt), rank == 0, STEPS if reduce else CONTROL_STEPS),
            "sharded": sharded}


# ----------------------------------------------------------------------------- one layer

def layer_checks() -> dict:
    """One FP8 PrecisionLinear (replicated weight and bias) on an input sharded along the
    batch or the sequence, evenly and unevenly, against the same layer on one process:
    the relative max differences of y, dx, dw, db and the placements of y and dx."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from lowprec.sites.backends import get_backend
    from lowprec.numerics.formats import get_format
    from lowprec.sites.amax_scope import AmaxScope
    from lowprec.sites.layers import PrecisionLinear

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    fmt, backend = get_format("fp8_tensorwise"), get_backend("emulated")
    g = torch.Generator().manual_seed(0)
    w, b = 0.1 * torch.randn(24, 16, generator=g), 0.1 * torch.randn(24, generator=g)

    def rel(a, r):
        return ((a.full_tensor() - r).abs().max() / r.abs().max()).item()

    out = {}
    for shape, dim in (((4, 6, 16), 0), ((3, 5, 16), 0), ((4, 6, 16), 1), ((3, 5, 16), 1)):
        x = torch.randn(shape, generator=g)
        ref = PrecisionLinear(torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone()), fmt, backend)
        xr = x.clone().requires_grad_()
        ref(xr).square().sum().backward()
        lin = PrecisionLinear(torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Replicate()])),
                              torch.nn.Parameter(distribute_tensor(b.clone(), mesh, [Replicate()])),
                              fmt, backend, amax_scope=AmaxScope.GROUP)   # the whole input's amax: one process's
        xd = distribute_tensor(x.clone(), mesh, [Shard(dim)]).requires_grad_()
        y = lin(xd)
        y.square().sum().backward()
        out[f"{tuple(shape)} Shard({dim})"] = {
            "y": rel(y, ref(x).detach()), "dx": rel(xd.grad, xr.grad),
            "dw": rel(lin.weight.grad, ref.weight.grad), "db": rel(lin.bias.grad, ref.bias.grad),
            "placements": [str(y.placements), str(xd.grad.placements)]}
    lin = PrecisionLinear(torch.nn.Parameter(distribute_tensor(w.clone(), mesh, [Shard(0)])), None,
                          fmt, backend)
    try:
        lin(torch.randn(2, 16))
        out["mixed"] = "no error"
    except TypeError as e:
        out["mixed"] = str(e)
    return out


def main(out: str, variants: list[str]) -> None:
    torch.set_num_threads(1)
    distributed = "RANK" in os.environ
    if distributed:
        import torch.distributed as dist
        dist.init_process_group("gloo")
    results = {}
    try:
        for v in variants:
            mode, fmt, *rest = (v + ":").split(":")
            reduce = "noreduce" not in rest
            if mode == "single":   # no collective in it: rank 0 alone, the one that saves
                if not distributed or dist.get_rank() == 0:
                    results[v] = single_run(fmt)
            elif mode == "layer":
                results[v] = layer_checks()
            else:
                results[v] = {"tp": tp_run, "fsdp": fsdp_run}[mode](fmt, reduce)
                dist.barrier()
        if not distributed or dist.get_rank() == 0:
            torch.save(results, out)
    finally:
        if distributed:
            dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
