"""A profile split over 2 gloo ranks equals the single-process profile, on every rank;
ranks holding other weights are refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pdist_worker import FORMATS, setup

WORKER = Path(__file__).with_name("pdist_worker.py")
pytestmark = [pytest.mark.slow, pytest.mark.launches]


@pytest.fixture(scope="module")
def modes(tmp_path_factory, gloo, free_port, rank_forks) -> dict[str, list[dict]]:
    """One 2-rank launch that profiles in both modes, `same` then `other`: each rank's result by mode."""
    out = tmp_path_factory.mktemp("profile_distributed")
    return _run_ranks(out, ("same", "other"), free_port(), rank_forks)


def _run_ranks(out: Path, modes: tuple[str, ...], port: int, rank_forks) -> dict[str, list[dict]]:
    procs = []
    for rank in range(2):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
        with open(out / f"log{rank}.txt", "w") as log:   # the child keeps its own descriptor
            procs.append(subprocess.Popen([sys.executable, *rank_forks.rank(WORKER, out, *modes)], env=rank_forks.env(env),
                                          stdout=log, stderr=subprocess.STDOUT))
    try:
        for p in procs:
            p.wait(timeout=240)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for rank, p in enumerate(procs):
        assert p.returncode == 0, (out / f"log{rank}.txt").read_text()[-3000:]
    return {mode: [json.loads((out / mode / f"rank{r}.json").read_text()) for r in range(2)] for mode in modes}


def _close(a: float, b: float) -> bool:
    return a == b or abs(a - b) <= 1e-6 * max(abs(a), abs(b))


def test_two_ranks_equal_single_process(modes):
    from lowprec.profile.measure import profile_sites
    ranks = modes["same"]
    model, state, held = setup()
    single = profile_sites(model, state, held, formats={f: FORMATS for f in state.sites})
    pairs = len(single.entries)
    assert ranks[0]["entries"] == ranks[1]["entries"]   # every rank ends with the same profile
    got = {(e["fqn"], e["format"]): e for e in ranks[0]["entries"]}
    assert set(got) == {(e.fqn, e.format) for e in single.entries}
    for e in single.entries:
        d = got[(e.fqn, e.format)]
        assert _close(d["loss_delta"], e.loss_delta), (e.fqn, e.format, d["loss_delta"], e.loss_delta)
        assert _close(d["grad_cosine"], e.grad_cosine), (e.fqn, e.format)
        assert set(d["sqnr_db"]) == set(e.sqnr_db)
        for op, v in e.sqnr_db.items():
            assert _close(d["sqnr_db"][op], v), (e.fqn, e.format, op)
    for r in ranks:   # each rank ran half the pairs (round robin) plus the reference
        assert r["world"] == 2
        assert r["passes_per_rank"] == len(held) * (1 + pairs // 2)
        assert _close(r["reference_loss"], single.reference_loss)
    assert single.passes_per_rank == len(held) * (1 + pairs)


def test_ranks_with_other_weights_are_refused(modes):
    ranks = modes["other"]
    for r in ranks:
        assert "error" in r, r.keys()
        assert "ranks [1] hold other weights" in r["error"]


def test_cli_under_torchrun_equals_one_process(tmp_path, gloo, free_port, tiny_lm, monkeypatch, rank_forks):
    """`torchrun ... lowprec.cli profile --distributed` (warm-up on every rank, weights
    broadcast, pairs split) writes the profile that one process writes."""
    import yaml
    from lowprec.cli import main
    from test_profile_cli import GOOD
    tiny_lm(tmp_path)
    (tmp_path / "good.yaml").write_text(yaml.safe_dump(GOOD))
    args = ["profile", "good.yaml", "--steps", "2", "--batches", "2", "--no-tracking"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        *rank_forks.rank("-m", "lowprec.cli", *args, "--distributed", "--write", "w2/p.yaml",
                                         "--out", "o2")],
                       cwd=tmp_path, env=rank_forks.env(env), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main([*args, "--write", "w1/p.yaml", "--out", "o1"]) == 0
    two = json.loads((tmp_path / "o2" / "profile.json").read_text())
    one = json.loads((tmp_path / "o1" / "profile.json").read_text())
    assert (two["world"], one["world"]) == (2, 1)
    assert two["passes_per_rank"] == 2 * (1 + 2) and one["passes_per_rank"] == 2 * (1 + 4)
    by_pair = {(e["fqn"], e["format"]): e for e in two["entries"]}
    assert set(by_pair) == {(e["fqn"], e["format"]) for e in one["entries"]}
    for e in one["entries"]:
        d = by_pair[(e["fqn"], e["format"])]
        for k in ("loss_delta", "grad_cosine", "grad_cosine_tensors"):
            assert _close(d[k], e[k]), (e["fqn"], e["format"], k)
    assert (tmp_path / "w2" / "p.yaml").read_text().split("\n", 2)[2] == (tmp_path / "w1" / "p.yaml").read_text().split("\n", 2)[2]
