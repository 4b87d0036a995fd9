"""Train the small GPT on the `torch` backend's FP8 fast path: one process, or under torchrun (gloo).

Used by test_fast_path_distributed.py:

    python dist_fast_worker.py OUT.pt single:FMT:SCOPE ...
    python -m torch.distributed.run --standalone --nproc-per-node N dist_fast_worker.py OUT.pt MODE:FMT:SCOPE ...

MODE: `single` (one process's run, the whole batch, no process group in it: alone or on
rank 0 of a launch), `fsdp` (FullyShardedDP over every rank:
DP N), `dptp` (lowprec.runtime.engines.parallel.data_parallel on a (dp_replicate N/2, tp 2) mesh: TP 2, DP N/2;
with N == 2 that is TP 2 alone), `layer` (one PrecisionLinear on data- and
tensor-parallel shards against the same layer on the whole tensors, on every rank),
`fsdp8` / `fsdphp` (FSDP2 with / without FP8 all-gather, one site falling back at step 2),
`fsdptp8` / `fsdptphp` and `hsdp8` / `hsdphp` (the same under FSDP2 x TP 2 and HSDP 2 x 2),
`ledger` / `ledger_fsdptp` (the collectives per step, experiments/ledger.py, FSDP2 / FSDP2
x TP 2), `ckpt_fsdptp` (`fsdptp8` with a DCP checkpoint after step 3 and an exact resume;
the checkpoint stays beside OUT.pt) and `reshard_fsdptp` (2 ranks load the 4-rank
checkpoint and train on).
SCOPE: `group` or `local` (`precision.amax_scope`). OUT.pt (rank 0) maps each variant to
its per-step losses, the per-site fast-path / fallback call counts of every rank, and for
`fsdp` each rank's loss of its own rows at the initial weights (no gradient step). Each rank
prints each variant's wall and CPU seconds (in the launch's log: where a launch's time goes).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[3]
for _p in (str(ROOT), str(ROOT / "tests" / "lowprec")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from dist_worker import BATCH as DATA_BATCH, DATA_SEED, MODEL, SEQ, make_model  # noqa: E402
from small_gpt import batches  # noqa: E402
from fast_path_checks import ScaledMMFlags  # noqa: E402
from lowprec import prepare  # noqa: E402
from lowprec.sites.plan import PrecisionPlan  # noqa: E402

STEPS, LR, BATCH = 5, 1e-3, 4
# `layer` and `seq` run every GEMM with the opposite of torchao's `use_fast_accum` and
# report the flag each `_scaled_mm` got (on CPU the flag changes no bit)
GEMM_FLAGS = (False, True, True)


def _gemm():
    from lowprec.sites.gemm_config import GemmConfig, LinearGemmConfig
    return LinearGemmConfig(*(GemmConfig(f) for f in GEMM_FLAGS))


def data() -> list:
    """The batches every variant trains on: windows of seeded random byte tokens, the same
    in every checkout. Not `dist_worker.data`, whose corpus is ../shared's play when present
    and else this repository's own sources (so it changed with the code and between a
    workspace and a fresh clone). The group-scope checks compare 5 chained steps of sharded
    and one-process training: their FP32 reductions round differently (see
    test_fast_path_distributed.py), which after a weight update can move a value across an
    FP8 rounding boundary; whether that happens within 5 steps depends on the data, so the
    data must not change under the test."""
    tokens = torch.randint(0, MODEL["vocab_size"], (200_000,), generator=torch.Generator().manual_seed(DATA_SEED))
    return list(batches(tokens, STEPS, batch=DATA_BATCH, t=SEQ, seed=DATA_SEED))


def plan_for(fmt: str, scope: str) -> PrecisionPlan:
    return PrecisionPlan.from_dict({
        "backend": "torch", "amax_scope": scope,
        "keep_high_precision": [{"fqns": ["lm_head"]}],
        "rules": [{"name": "blocks", "select": {"glob": "blocks.*"}, "format": fmt, "ladder": [fmt, "bf16"]}],
    })


def _counts(state) -> dict:
    return {f: (s.module.fast_calls, s.module.slow_calls) for f, s in state.sites.items()}


def _gather(obj) -> list:
    import torch.distributed as dist
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _train(model, state, engine_step, gather=_gather) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for x, y in data()[:STEPS]:
        opt.zero_grad()
        losses.append(float(engine_step(x, y)))
        opt.step()
    return {"losses": losses, "counts": gather(_counts(state)), "sites": sorted(state.sites)}


def single_run(fmt: str, scope: str, rows=None) -> dict:
    model = make_model()
    state = prepare(model, plan_for(fmt, scope), seed=1)
    out = _train(model, state, lambda x, y: _single_step(model, x, y), gather=lambda obj: [obj])
    fresh = make_model()
    prepare(fresh, plan_for(fmt, scope), seed=1)
    with torch.no_grad():   # the loss of rows r::n of the first batch, for n in (2, 4): local scope
        x, y = data()[0]
        out["row_losses"] = {n: [fresh(x[r::n], y[r::n])[1].item() for r in range(n)] for n in (2, 4)}
    return out


def _single_step(model, x, y):
    _, loss = model(x, y)
    loss.backward()
    return loss.detach()


def fsdp_run(fmt: str, scope: str) -> dict:
    import torch.distributed as dist
    from lowprec.runtime.engines.fsdp import FullyShardedDP
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    state = prepare(model, plan_for(fmt, scope), seed=1, amax_group=dist.group.WORLD)
    engine = FullyShardedDP(model, mesh_or_group=dist.group.WORLD)
    x0, y0 = data()[0]
    with torch.no_grad():
        own = model(x0[rank::world], y0[rank::world])[1].item()
    for s in state.sites.values():   # the forward above is no training step: forget it
        s.module.fast_calls = s.module.slow_calls = 0
        s.module._reset_histories()
    step, ref_losses = _with_reference(model, fmt, scope, lambda x, y: engine.forward_backward(x[rank::world],
                                                                                               y[rank::world]))
    out = _train(model, state, step)
    return {**out, "own_row_loss": _gather(own), "ref_losses": ref_losses}


def fsdp8_run(fmt: str, scope: str, fp8_all_gather: bool = True) -> dict:
    """FSDP2 with the weights gathered in FP8; at step FALLBACK_STEP one site falls back to
    bf16 on every rank (it gathers its high-precision weight from then on)."""
    import torch.distributed as dist
    from lowprec.runtime.engines.fsdp import FullyShardedDP
    from lowprec.numerics.formats import get_format
    world, rank = dist.get_world_size(), dist.get_rank()
    model = make_model()
    state = prepare(model, plan_for(fmt, scope), seed=1, amax_group=dist.group.WORLD)
    engine = FullyShardedDP(model, mesh_or_group=dist.group.WORLD, fp8_all_gather=fp8_all_gather)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses, gathered = [], []
    for step, (x, y) in enumerate(data()[:STEPS]):
        if step == FALLBACK_STEP:
            state.site(FALLBACK_SITE).module.set_format(get_format("bf16"))
        opt.zero_grad()
        losses.append(float(engine.forward_backward(x[rank::world], y[rank::world])))
        gathered.append(sorted(type(s.module.weight).__name__ == "FP8GatheredWeight" for s in state.sites.values()
                               if s.module.weight is not None and not hasattr(s.module.weight, "to_local")).count(True))
        opt.step()
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.state_dict().items()}
    return {"losses": losses, "counts": _gather(_counts(state)), "sites": sorted(state.sites),
            "state_types": sorted({type(getattr(v, "_local_tensor", v)).__name__ for v in model.state_dict().values()}),
            "params": full, "wrapped": engine.fp8_gathered}


FALLBACK_STEP, FALLBACK_SITE = 2, "blocks.0.mlp.fc"
CKPT_STEP = 3


def _dptp(fmt: str, scope: str):
    import torch.distributed as dist
    from lowprec.runtime.engines.mesh import build_mesh, data_group, data_rank
    from lowprec.runtime.engines.parallel import data_parallel
    dp = dist.get_world_size() // 2
    mesh = build_mesh("cpu", dp_replicate=dp, tp=2)
    model = make_model()
    state = prepare(model, plan_for(fmt, scope), seed=1, amax_group=data_group(mesh) if dp > 1 else None)
    engine = data_parallel(model, mesh, microbatches=1)
    return model, state, engine, torch.optim.AdamW(model.parameters(), lr=LR), data_rank(mesh), dp


def _dptp_steps(engine, opt, r: int, dp: int, first: int, last: int) -> list[float]:
    out = []
    for x, y in data()[first:last]:
        opt.zero_grad()
        out.append(float(engine.forward_backward(x[r::dp], y[r::dp])))
        opt.step()
    return out


def _fsdptp(fmt: str, scope: str, fp8: bool = True, tp: int = 2):
    """FSDP2 x TP (lowprec.runtime.engines.parallel.data_parallel) on a (dp_shard, tp) mesh of
    every rank; tp 1 is FSDP2 alone. (model, state, engine, optimizer, dp rank, dp)."""
    import torch.distributed as dist
    from lowprec.runtime.engines.mesh import build_mesh, data_group, data_rank
    from lowprec.runtime.engines.parallel import data_parallel
    dp = dist.get_world_size() // tp
    mesh = build_mesh("cpu", dp_shard=dp, tp=tp)
    model = make_model()
    state = prepare(model, plan_for(fmt, scope), seed=1, amax_group=data_group(mesh) if dp > 1 else None)
    engine = data_parallel(model, mesh, microbatches=1, fp8_all_gather=fp8)
    return model, state, engine, torch.optim.AdamW(model.parameters(), lr=LR), data_rank(mesh), dp


def _hsdp(fmt: str, scope: str, fp8: bool = True):
    """HSDP (lowprec.runtime.engines.parallel.data_parallel) on a (2, world/2) mesh; as `_fsdptp`."""
    import torch.distributed as dist
    from lowprec.runtime.engines.mesh import build_mesh
    from lowprec.runtime.engines.parallel import data_parallel
    world = dist.get_world_size()
    mesh = build_mesh("cpu", dp_replicate=2, dp_shard=world // 2)
    model = make_model()
    state = prepare(model, plan_for(fmt, scope), seed=1, amax_group=dist.group.WORLD)
    engine = data_parallel(model, mesh, microbatches=1, fp8_all_gather=fp8)
    return model, state, engine, torch.optim.AdamW(model.parameters(), lr=LR), dist.get_rank(), world


def _watch_fp8(state) -> list:
    """Per forward of a site: whether FSDP2 handed it FP8 bytes (lowprec.sites.fp8_allgather)."""
    seen = []
    for s in state.sites.values():
        s.module.register_forward_pre_hook(lambda m, a: seen.append(
            getattr(getattr(m.weight, "_local_tensor", m.weight), "fp8", False)))
    return seen


def gather2d_run(fmt: str, scope: str, layout: str, fp8: bool, ckpt: Path | None = None) -> dict:
    """FSDP2 x TP 2 (`fsdptp`) or HSDP 2 x 2 (`hsdp`) with / without FP8 all-gather, one site
    falling back to bf16 at FALLBACK_STEP on every rank: losses, the whole parameters after
    STEPS steps, the state_dict's local types, the counters. With `ckpt` (a directory) a DCP
    checkpoint after CKPT_STEP, and a fresh model that resumes from it (`resumed`)."""
    from torch.distributed.checkpoint import FileSystemReader
    from lowprec.numerics.formats import get_format
    from lowprec.state.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    build = _fsdptp if layout == "fsdptp" else _hsdp
    model, state, engine, opt, r, dp = build(fmt, scope, fp8)
    seen = _watch_fp8(state)
    losses = _dptp_steps(engine, opt, r, dp, 0, FALLBACK_STEP)
    state.site(FALLBACK_SITE).module.set_format(get_format("bf16"))
    losses += _dptp_steps(engine, opt, r, dp, FALLBACK_STEP, CKPT_STEP)
    if ckpt is not None:
        save_checkpoint(ckpt, CKPT_STEP, model=model, optimizer=opt, precision=state)
    losses += _dptp_steps(engine, opt, r, dp, CKPT_STEP, STEPS)
    full = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
            for n, p in model.state_dict().items()}
    out = {"losses": losses, "counts": _gather(_counts(state)), "params": full,
           "state_types": sorted({type(getattr(v, "_local_tensor", v)).__name__ for v in model.state_dict().values()}),
           "wrapped": engine.fp8_gathered, "fp8_forwards": _gather(sum(seen))}
    if ckpt is not None:
        model, state, engine, opt, r, dp = build(fmt, scope, fp8)
        got = load_checkpoint(latest_checkpoint(ckpt), model=model, optimizer=opt, precision=state)
        out["resumed"] = _dptp_steps(engine, opt, r, dp, got["step"], STEPS)
        meta = FileSystemReader(str(latest_checkpoint(ckpt))).read_metadata().state_dict_metadata
        out["weight_dtypes"] = {k: str(v.properties.dtype) for k, v in meta.items()
                                if hasattr(v, "properties") and k.endswith(".weight") and ".blocks." in f".{k}"}
    return out


def reshard_fsdptp_run(fmt: str, scope: str, out_dir: Path) -> dict:
    """TP 2 on 2 ranks (dp_shard 1, FP8 all-gather) loads the 4-rank DP 2 x TP 2 checkpoint
    (DCP resharding: the dp shards folded, another world) and trains on. The tp degree
    stays: the reference GPT's TP plan stores qkv's rows in tp-rank order."""
    from lowprec.state.checkpoint import latest_checkpoint, load_checkpoint
    model, state, engine, opt, r, dp = _fsdptp(fmt, scope, tp=2)
    got = load_checkpoint(latest_checkpoint(out_dir / "ckpt_fsdptp_w4"), model=model, optimizer=opt,
                          precision=state, restore_rng=False)   # per-rank RNG states belong to 4 ranks
    return {"step": got["step"], "resumed": _dptp_steps(engine, opt, r, dp, got["step"], STEPS),
            "wrapped": engine.fp8_gathered}


LEDGER_MODEL = dict(vocab_size=256, block_size=16, n_layer=4, n_head=4, d_model=128)
# the rows of each rank's ledger batch: 1 sequence of 4 tokens. Collectives and their bytes do not
# depend on the batch (the weights, gradients, amaxes and statistics are what moves), and each FP8
# forward GEMM runs on this CPU in torch's reference `_scaled_mm` kernel, ~0.3 s at 32 rows, linear
# in the rows (2 ranks' 32 rows a step: 20 s of CPU per rank and variant; 4 rows: about 3)
LEDGER_ROWS = (1, 4)


def _ledger_engine(model, fmt: str, scope: str, fp8_gather: bool, tp: int):
    """(state, engine, dp rank, dp) of the ledger's GPT: FSDP2 over every rank (tp 1) or
    FSDP2 x TP on a (world/tp, tp) mesh."""
    import torch.distributed as dist
    from lowprec.runtime.engines.fsdp import FullyShardedDP
    from lowprec.runtime.engines.mesh import build_mesh, data_group, data_rank
    from lowprec.runtime.engines.parallel import data_parallel
    if tp == 1:
        state = prepare(model, plan_for(fmt, scope), seed=1, amax_group=dist.group.WORLD)
        engine = FullyShardedDP(model, mesh_or_group=dist.group.WORLD, fp8_all_gather=fp8_gather)
        return state, engine, dist.get_rank(), dist.get_world_size()
    dp = dist.get_world_size() // tp
    mesh = build_mesh("cpu", dp_shard=dp, tp=tp)
    state = prepare(model, plan_for(fmt, scope), seed=1, amax_group=data_group(mesh))
    engine = data_parallel(model, mesh, microbatches=1, fp8_all_gather=fp8_gather)
    return state, engine, data_rank(mesh), dp


def ledger_run(fmt: str, scope: str, tp: int = 1) -> dict:
    """The collectives of 4 FSDP2 (x TP `tp`) steps of a BF16 GPT (blocks dominating its
    weights), with and without FP8 all-gather, the controller's monitor checking every 2nd
    step: per configuration and step, role -> (count, bytes, on the critical path)."""
    import torch.distributed as dist
    from experiments.ledger import CollectiveLedger
    from experiments.model import build_gpt
    from lowprec.policy.monitor import Monitor, MonitorConfig
    out = {}
    for fp8_gather in (False, True):
        torch.manual_seed(0)
        model = build_gpt(**LEDGER_MODEL).to(torch.bfloat16)
        state, engine, rank, world = _ledger_engine(model, fmt, scope, fp8_gather, tp)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        monitor = Monitor(state, MonitorConfig(check_every=2), group=dist.group.WORLD)
        steps, checks = [], []
        for step, (x, y) in enumerate(data()[:4]):
            x, y = (t[rank::world][:LEDGER_ROWS[0], :LEDGER_ROWS[1]] for t in (x, y))
            ledger = CollectiveLedger()
            monitor.before_step(step)
            with ledger, ledger.phase("fwd_bwd"):
                loss = engine.forward_backward(x, y)
            with ledger, ledger.phase("step"):
                monitor.record(step, loss, torch.zeros(()))
                opt.step()
                opt.zero_grad()
            if monitor.is_check_step(step):
                with ledger, ledger.phase("check"):
                    sites = monitor.check(step).sites
                assert len(sites) == len(state.sites), sorted(sites)
                checks.append(repr(sorted(sites.items())))   # what the controller decides on
            steps.append(ledger.table())
        out["fp8_gather" if fp8_gather else "hp_gather"] = steps
        out[f"checks_{'fp8' if fp8_gather else 'hp'}"] = _gather(checks)
        out["fast_calls"] = _gather(_counts(state))
    return out



def _with_reference(model, fmt: str, scope: str, run_step, tp: int = 1):
    """`run_step` with, before it at each step, one process's loss (no process group) at the
    run's own parameters on the whole batch: (the step, the list it fills). The reference is a
    model of its own that takes a forward and backward at each step, so delayed histories record
    the same parameter states. 5 chained steps of a run and of one process drift apart by FP32
    reductions moving a value across an FP8 rounding boundary (data and CPU dependent: seen 5e-5
    relative at step 3 under DP x TP, and 3.7e-6 at step 4 under FSDP2 with fp8_rowwise on an
    AVX2 CPU where an AVX-512 one stayed within 1e-6); at the same parameters only the reductions
    of one step differ. tp: apply_tensor_parallel's qkv row order is undone over `tp` ranks."""
    from experiments.gpt_parallel import qkv_rank_order
    ref = make_model()
    prepare(ref, plan_for(fmt, scope), seed=1)
    ref_losses = []

    def step(x, y):
        params = {}
        for n, p in model.named_parameters():
            t = (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()   # collective
            if tp > 1 and ".attn.qkv." in n:   # apply_tensor_parallel's row order back to the model's
                t = t[torch.argsort(qkv_rank_order(t.shape[0], tp))]
            params[n] = t
        ref.load_state_dict(params, strict=False)
        ref.zero_grad()
        _, loss = ref(x, y)
        loss.backward()
        ref_losses.append(loss.item())
        return run_step(x, y)

    return step, ref_losses


def dptp_run(fmt: str, scope: str) -> dict:
    """DP x TP, with `ref_losses` (`_with_reference`)."""
    model, state, engine, _, r, dp = _dptp(fmt, scope)
    step, ref_losses = _with_reference(model, fmt, scope, lambda x, y: engine.forward_backward(x[r::dp], y[r::dp]),
                                       tp=2)
    return {**_train(model, state, step), "ref_losses": ref_losses}


def layer_checks(fmt: str, scope: str) -> dict:
    """One PrecisionLinear, column- then row-parallel on a (dp, tp) mesh with rows split over
    dp, against the same layer on the whole tensors: max |difference| of y, dx, dw."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    from lowprec.numerics.formats import get_format
    from lowprec.sites.backends import get_backend
    from lowprec.sites.layers import PrecisionLinear
    from lowprec.sites.amax_scope import AmaxScope

    world = dist.get_world_size()
    dp = world // 2
    mesh = init_device_mesh("cpu", (dp, 2), mesh_dim_names=("dp_replicate", "tp"))
    g = torch.Generator().manual_seed(0)
    w, x, gy = torch.randn(24, 16, generator=g), torch.randn(8, 16, generator=g), torch.randn(8, 24, generator=g)
    x[0, 3] = 40.0   # one large value: the rank that does not hold it must still scale by it
    f, backend = get_format(fmt), get_backend("torch")

    def one(weight, inp, grad, amax_group=None):
        layer = PrecisionLinear(weight, None, f, backend, amax_group=amax_group, amax_scope=AmaxScope(scope),
                                gemm=_gemm())
        with ScaledMMFlags() as calls:
            yy = layer(inp)
            if any(p.is_partial() for p in getattr(yy, "placements", ())):
                yy = yy.redistribute(placements=[Replicate()])   # what RowwiseParallel's output does
            yy.backward(grad)
        return layer, yy, calls.fast_accum

    out = {}
    for style, w_pl, x_pl in (("col", Shard(0), Replicate()), ("row", Shard(1), Shard(1))):
        ref_w, ref_x = torch.nn.Parameter(w.clone()), x.clone().requires_grad_()
        _, ref_y, _ = one(ref_w, ref_x, gy)
        r = mesh.get_local_rank("dp_replicate")
        wd = torch.nn.Parameter(distribute_tensor(w.clone(), mesh["tp"], [w_pl]))
        xl = x[r::dp].clone().requires_grad_()
        xd = distribute_tensor(xl.detach(), mesh["tp"], [x_pl]).requires_grad_()
        dp_group = mesh.get_group("dp_replicate") if dp > 1 else None
        layer, yd, flags = one(wd, xd, _grad_for(gy[r::dp], w_pl, mesh), dp_group)
        y_full = yd.full_tensor()
        dw = wd.grad.full_tensor()
        if dp > 1:
            dist.all_reduce(dw, group=mesh.get_group("dp_replicate"))
        out[style] = {"y": (y_full - ref_y[r::dp].detach()).abs().max().item(),
                      "dx": (xd.grad.full_tensor() - ref_x.grad[r::dp]).abs().max().item(),
                      "dw": (dw - ref_w.grad).abs().max().item(),
                      "calls": (layer.fast_calls, layer.slow_calls), "gemm_flags": flags}
    return _gather(out)


def _grad_for(gy_local, w_pl, mesh):
    """The output gradient as the layer's output is laid out: column-parallel Shard(-1)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    return distribute_tensor(gy_local, mesh["tp"], [Shard(1) if w_pl == Shard(0) else Replicate()])


def seq_checks(fmt: str, scope: str) -> dict:
    """One column-parallel PrecisionLinear on a sequence-sharded input over a 1-D TP mesh of
    all ranks: FP8SequenceColwiseParallel (FP8 gather) against ColwiseParallel(input_layouts=
    Shard(1)) (high-precision gather, then the fast path): max |difference| of y, dx, dw, and
    the all-gather bytes each moved (experiments/ledger.py)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, parallelize_module
    from experiments.ledger import CollectiveLedger
    from lowprec.numerics.formats import get_format
    from lowprec.sites.amax_scope import AmaxScope
    from lowprec.sites.backends import get_backend
    from lowprec.sites.fp8_sequence import FP8SequenceColwiseParallel
    from lowprec.sites.layers import PrecisionLinear

    world, rank = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(24, 16, generator=g), torch.randn(24, generator=g)
    x, gy = torch.randn(2, 8, 16, generator=g), torch.randn(2, 8, 24, generator=g)
    x[1, 7, 5] = 30.0   # held by the last rank only
    t = 8 // world
    out = {}
    for name, style in (("fp8", FP8SequenceColwiseParallel()), ("hp", ColwiseParallel(input_layouts=Shard(1)))):
        parent = torch.nn.Module()
        parent.lin = PrecisionLinear(torch.nn.Parameter(w.clone()), torch.nn.Parameter(b.clone()), get_format(fmt),
                                     get_backend("torch"), amax_scope=AmaxScope(scope), gemm=_gemm())
        parallelize_module(parent, mesh, {"lin": style})
        xl = x[:, rank * t:(rank + 1) * t].clone().requires_grad_()
        ledger = CollectiveLedger()
        with ledger, ledger.phase("fwd_bwd"), ScaledMMFlags() as calls:
            y = parent.lin(xl)
            y.backward(gy[..., rank * (24 // world):(rank + 1) * (24 // world)])
        out[name] = {"y": y.detach(), "dx": xl.grad, "dw": parent.lin.weight.grad.full_tensor(),
                     "gather_bytes": ledger.table().get("weight_all_gather", (0, 0, 0))[1]
                     + ledger.table().get("tp_all_gather", (0, 0, 0))[1],
                     "calls": (parent.lin.fast_calls, parent.lin.slow_calls), "gemm_flags": calls.fast_accum}
    diff = {k: (out["fp8"][k] - out["hp"][k]).abs().max().item() for k in ("y", "dx", "dw")}
    return _gather({**diff, "qkv_amax_all_reduces": _qkv_amax_all_reduces(scope, mesh, x, gy),
                    "bytes": (out["fp8"]["gather_bytes"], out["hp"]["gather_bytes"]),
                    "calls": (out["fp8"]["calls"], out["hp"]["calls"]),
                    "gemm_flags": (out["fp8"]["gemm_flags"], out["hp"]["gemm_flags"])})


def _qkv_amax_all_reduces(scope: str, mesh, x, gy) -> int:
    """The MAX all-reduces (experiments/ledger.py) of one forward and backward of three
    FP8SequenceColwiseParallel sites reading one sequence-sharded input (q, k, v), prepared
    as one model: the model's SharedAmax reduces the input's amax once."""
    import torch.distributed as dist
    from torch.distributed.tensor.parallel import parallelize_module
    from experiments.ledger import CollectiveLedger
    from lowprec.sites.fp8_sequence import FP8SequenceColwiseParallel
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({n: torch.nn.Linear(16, 24) for n in ("q", "k", "v")})
    prepare(model, PrecisionPlan.from_dict({"backend": "torch", "amax_scope": scope, "rules": [
        {"select": {"glob": "*"}, "format": "fp8_tensorwise"}]}), seed=1)
    parallelize_module(model, mesh, {n: FP8SequenceColwiseParallel() for n in ("q", "k", "v")})
    t, n = 8 // world, 24 // world
    xl = x[:, rank * t:(rank + 1) * t].clone().requires_grad_()
    ledger = CollectiveLedger()
    with ledger, ledger.phase("fwd_bwd"):
        loss = sum((model[k](xl) * gy[..., rank * n:(rank + 1) * n]).sum() for k in ("q", "k", "v"))
        loss.backward()
    assert all(model[k].fast_calls == 1 and model[k].slow_calls == 0 for k in ("q", "k", "v"))
    return ledger.table().get("amax_all_reduce", (0, 0, 0))[0]


CKPT_RUNS = {"ckpt_fsdptp": lambda f, s, d: gather2d_run(f, s, "fsdptp", True, d / "ckpt_fsdptp_w4"),
             "reshard_fsdptp": reshard_fsdptp_run}
RUNS = {"seq": seq_checks, "single": single_run, "ledger": ledger_run, "fsdp": fsdp_run, "fsdp8": fsdp8_run,
        "fsdphp": lambda f, s: fsdp8_run(f, s, fp8_all_gather=False), "dptp": dptp_run, "layer": layer_checks,
        "ledger_fsdptp": lambda f, s: ledger_run(f, s, tp=2),
        "fsdptp8": lambda f, s: gather2d_run(f, s, "fsdptp", True),
        "fsdptphp": lambda f, s: gather2d_run(f, s, "fsdptp", False),
        "hsdp8": lambda f, s: gather2d_run(f, s, "hsdp", True),
        "hsdphp": lambda f, s: gather2d_run(f, s, "hsdp", False)}


def main(out_path: str, variants: list[str]) -> None:
    import os
    import torch.distributed as dist
    if "WORLD_SIZE" in os.environ:
        dist.init_process_group("gloo")
    results = {}
    for v in variants:
        t0, c0 = time.perf_counter(), time.process_time()
        mode, fmt, scope = v.split(":")
        if mode == "single" and dist.is_initialized() and dist.get_rank() != 0:
            continue   # no collective in it: rank 0, the one that saves, runs it alone
        if mode in CKPT_RUNS:
            results[v] = CKPT_RUNS[mode](fmt, scope, Path(out_path).parent)
        else:
            results[v] = RUNS[mode](fmt, scope)
        rank = dist.get_rank() if dist.is_initialized() else 0
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        print(f"rank {rank} {v}: {wall:.2f} s wall, {cpu:.2f} s CPU", flush=True)
    if not dist.is_initialized() or dist.get_rank() == 0:
        torch.save(results, out_path)
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(sys.argv[1], sys.argv[2:])
