"""A NaN planted in one FP8 site on the fast path, under DP 2 x TP 2: the same demotion everywhere.

The reference experiment of tests/experiments/test_parallel_parity.py on the `torch`
backend (every FP8 site on its fast path: `lowprec.sites.fp8_parallel` under DP x TP),
13 steps (the NaN's step the last): `torchrun --nproc-per-node 4 -m lowprec.cli run` with
`parallel: {dp_replicate: 2, tp: 2}` against `lowprec run` in one process. The NaN (`nan_one`, `lowprec.runtime.trainer.faults`) goes
into one element of blocks.1.mlp.fc's output from step 12, on exactly one rank: rank 0
holds the global batch's first row (dp rank 0) and, that site being column-parallel, the
first output column (tp rank 0); the other three ranks' outputs of that site are finite.
One process gets the same element. Every rank must log the single process's decisions,
in order and at the same steps (the same records, step for step, on all four ranks): the
step-12 replays and the fallback of exactly that site, the promotion before it.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.launches]

ROOT = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(ROOT / "tests" / "experiments"))

from fast_path_checks import INTERPRETED  # noqa: E402
from test_parallel_parity import CONFIG, PINNED, SITE, _decisions  # noqa: E402

TIMEOUT_S = 900 if INTERPRETED else 300   # a hang's net; interpreted kernels take ~3x as long
STEPS = 13
INJECT = ["--inject", f"nan_one:{SITE}:12:{STEPS}"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, gloo, rank_forks):
    d = tmp_path_factory.mktemp("fast_faults")
    cfg = copy.deepcopy(CONFIG)
    cfg["precision"]["backend"] = "torch"
    cfg["train"]["steps"] = STEPS
    (d / "config.yaml").write_text(yaml.safe_dump(cfg))
    (d / "dp2xtp2.yaml").write_text(yaml.safe_dump({**cfg, "parallel": {"dp_replicate": 2, "tp": 2}}))
    commands = {
        "single": [sys.executable, *rank_forks.rank("-m", "lowprec.cli", "run", d / "config.yaml", "--out",
                                                    d / "single", *INJECT)],
        "dp2xtp2": [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
                    *rank_forks.rank("-m", "lowprec.cli", "run", d / "dp2xtp2.yaml", "--out", d / "dp2xtp2", *INJECT)],
    }
    jobs = {}
    for name, cmd in commands.items():
        with open(d / f"{name}.log", "w") as log:
            jobs[name] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                          env=rank_forks.env({**os.environ, **PINNED}), start_new_session=True)
    try:
        for name, proc in jobs.items():
            try:
                proc.wait(timeout=TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail(f"{name} ran past {TIMEOUT_S} s:\n{(d / f'{name}.log').read_text()[-4000:]}")
            assert proc.returncode == 0, f"{name} failed:\n{(d / f'{name}.log').read_text()[-6000:]}"
    finally:
        for proc in jobs.values():   # only the jobs started here, after a timeout or failure
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    return {"single": (d / "single" / "events.jsonl").read_text(),
            "ranks": [(d / "dp2xtp2" / f"events.rank{r}.jsonl").read_text() for r in range(4)]}


def test_every_rank_demotes_exactly_the_nan_site_in_the_same_step(runs):
    ref = _decisions(runs["single"])
    fallbacks = [e for e in map(json.loads, runs["single"].splitlines()) if e["kind"] == "fallback"]
    assert [(e["step"], e["sites"]) for e in fallbacks] == [(12, [SITE])], fallbacks
    for rank, log in enumerate(runs["ranks"]):
        assert _decisions(log) == ref, f"rank {rank}"
        got = [(e["step"], e["sites"]) for e in map(json.loads, log.splitlines()) if e["kind"] == "fallback"]
        assert got == [(12, [SITE])], f"rank {rank}: {got}"
