"""One rank of a distributed profile of the small GPT (gloo, CPU), for test_profile_distributed.py.

    RANK=r WORLD_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=p python pdist_worker.py OUT_DIR MODE...

Each MODE in turn, in one process group: `same`: every rank builds the same model (seed 0);
`other`: rank 1 adds 1e-3 to one weight. Writes OUT_DIR/<mode>/rank<r>.json: the profile
(`to_dict`) or {"error": message}.
`setup()` is also what the test's single-process profile uses.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
for _p in (str(ROOT), str(HERE.parent)):
    if _p not in sys.path:
        sys.path.insert(0, _p)

from experiments.model import build_gpt  # noqa: E402
from lowprec import prepare  # noqa: E402
from lowprec.sites.plan import PrecisionPlan  # noqa: E402
from small_gpt import batches, corpus_bytes  # noqa: E402

MODEL = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, d_model=64)
PLAN = {"backend": "emulated", "keep_high_precision": [{"fqns": ["lm_head"]}],
        "rules": [{"name": "all", "select": {"glob": "blocks.*"}, "format": "bf16",
                   "ladder": ["nvfp4", "fp8_tensorwise", "bf16"]}]}
FORMATS = ["fp8_tensorwise", "nvfp4"]


def setup():
    torch.manual_seed(0)
    model = build_gpt(**MODEL)
    state = prepare(model, PrecisionPlan.from_dict(PLAN))
    held = list(batches(corpus_bytes(), 2, batch=4, t=32, seed=1))
    return model, state, held


def main(out: str, modes: list[str]) -> None:
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for mode in modes:
        (Path(out) / mode).mkdir(exist_ok=True)
        profile(Path(out) / mode, mode, dist.get_rank())
    dist.destroy_process_group()


def profile(out: Path, mode: str, rank: int) -> None:
    from lowprec.profile.measure import profile_sites
    model, state, held = setup()
    if mode == "other" and rank == 1:
        with torch.no_grad():
            state.site("blocks.0.mlp.fc").module.weight[0, 0] += 1e-3
    try:
        prof = profile_sites(model, state, held, formats={f: FORMATS for f in state.sites})
        result = prof.to_dict()
    except ValueError as e:
        result = {"error": str(e)}
    (out / f"rank{rank}.json").write_text(json.dumps(result, allow_nan=True))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
