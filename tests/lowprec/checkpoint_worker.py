"""A training run that checkpoints with lowprec.state.checkpoint, for tests/lowprec/state/test_checkpoint.py.

    python checkpoint_worker.py DIR [--steps N] [--every K] [--kill-on-save S] [--resume]
    python checkpoint_worker.py DIR --fsdp ...     # 2 gloo ranks, forked by torch.multiprocessing

Trains the small GPT of test_state.py on real text with an FP8 plan (blocks.0 in
fp8_delayed, blocks.1 in fp8_tensorwise, lm_head kept in high precision), switching one
site to bf16 at step 3 (so the precision map in the checkpoint differs from the plan's).
Every step draws from all global RNGs (token dropout with a rate from Python's `random`
and NumPy, a mask from torch's RNG), and the batches come from a sampler with its own
generator, saved as the data position; a stand-in controller counts what it observed.
So a resumed run only repeats the losses if every part of the checkpoint is restored.

Prints `LOSS step value` (repr, bit-exact) after every step and `SAVED step` after every
checkpoint, flushed, from rank 0. `--kill-on-save S`: while writing checkpoint S, cut the
temporary file (or, sharded, rank 0's file in the temporary directory) to half and
SIGKILL this process, before the rename. `--resume`: start from latest_checkpoint(DIR).
`--fsdp`: FSDP2 `fully_shard` on every block and the root over 2 gloo ranks, half of each
batch per rank, losses averaged over ranks; each rank seeds its own RNG differently. The
ranks are forked (torch already imported: cheaper than torchrun's fresh interpreters);
when one dies, `torch.multiprocessing` terminates the other and this process fails.

    python checkpoint_worker.py DIR --pp-round-trip

Two gloo ranks holding different parameters, as two pipeline stages do
(`experiments.gpt_parallel.GPTStage`: rank 0 the embeddings and blocks.0, rank 1 blocks.1,
ln_f and lm_head), each with its own AdamW: train 2 steps, save a sharded checkpoint,
train 2 more, load it back and check that every parameter and the whole optimizer state
(exp_avg, exp_avg_sq, step, the param group's hyperparameters) are the saved ones, then
step once more. Prints `PP_OK rank n_params` from each rank; fails otherwise.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import sys
from pathlib import Path

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
for p in (str(HERE.parents[1]), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

from experiments.model import build_gpt  # noqa: E402
from lowprec import prepare  # noqa: E402
from lowprec.state.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint  # noqa: E402
from lowprec.sites.plan import PrecisionPlan  # noqa: E402
from small_gpt import MODEL, corpus_bytes  # noqa: E402

PLAN = {
    "backend": "emulated", "amax_scope": "group",   # FSDP: one process's numerics
    "keep_high_precision": [{"fqns": ["lm_head"]}],
    "rules": [{"name": "b0", "select": {"glob": "blocks.0.*"}, "format": "fp8_delayed"},
              {"name": "b1", "select": {"glob": "blocks.1.*"}, "format": "fp8_tensorwise"}],
}
BATCH, T = 8, 32


class Sampler:
    """Random windows of the corpus from its own generator; its state is the data position."""

    def __init__(self, tokens: torch.Tensor, seed: int = 0):
        self.tokens, self.g, self.consumed = tokens, torch.Generator().manual_seed(seed), 0

    def next(self):
        ix = torch.randint(0, len(self.tokens) - T - 1, (BATCH,), generator=self.g)
        self.consumed += 1
        return (torch.stack([self.tokens[i:i + T] for i in ix]),
                torch.stack([self.tokens[i + 1:i + T + 1] for i in ix]))

    def state_dict(self) -> dict:
        return {"generator": self.g.get_state(), "consumed": self.consumed}

    def load_state_dict(self, st: dict) -> None:
        self.g.set_state(st["generator"])
        self.consumed = st["consumed"]


class CountingController:
    """Stands in for the rollout controller: state that must survive the restart."""

    def __init__(self):
        self.observed, self.loss_sum = 0, 0.0

    def observe(self, loss: float) -> None:
        self.observed += 1
        self.loss_sum += loss

    def state_dict(self) -> dict:
        return {"observed": self.observed, "loss_sum": self.loss_sum}

    def load_state_dict(self, st: dict) -> None:
        self.observed, self.loss_sum = st["observed"], st["loss_sum"]


def kill_mid_write(tmp: Path) -> None:
    """Test hook: leave a torn temporary behind and die as SIGKILL kills (no cleanup)."""
    target = tmp / "rank_00000.pt" if tmp.is_dir() else tmp
    with open(target, "r+b") as f:
        f.truncate(target.stat().st_size // 2)
        f.flush()
        os.fsync(f.fileno())
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    a = parse_args()
    if not (a.fsdp or a.pp_round_trip):
        return run(0, a)
    import tempfile

    import torch.multiprocessing as mp
    with tempfile.TemporaryDirectory() as rendezvous:
        mp.start_processes(pp_round_trip if a.pp_round_trip else run, args=(a, f"file://{rendezvous}/store"),
                           nprocs=2, start_method="fork")


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("dir")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--kill-on-save", type=int, default=None)
    ap.add_argument("--resume", action="store_true")
    ap.add_argument("--fsdp", action="store_true")
    ap.add_argument("--pp-round-trip", action="store_true")
    return ap.parse_args()


def run(rank: int, a: argparse.Namespace, rendezvous: str = "") -> None:
    torch.set_num_threads(1)
    world = 2 if a.fsdp else 1
    if a.fsdp:
        torch.distributed.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=world)

    torch.manual_seed(0)
    model = build_gpt(**MODEL)
    state = prepare(model, PrecisionPlan.from_dict(PLAN), seed=1,
                    amax_group=torch.distributed.group.WORLD if a.fsdp else None)
    if a.fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (world,))
        for block in model.blocks:
            fully_shard(block, mesh=mesh)
        fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sampler, controller = Sampler(corpus_bytes()), CountingController()
    torch.manual_seed(100 + rank)
    random.seed(200 + rank)
    np.random.seed(300 + rank)

    start = 0
    if a.resume:
        path = latest_checkpoint(a.dir)
        got = load_checkpoint(path, model=model, optimizer=opt, precision=state, controller=controller)
        sampler.load_state_dict(got["data_state"])
        start = got["step"]
        if rank == 0:
            print(f"RESUMED {start} {path.name}", flush=True)
        assert controller.observed == start and sampler.consumed == start

    per = BATCH // world
    for step in range(start, a.steps):
        if step == 3:
            state.set_format("blocks.1.mlp.fc", "bf16")
        x, y = sampler.next()
        x, y = x[rank * per:(rank + 1) * per], y[rank * per:(rank + 1) * per]
        rate = 0.05 * random.random() + 0.05 * float(np.random.rand())
        x = x.masked_fill(torch.rand(x.shape) < rate, 0)  # token dropout: all three RNGs
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        value = loss.detach().clone()
        if a.fsdp:
            torch.distributed.all_reduce(value)
        value = value.item() / world
        controller.observe(value)
        if rank == 0:
            print(f"LOSS {step} {value!r}", flush=True)
        if (step + 1) % a.every == 0:
            hook = kill_mid_write if a.kill_on_save == step + 1 else None
            save_checkpoint(a.dir, step + 1, model=model, optimizer=opt, precision=state,
                            controller=controller, data_state=sampler.state_dict(),
                            extra={"plan": "fp8"}, _before_replace=hook)
            if rank == 0:
                print(f"SAVED {step + 1}", flush=True)
    if a.fsdp:
        torch.distributed.destroy_process_group()


def pp_round_trip(rank: int, a: argparse.Namespace, rendezvous: str) -> None:
    import torch.nn.functional as F

    from experiments.gpt_parallel import GPTStage

    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=rendezvous, rank=rank, world_size=2)
    torch.manual_seed(0)
    model = build_gpt(**MODEL)  # two blocks: one per stage
    prepare(model, PrecisionPlan.from_dict(PLAN), seed=1)
    stage = GPTStage(model, rank, rank + 1, is_first=rank == 0, is_last=rank == 1)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-3, betas=(0.9, 0.95), weight_decay=0.1)
    g = torch.Generator().manual_seed(rank)

    def step() -> None:  # each stage's own loss: what matters here is who holds which parameters
        x = torch.randint(0, MODEL["vocab_size"], (4, T), generator=g)
        opt.zero_grad()
        if rank == 0:
            loss = stage(x).float().pow(2).mean()
        else:
            logits = stage(torch.randn(4, T, MODEL["d_model"], generator=g))
            loss = F.cross_entropy(logits.flatten(0, 1), x.flatten())
        loss.backward()
        opt.step()

    for _ in range(2):
        step()
    path = save_checkpoint(a.dir, 2, model=stage, optimizer=opt)
    params = {n: p.detach().clone() for n, p in stage.named_parameters()}
    optim = {"state": {i: {k: v.clone() for k, v in st.items()} for i, st in opt.state_dict()["state"].items()},
             "param_groups": [dict(g) for g in opt.state_dict()["param_groups"]]}
    for _ in range(2):
        step()
    load_checkpoint(path, model=stage, optimizer=opt)
    for n, p in stage.named_parameters():
        assert torch.equal(p.detach(), params[n]), f"rank {rank}: parameter {n} differs after the load"
    loaded = opt.state_dict()
    assert loaded["param_groups"] == optim["param_groups"], (rank, loaded["param_groups"], optim["param_groups"])
    assert sorted(loaded["state"]) == sorted(optim["state"]) == list(range(len(params)))
    for i, st in optim["state"].items():
        assert sorted(loaded["state"][i]) == ["exp_avg", "exp_avg_sq", "step"], loaded["state"][i].keys()
        for k, v in st.items():
            assert torch.equal(loaded["state"][i][k], v), f"rank {rank}: optimizer state {i}.{k} differs"
    step()  # and the optimizer runs on
    print(f"PP_OK {rank} {len(params)}", flush=True)
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
