"""lowprec.state.checkpoint: atomic save, resume bit for bit, and surviving SIGKILL at any moment.

The in-process tests check the contents (round trip of every part, weights_only loading),
pruning, which checkpoint counts as the latest, and the errors. The SIGKILL tests run
tests/lowprec/checkpoint_worker.py (a small GPT in FP8 on real text) in subprocesses:
killed while writing a checkpoint, then resumed in a fresh process, the losses of the
resumed steps must equal those of a run that was never killed, float for float.
"""

import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from experiments.model import build_gpt
from lowprec import prepare
from lowprec.state.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint
from lowprec.sites.plan import PrecisionPlan
from small_gpt import MODEL, batches, corpus_bytes

HERE = Path(__file__).resolve().parents[1]
WORKER = HERE / "checkpoint_worker.py"
PLAN = {  # delayed histories, tensorwise, and NVFP4 (stochastic rounding: generator states)
    "backend": "emulated",
    "keep_high_precision": [{"fqns": ["lm_head"]}],
    "rules": [{"name": "b0", "select": {"glob": "blocks.0.*"}, "format": "fp8_delayed"},
              {"name": "b1", "select": {"glob": "blocks.1.*"}, "format": "fp8_tensorwise"},
              {"name": "fp4", "select": {"glob": "blocks.1.mlp.*"}, "format": "nvfp4",
               "ladder": ["nvfp4", "fp8_tensorwise", "bf16"]}],
}


class Controller:
    def __init__(self, n=0, reason=""):
        self.n, self.reason = n, reason

    def state_dict(self):
        return {"n": self.n, "reason": self.reason, "history": [1.5, 2.5]}

    def load_state_dict(self, st):
        self.n, self.reason = st["n"], st["reason"]


def make(seed=0, **model_kw):
    """A prepared model; `seed` draws its weights (the plan's seeds stay those of the run)."""
    torch.manual_seed(seed)
    model = build_gpt(**{**MODEL, **model_kw})
    state = prepare(model, PrecisionPlan.from_dict(PLAN), seed=0)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-3), state


def train(model, opt, data):
    losses = []
    for x, y in data:
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def trained_run(steps=3):
    model, opt, state = make()
    data = list(batches(corpus_bytes(), steps + 2, batch=4))
    train(model, opt, data[:steps])
    state.set_format("blocks.1.mlp.fc", "fp8_tensorwise")  # a fallback the checkpoint must carry
    return model, opt, state, data


@pytest.fixture(scope="module")
def trained():
    """A run after 3 steps, shared by the tests that only save it (saving changes nothing)."""
    return trained_run()


def test_round_trip_restores_every_part_and_continues_identically(tmp_path):
    model, opt, state, data = trained_run()
    random.seed(1); np.random.seed(2); torch.manual_seed(3)
    path = save_checkpoint(tmp_path, 3, model=model, optimizer=opt, precision=state,
                           controller=Controller(7, "spike"), data_state={"consumed": 3, "epoch": 0},
                           extra={"note": "hi"})
    assert path == tmp_path / "step_00000003.pt" and path.is_file()
    expected_rng = (random.random(), float(np.random.rand()), torch.rand(3))
    expected_loss = train(model, opt, data[3:5])

    model2, opt2, state2 = make(seed=9)  # other weights; fresh formats, histories, generators
    ctl2 = Controller()
    random.seed(0); np.random.seed(0); torch.manual_seed(0)
    got = load_checkpoint(path, model=model2, optimizer=opt2, precision=state2, controller=ctl2)
    assert got == {"step": 3, "data_state": {"consumed": 3, "epoch": 0}, "extra": {"note": "hi"},
                   "path": path}
    assert (ctl2.n, ctl2.reason) == (7, "spike")
    assert state2.formats() == state.formats() and state2.formats()["blocks.1.mlp.fc"] == "fp8_tensorwise"
    assert random.random() == expected_rng[0] and float(np.random.rand()) == expected_rng[1]
    assert torch.equal(torch.rand(3), expected_rng[2])
    assert train(model2, opt2, data[3:5]) == expected_loss  # weights, Adam moments, histories, SR
    for (k, a), b in zip(model.state_dict().items(), model2.state_dict().values()):
        assert torch.equal(a, b), k
    p1, p2 = state.state_dict()["sites"], state2.state_dict()["sites"]
    h1, h2 = (p["blocks.0.mlp.fc"]["histories"]["input"] for p in (p1, p2))
    assert h1["count"].item() == h2["count"].item() > 0 and torch.equal(h1["history"], h2["history"])
    assert torch.equal(p1["blocks.1.mlp.proj"]["generator"], p2["blocks.1.mlp.proj"]["generator"])


def test_checkpoint_loads_with_weights_only_and_holds_plain_data(tmp_path, trained):
    model, opt, state, _ = trained
    path = save_checkpoint(tmp_path, 3, model=model, optimizer=opt, precision=state,
                           data_state={"generator": torch.Generator().get_state(), "consumed": 3})
    ck = torch.load(path, weights_only=True)
    assert ck["format"] == "lowprec.state.checkpoint" and ck["step"] == 3 and ck["controller"] is None
    assert set(ck) >= {"model", "optim", "precision", "data", "rng", "extra"}
    assert set(ck["rng"]) >= {"torch", "python", "numpy"}
    assert ck["rng"]["python"]["state"].dtype == torch.int64


def test_state_that_would_not_load_weights_only_is_refused_before_writing(tmp_path, trained):
    model, opt, state, _ = trained

    class BadController(Controller):
        def state_dict(self):
            return {"n": 1, "threshold": np.float64(0.5)}

    with pytest.raises(TypeError, match=r"checkpoint\['controller'\]\['threshold'\] is a numpy.float64"):
        save_checkpoint(tmp_path, 1, model=model, optimizer=opt, precision=state, controller=BadController())
    assert list(tmp_path.iterdir()) == []


def test_pruning_keeps_the_newest_and_moves_an_abandoned_future_aside(tmp_path):
    model, opt, _ = make()
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, model=model, optimizer=opt, keep=2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    (tmp_path / "step_00000006.pt.tmp").write_bytes(b"torn")  # a killed writer's temporary
    save_checkpoint(tmp_path, 6, model=model, optimizer=opt, keep=None)
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step_0000000{i}.pt" for i in (4, 5, 6)]
    save_checkpoint(tmp_path, 5, model=model, optimizer=opt, keep=None)  # rewound to step 5
    assert [s for s, _ in list_checkpoints(tmp_path)] == [4, 5]
    assert latest_checkpoint(tmp_path).name == "step_00000005.pt"
    # the abandoned step 6 is kept, out of reach of resume and of pruning
    assert [p.name for p in (tmp_path / "abandoned").iterdir()] == ["step_00000006.pt"]
    save_checkpoint(tmp_path, 0, model=model, optimizer=opt, keep=1)  # a rewind all the way back
    assert [s for s, _ in list_checkpoints(tmp_path)] == [0]
    assert sorted(p.name for p in (tmp_path / "abandoned").iterdir()) == [f"step_0000000{i}.pt" for i in (4, 5, 6)]


def test_latest_ignores_temporaries_and_torn_files(tmp_path):
    assert latest_checkpoint(tmp_path / "absent") is None and latest_checkpoint(tmp_path) is None
    model, opt, _ = make()
    good = save_checkpoint(tmp_path, 5, model=model, optimizer=opt)
    data = good.read_bytes()
    (tmp_path / "step_00000007.pt.tmp").write_bytes(data[: len(data) // 2])
    (tmp_path / "step_00000008.tmp").mkdir()
    (tmp_path / "step_00000009.pt").write_bytes(data[: len(data) // 2])  # cut short by a copy
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    with pytest.warns(UserWarning, match="skipping checkpoint .*step_00000009.pt"):
        assert latest_checkpoint(tmp_path) == good
    with pytest.raises(ValueError, match="not a complete lowprec checkpoint.*torn"):
        load_checkpoint(tmp_path / "step_00000009.pt", model=model, optimizer=opt)


def test_errors_say_what_was_found_and_how_to_fix(tmp_path, trained):
    model, opt, state, _ = trained
    path = save_checkpoint(tmp_path, 3, model=model, optimizer=opt, precision=state)
    with pytest.raises(FileNotFoundError,
                       match=r"step_00000004.pt.*holds \['step_00000003.pt'\].*latest_checkpoint"):
        load_checkpoint(tmp_path / "step_00000004.pt", model=model, optimizer=opt, precision=state)

    wide, wide_opt, wide_state = make(d_model=128)
    before = {k: v.clone() for k, v in wide.state_dict().items()}
    with pytest.raises(ValueError, match=r"does not fit this model.*tok_emb.weight \(checkpoint \(256, 64\), "
                                         r"model \(256, 128\)\).*same plan"):
        load_checkpoint(path, model=wide, optimizer=wide_opt, precision=wide_state)
    assert all(torch.equal(before[k], v) for k, v in wide.state_dict().items())  # nothing changed

    m2, _, s2 = make()
    rest = [p for n, p in m2.named_parameters() if not n.startswith("blocks")]
    two_groups = torch.optim.AdamW([{"params": list(m2.blocks.parameters())}, {"params": rest}])
    with pytest.raises(ValueError, match=r"parameter groups of sizes \[\d+\], this optimizer has \[\d+, \d+\]"):
        load_checkpoint(path, model=m2, optimizer=two_groups, precision=s2)
    m2, o2, s2 = make()
    with pytest.raises(ValueError, match="holds precision state but no precision= was given"):
        load_checkpoint(path, model=m2, optimizer=o2)
    with pytest.raises(ValueError, match="holds no controller state"):
        load_checkpoint(path, model=m2, optimizer=o2, precision=s2, controller=Controller())
    torch.save({"model": {}}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a lowprec checkpoint"):
        load_checkpoint(tmp_path / "other.pt", model=m2, optimizer=o2)
    with pytest.raises(ValueError, match="keep must be >= 1"):
        save_checkpoint(tmp_path, 4, model=m2, optimizer=o2, keep=0)


# ----------------------------------------------------------------------------- SIGKILL

STEPS = 12
RUN = ("--steps", str(STEPS), "--every", "3")  # checkpoints at 3, 6, 9, 12


def run_worker(ckdir, *args, expect_kill=False):
    out = subprocess.run([sys.executable, str(WORKER), str(ckdir), *args],
                         capture_output=True, text=True, timeout=300)
    if expect_kill:
        assert out.returncode != 0, out.stdout[-2000:]
    else:
        assert out.returncode == 0, out.stderr[-3000:]
    return parse(out.stdout)


def parse(stdout):
    losses = {int(s): float(v) for kind, s, v in (ln.split()[:3] for ln in stdout.splitlines()
                                                  if ln.startswith("LOSS "))}
    saved = [int(ln.split()[1]) for ln in stdout.splitlines() if ln.startswith("SAVED ")]
    return losses, saved


@pytest.fixture(scope="module")
def never_killed(tmp_path_factory):
    losses, saved = run_worker(tmp_path_factory.mktemp("full"), *RUN)
    assert sorted(losses) == list(range(STEPS)) and saved == [3, 6, 9, 12]
    return losses


@pytest.mark.slow   # checkpoint_worker.py in fresh processes, killed and resumed
def test_sigkill_during_a_checkpoint_write_resumes_from_the_previous_one(tmp_path, never_killed):
    ck = tmp_path / "ck"
    killed, saved = run_worker(ck, *RUN, "--kill-on-save", "9", expect_kill=True)
    assert saved == [3, 6] and sorted(killed) == list(range(9))
    assert killed == {s: never_killed[s] for s in range(9)}
    torn = ck / "step_00000009.pt.tmp"
    assert torn.is_file() and not (ck / "step_00000009.pt").exists()   # the write never completed
    assert latest_checkpoint(ck) == ck / "step_00000006.pt"
    prev = torch.load(ck / "step_00000006.pt", weights_only=True)       # and the previous one is intact
    assert prev["step"] == 6 and prev["data"]["consumed"] == 6 and prev["controller"]["observed"] == 6

    resumed, saved = run_worker(ck, *RUN, "--resume")
    assert saved == [9, 12] and sorted(resumed) == list(range(6, STEPS))
    assert resumed == {s: never_killed[s] for s in range(6, STEPS)}       # bit-identical floats
    assert not torn.exists()  # the next save cleared the killed writer's temporary


@pytest.mark.slow   # checkpoint_worker.py in fresh processes, killed and resumed
def test_sigkill_at_a_random_moment_resumes_from_the_last_complete_checkpoint(tmp_path, never_killed):
    """Checkpoint every step and kill from outside at a random time: wherever it lands (in
    a write, between writes), the resumed run repeats the never-killed losses."""
    ck = tmp_path / "ck"
    proc = subprocess.Popen([sys.executable, str(WORKER), str(ck), "--steps", str(STEPS), "--every", "1"],
                            stdout=subprocess.PIPE, text=True)
    lines, seen = [], {}
    for line in proc.stdout:
        lines.append(line)
        seen[line.split()[1] if line.startswith("SAVED") else None] = time.monotonic()
        if line.startswith("SAVED 4"):
            break
    time.sleep(random.Random().uniform(0.0, seen["4"] - seen["3"]))  # within about one step + save
    proc.send_signal(signal.SIGKILL)
    rest, _ = proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    _, saved = parse("".join(lines) + rest)
    start = torch.load(latest_checkpoint(ck), weights_only=True)["step"]
    assert start == saved[-1] or start == saved[-1] + 1  # the last reported, or one completed after
    resumed, _ = run_worker(ck, "--steps", str(STEPS), "--every", "1", "--resume")
    assert sorted(resumed) == list(range(start, STEPS))
    assert resumed == {s: never_killed[s] for s in range(start, STEPS)}


@pytest.mark.slow   # checkpoint_worker.py in fresh processes, killed and resumed
def test_sharded_fsdp2_checkpoint_survives_sigkill_and_resumes_identically(tmp_path, gloo):
    """FSDP2 over 2 gloo ranks: torch.distributed.checkpoint into step_N.tmp/, renamed by rank 0.
    Rank 0 dies while checkpoint 9 is not yet renamed; the resumed run (from 6) repeats
    the losses the killed run computed for steps 6-8 before it was killed."""
    ck = tmp_path / "ck"
    killed, saved = run_worker(ck, "--fsdp", *RUN, "--kill-on-save", "9", expect_kill=True)
    assert saved == [3, 6] and sorted(killed) == list(range(9))
    assert (ck / "step_00000009.tmp").is_dir() and not (ck / "step_00000009").exists()
    assert latest_checkpoint(ck) == ck / "step_00000006"
    files = {p.name for p in (ck / "step_00000006").iterdir()}
    assert files >= {".metadata", "rank_00000.pt", "rank_00001.pt"}  # shards + per-rank state

    resumed, saved = run_worker(ck, "--fsdp", *RUN, "--resume")
    assert saved == [9, 12] and sorted(resumed) == list(range(6, STEPS))
    assert {s: resumed[s] for s in range(6, 9)} == {s: killed[s] for s in range(6, 9)}
    assert sorted(p.name for p in ck.iterdir()) == ["step_00000006", "step_00000009", "step_00000012"]


def test_directory_checkpoint_of_a_sharded_model_in_one_process(tmp_path, gloo):
    """The DCP path without subprocesses: FSDP2 on a 1-rank gloo group. Saving the same step
    again (after a rewind) replaces the directory and moves the abandoned later one aside."""
    dist = gloo
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def sharded(seed, **kw):
        model, _, state = make(seed, **kw)
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        return model, torch.optim.AdamW(model.parameters(), lr=1e-3), state

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model, opt, state = sharded(0)
        data = list(batches(corpus_bytes(), 2, batch=4))
        train(model, opt, data[:1])
        ck = tmp_path / "ck"
        save_checkpoint(ck, 1, model=model, optimizer=opt, precision=state)
        save_checkpoint(ck, 2, model=model, optimizer=opt, precision=state)
        path = save_checkpoint(ck, 1, model=model, optimizer=opt, precision=state, data_state={"again": 1})
        assert sorted(p.name for p in ck.iterdir()) == ["abandoned", "step_00000001"] and path == ck / "step_00000001"
        assert [p.name for p in (ck / "abandoned").iterdir()] == ["step_00000002"]
        assert {".metadata", "rank_00000.pt", "manifest.json"} <= {p.name for p in path.iterdir()}
        assert latest_checkpoint(ck) == path
        expected = train(model, opt, data[1:2])

        model2, opt2, state2 = sharded(5)
        got = load_checkpoint(path, model=model2, optimizer=opt2, precision=state2)
        assert got["step"] == 1 and got["data_state"] == {"again": 1}
        assert train(model2, opt2, data[1:2]) == expected
        wide, wide_opt, wide_state = sharded(0, d_model=128)
        with pytest.raises(ValueError, match=r"does not fit this model/optimizer \(ValueError: "
                                             r"Size mismatch.*tok_emb.weight\).*build the model"):
            load_checkpoint(path, model=wide, optimizer=wide_opt, precision=wide_state)
    finally:
        dist.destroy_process_group()


def test_a_checkpoint_before_the_first_step_changes_nothing(tmp_path, gloo):
    """torch's get_state_dict (the sharded path) creates missing optimizer state with a
    zero-lr step, which set AdamW's step count to 1: the first real step then ran with the
    bias correction of a second one. Saving at step 0 (a file in one process, a directory
    for FSDP2 on a 1-rank gloo group) must leave the optimizer without state, and so must
    a rewind to that checkpoint: the parameters after 3 steps equal, bit for bit, those of
    a run that never checkpointed."""
    dist = gloo
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    data = list(batches(corpus_bytes(), 3, batch=4))

    def run(ck, shard):
        model, _, state = make()
        if shard:
            fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        if ck is not None:
            path = save_checkpoint(ck, 0, model=model, optimizer=opt, precision=state)
            assert not opt.state  # nothing materialised
        train(model, opt, data)
        after = [p.detach().clone() for p in model.parameters()]
        if ck is not None:  # rewind to step 0: the optimizer, which now has state, is fresh again
            load_checkpoint(path, model=model, optimizer=opt, precision=state)
            assert not opt.state
            train(model, opt, data)
            assert all(torch.equal(a, p) for a, p in zip(after, model.parameters()))
        return after

    for shard in (False, True):
        if shard:
            dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
        try:
            never = run(None, shard)
            saved = run(tmp_path / f"ck{int(shard)}", shard)
            assert all(torch.equal(a, b) for a, b in zip(never, saved)), f"sharded={shard}"
        finally:
            if shard:
                dist.destroy_process_group()


@pytest.mark.slow   # two gloo ranks of checkpoint_worker.py in fresh processes
def test_sharded_checkpoint_of_pipeline_stages_restores_each_stage(tmp_path, gloo):
    """Two gloo ranks holding different parameters (pipeline stages, see checkpoint_worker.py
    --pp-round-trip): after save, two more steps and load, each rank has its own saved
    parameters and optimizer state back (a single param_groups entry kept once for all
    ranks used to give a stage the other's parameter list, and no betas)."""
    out = subprocess.run([sys.executable, str(WORKER), str(tmp_path / "ck"), "--pp-round-trip"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    # two ranks share torchrun's stdout: their lines can interleave without a newline between
    assert sorted(re.findall(r"PP_OK \d+ \d+", out.stdout)) == ["PP_OK 0 14", "PP_OK 1 15"]
    assert {p.name for p in (tmp_path / "ck" / "step_00000002").iterdir()} >= {".metadata", "rank_00000.pt",
                                                                              "rank_00001.pt"}


# ----------------------------------------------------------------------------- integrity

def flip_bit_in(path: Path, tensor: torch.Tensor) -> None:
    """Flip one bit of `tensor`'s stored bytes inside `path` (a low mantissa bit of an element)."""
    raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
    data = bytearray(path.read_bytes())
    at = data.find(raw[:256])
    assert at >= 0 and data.find(raw[:256], at + 1) < 0, "the tensor's bytes are not in the file once"
    data[at + 100] ^= 0x01
    path.write_bytes(bytes(data))


def test_a_flipped_bit_in_a_weight_is_refused_skipped_and_resume_uses_the_previous_one(tmp_path):
    from lowprec.state.checkpoint import CorruptCheckpointError
    from lowprec.runtime.session.snapshots import DiskSnapshots

    model, opt, _ = make()
    three = save_checkpoint(tmp_path, 3, model=model, optimizer=opt)
    with torch.no_grad():
        model.tok_emb.weight.add_(0.01)
    five = save_checkpoint(tmp_path, 5, model=model, optimizer=opt)
    flip_bit_in(five, model.tok_emb.weight)

    model2, opt2, _ = make(seed=9)
    before = {k: v.clone() for k, v in model2.state_dict().items()}
    with pytest.raises(CorruptCheckpointError, match=r"step_00000005.pt is corrupt.*model/tok_emb.weight"):
        load_checkpoint(five, model=model2, optimizer=opt2)
    assert all(torch.equal(before[k], v) for k, v in model2.state_dict().items())  # nothing changed
    with pytest.warns(UserWarning, match=r"skipping checkpoint .*step_00000005.pt.*corrupt"):
        assert latest_checkpoint(tmp_path) == three
    assert load_checkpoint(three, model=model2, optimizer=opt2)["step"] == 3
    # a rewind to disk skips it too, and the save that follows keeps it (aside), not deletes it
    rewind = DiskSnapshots(tmp_path, model2, opt2)
    with pytest.warns(UserWarning, match=r"rewind: skipping checkpoint .*step_00000005.pt"):
        assert rewind.restore(10, skip_batches=0) == 3
    save_checkpoint(tmp_path, 3, model=model2, optimizer=opt2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [3]
    assert (tmp_path / "abandoned" / "step_00000005.pt").is_file()


def test_a_flipped_bit_outside_the_tensors_is_refused(tmp_path):
    from lowprec.state.checkpoint import CorruptCheckpointError
    model, opt, _ = make()
    path = save_checkpoint(tmp_path, 3, model=model, optimizer=opt, extra={"losses": [2.5, 2.25]})
    data = bytearray(path.read_bytes())
    at = data.find(torch.tensor(2.25, dtype=torch.float64).numpy().tobytes()[::-1])  # pickle: big-endian
    assert at >= 0
    data[at + 7] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match="non-tensor contents"):
        load_checkpoint(path, model=model, optimizer=opt)


def test_every_checkpoint_corrupt_is_not_the_same_as_none(tmp_path):
    from lowprec.state.checkpoint import NoUsableCheckpointError, checkpoint_to_resume
    assert checkpoint_to_resume(tmp_path) is None
    model, opt, _ = make()
    paths = [save_checkpoint(tmp_path, s, model=model, optimizer=opt) for s in (1, 2)]
    for p in paths:
        flip_bit_in(p, model.tok_emb.weight)
    with pytest.warns(UserWarning):
        assert latest_checkpoint(tmp_path) is None
    with pytest.warns(UserWarning), \
            pytest.raises(NoUsableCheckpointError, match=r"every checkpoint.*step_00000002.pt.*step_00000001.pt"):
        checkpoint_to_resume(tmp_path)


def test_a_flipped_bit_in_a_directory_checkpoint_is_refused_naming_the_file(tmp_path, gloo):
    dist = gloo
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from lowprec.state.checkpoint import CorruptCheckpointError

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model, _, state = make()
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        ck = tmp_path / "ck"
        one = save_checkpoint(ck, 1, model=model, optimizer=opt, precision=state)
        two = save_checkpoint(ck, 2, model=model, optimizer=opt, precision=state)
        shard = next(p for p in two.iterdir() if p.suffix == ".distcp")
        flip_bit_in(shard, model.tok_emb.weight.to_local())
        with pytest.raises(CorruptCheckpointError, match=rf"step_00000002 is corrupt.*{shard.name} \(SHA-256"):
            load_checkpoint(two, model=model, optimizer=opt, precision=state)
        with pytest.warns(UserWarning, match=r"skipping checkpoint .*step_00000002 .*corrupt"):
            assert latest_checkpoint(ck) == one
        assert load_checkpoint(one, model=model, optimizer=opt, precision=state)["step"] == 1
    finally:
        dist.destroy_process_group()
