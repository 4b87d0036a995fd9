"""The HF Trainer's DDP on two gloo processes with lowprec's callback: both ranks take the
same decisions.

Rank 1 alone sees a NaN in one layer's output (while that layer runs in FP8). The callback
measures every step's loss and grad norm on both ranks alike (one all-gather), so both skip
the step, replay it with the same sets of layers in high precision (each replay's gradients
averaged over the ranks, as DDP does) and demote the same layer; the stages promote at the
same steps. Their event lists are identical, and so are the weights at the end.

The Trainer saves a checkpoint at step 30 (after the fallback) with a file of lowprec's state
per rank; a second Trainer on fresh models resumes from it on both ranks, starts with the
formats, step and events each rank had there, and ends as the first run did.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
import torch.multiprocessing as mp

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from llama_helpers import CONFIG, assert_same_progress, lowprec_now, shakespeare_blocks, tiny_llama  # noqa: E402

SITE, NAN_AT, SAVE_AT, STEPS = "model.layers.1.mlp.up_proj", 27, 30, 32


def _worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))   # what torchrun sets: the Trainer starts DDP from these
    torch.set_num_threads(1)
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from lowprec.integrations.hf import LowprecCallback
    from lowprec.runtime.trainer.faults import FaultKind, Faults, Injection
    cfg = CONFIG.replace("tracking: {experiment: hf-integration}", "tracking: {enabled: false}")
    path = f"{out_dir}/lowprec_rank{rank}.yaml"
    open(path, "w").write(cfg)
    args = TrainingArguments(output_dir=f"{out_dir}/out", max_steps=STEPS, per_device_train_batch_size=4,
                             learning_rate=3e-3, warmup_steps=5, report_to=[], use_cpu=True, save_strategy="steps",
                             save_steps=SAVE_AT, seed=0, disable_tqdm=True, ddp_backend="gloo")
    model = tiny_llama()
    lp = LowprecCallback.from_yaml(path, model)
    faults = Faults(model, [Injection(FaultKind.NAN, NAN_AT, NAN_AT + 1, SITE)] if rank == 1 else [])
    seen = {}

    class Tick(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            faults.tick(state.global_step)

        def on_save(self, args, state, control, **kw):
            seen.setdefault("at_save", lowprec_now(lp))
    trainer = Trainer(model=model, args=args, train_dataset=shakespeare_blocks(8 * 40), callbacks=[lp, Tick()])
    trainer.train()
    assert trainer.args.world_size == world   # really data parallel
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])

    model_b = tiny_llama()   # the same job started again: fresh models, resumed from the checkpoint
    lp_b = LowprecCallback.from_yaml(path, model_b)

    class Begin(TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            seen["at_begin"] = lowprec_now(lp_b)
    Trainer(model=model_b, args=args, train_dataset=shakespeare_blocks(8 * 40), callbacks=[lp_b, Begin()]).train(
        resume_from_checkpoint=f"{out_dir}/out/checkpoint-{SAVE_AT}")
    with open(f"{out_dir}/rank{rank}.json", "w") as f:
        json.dump({"events": [e.to_json() for e in lp.session.events], "formats": lp.state.formats(),
                   "skipped": lp.session.skipped, "weights_sum": float(weights.double().sum()),
                   "weights": weights.tolist()[:2000], **seen, "end": lowprec_now(lp), "end_b": lowprec_now(lp_b)}, f)


@pytest.mark.slow
def test_ddp_ranks_take_the_same_decisions(tmp_path, gloo, free_port):
    mp.start_processes(_worker, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True, start_method="spawn")
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    kinds = [json.loads(e)["kind"] for e in r0["events"]]
    assert kinds.count("promote") == 2 and "fallback" in kinds and "replay" in kinds
    fallbacks = [json.loads(e) for e in r0["events"] if json.loads(e)["kind"] == "fallback"]
    assert [(f["step"], f["sites"]) for f in fallbacks] == [(NAN_AT, [SITE])]
    assert r0["events"] == r1["events"]
    assert r0["formats"] == r1["formats"] and r0["formats"][SITE] == "bf16"
    assert r0["skipped"] == r1["skipped"] == 1
    assert r0["weights"] == r1["weights"] and r0["weights_sum"] == r1["weights_sum"]
    held = sorted(p.name for p in (tmp_path / "out" / f"checkpoint-{SAVE_AT}" / "lowprec").iterdir())
    assert held == ["rank_00000.pt", "rank_00001.pt"]
    for r in (r0, r1):
        assert r["at_save"]["formats"][SITE] == "bf16" and r["at_save"]["step"] == SAVE_AT
        assert_same_progress(r["at_begin"], r["at_save"])   # each rank resumed where it was
        assert_same_progress(r["end_b"], r["end"])          # and ended as the run that never stopped
