"""A user's DDP loop with `Session`, on two gloo ranks, a fault on one of them: both ranks
take the same decisions.

Rank 1 alone sees a NaN in one site's output. The grad norm after DDP's all-reduce is
non-finite on both ranks, so both skip the step. With the loop's closure, both replay
the step with the same sets of sites in high precision (the replays' losses and grad
norms are combined across ranks like the step's) and blame the same site at the step the
fault occurs; without it, the monitor's check combines the signals of both ranks with
one all-gather, so both blame the same site there. Their event logs are identical.
"""

import json

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from experiments.data import split_texts, tokens_of
from experiments.model import build_gpt
from lowprec import prepare
from lowprec.sites.plan import PrecisionPlan
from lowprec.policy.rollout import build_controller, parse_rollout
from lowprec.runtime import Injection, Session, SessionSettings
from lowprec.runtime.trainer.data import TokenBatches

SITE = "blocks.1.mlp.fc"
PLAN = {"backend": "emulated", "amax_scope": "group", "keep_high_precision": [{"fqns": ["lm_head"]}],
        "rules": [{"name": "blocks", "select": {"glob": "blocks.*"}, "format": "bf16",
                   "ladder": ["fp8_tensorwise", "bf16"]}]}
ROLLOUT = {"check_every": 5, "min_steps": 0, "thresholds": {"spike_min_history": 30},
           "stages": [{"name": "all", "select": {"glob": "blocks.*"}, "format": "fp8_tensorwise"}]}
STEPS = 32   # the fault from step 20; without replays the check at step 25 or 30 blames the site


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    """Both variants, one after the other, in one process group: with the closure (replays), then
    without (statistics); each its own model, session and files."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for replay in (True, False):
            _train(rank, world, f"{out_dir}/{'replays' if replay else 'statistics'}", replay)
    finally:
        dist.destroy_process_group()


def _train(rank: int, world: int, out_dir: str, replay: bool) -> None:
    torch.manual_seed(0)
    model = build_gpt(vocab_size=256, block_size=32, n_layer=2, n_head=2, d_model=32)
    state = prepare(model, PrecisionPlan.from_dict(PLAN), amax_group=dist.group.WORLD)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ctl = build_controller(parse_rollout(ROLLOUT), state, model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-3)
    session = Session(ddp, opt, state, ctl, settings=SessionSettings(max_grad_norm=1.0),
                      event_log=f"{out_dir}/events_rank{rank}.jsonl")
    data = TokenBatches(tokens_of(split_texts()[0], 200_000), 8, 32, seed=0, rank=rank, world=world)
    fault = Injection("nan", 20, 1000, SITE)
    site = model.get_submodule(SITE)
    step_ref = [0]

    def inject(mod, args, out):
        if rank == 1 and fault.active(step_ref[0], mod):
            out = out.clone()
            out[..., 0] = float("nan")
            return out
    site.register_forward_hook(inject, prepend=True)
    for step in range(STEPS):   # the user's loop: forward, backward, session.step
        step_ref[0] = step
        x, y = data.next()

        def closure():
            _, loss = ddp(x, y)
            loss.backward()
            return loss
        session.step(closure(), closure if replay else None)
    finite = all(torch.isfinite(p).all() for p in model.parameters())
    with open(f"{out_dir}/result_rank{rank}.json", "w") as f:
        json.dump({"formats": state.formats(), "finite": bool(finite)}, f)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory, free_port, gloo):
    """One 2-rank spawn that runs both variants: the folder of each."""
    d = tmp_path_factory.mktemp("session_ddp")
    for name in ("replays", "statistics"):
        (d / name).mkdir()
    mp.spawn(_worker, args=(2, free_port(), str(d)), nprocs=2, join=True)
    return d


@pytest.mark.slow
@pytest.mark.parametrize("replay", [True, False], ids=["replays", "statistics"])
def test_two_ranks_decide_the_same_when_only_one_sees_the_fault(ranks, replay):
    folder = ranks / ("replays" if replay else "statistics")
    logs = [(folder / f"events_rank{r}.jsonl").read_text() for r in range(2)]
    assert logs[0] == logs[1] and logs[0]
    events = [json.loads(line) for line in logs[0].splitlines()]
    falls = [e for e in events if e["kind"] in ("fallback", "rollback")]
    assert falls and falls[0]["kind"] == "fallback" and falls[0]["sites"] == [SITE]
    assert falls[0]["step"] <= 20 + 2 * 5
    replays = [e for e in events if e["kind"] == "replay"]
    if replay:
        assert falls[0]["step"] == 20 and falls[0]["evidence"]["precision_to_blame"]
        assert replays and all(e["step"] == 20 for e in replays)
        assert all(e["evidence"]["anomalous"] == (SITE not in e["sites"]) for e in replays)
    else:
        assert not replays
    results = [json.loads((folder / f"result_rank{r}.json").read_text()) for r in range(2)]
    assert results[0] == results[1]
    assert results[0]["formats"][SITE] == "bf16" and results[0]["finite"]
