"""The rollout's state in a framework's checkpoint folder (lowprec.integrations.state_files)
and `HostedRollout.state_dict` / `load_state_dict`, without a framework: a small stack of
linear layers trained through the hosted rollout until its stage promotes, then saved,
read back into a fresh model, and refused where it must be (torn, altered, missing, other
ranks, other layers), with nothing changed."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowprec.policy.events import EventKind
from lowprec.config import ConfigRole, LowprecConfig
from lowprec.integrations.core import HostedRollout
from lowprec.integrations.state_files import (MissingRolloutStateError, differing_weights, read_rollout_state,
                                              rollout_state_path, save_rollout_state, weights_fingerprint)
from lowprec.state.integrity import CorruptCheckpointError

CONFIG = {
    "precision": {"backend": "emulated", "default": "bf16",
                  "rules": [{"name": "all", "select": {"module_type": "Linear"}, "format": "bf16",
                             "ladder": ["fp8_delayed", "bf16"]}]},
    "rollout": {"check_every": 2, "min_steps": 4,
                "stages": [{"name": "first", "select": {"glob": "0"}, "format": "fp8_delayed"}]},
    "tracking": {"enabled": False},
}


def _hosted() -> HostedRollout:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    hosted = HostedRollout(LowprecConfig.from_dict(CONFIG, role=ConfigRole.FRAMEWORK), model)
    hosted.start(torch.optim.AdamW(model.parameters(), lr=1e-3))
    return hosted


def _train(hosted: HostedRollout, steps: int) -> None:
    g = torch.Generator().manual_seed(hosted.step)
    opt = hosted.session.optimizer
    for _ in range(steps):
        x = torch.randn(8, 16, generator=g)
        opt.zero_grad(set_to_none=True)
        loss = hosted.model(x).pow(2).mean()
        loss.backward()
        hosted.before_optimizer_step(loss)
        opt.step()
        hosted.after_optimizer_step()


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A hosted rollout whose stage promoted, and the checkpoint folder it saved into."""
    hosted = _hosted()
    _train(hosted, 9)
    assert [e.kind for e in hosted.session.events].count(EventKind.PROMOTE) == 1
    assert hosted.state.formats()["0"] == "fp8_delayed"
    folder = tmp_path_factory.mktemp("ckpt") / "checkpoint-9"
    folder.mkdir()
    save_rollout_state(hosted.state_dict(), folder)
    return hosted, folder


def test_the_saved_state_puts_a_fresh_rollout_where_the_run_was(trained):
    hosted, folder = trained
    fresh = _hosted()
    assert fresh.state.formats()["0"] == "bf16" and fresh.step == 0     # the plan's start
    fresh.load_state_dict(read_rollout_state(folder))
    assert fresh.state.formats() == hosted.state.formats()
    assert fresh.step == hosted.step and fresh.losses == hosted.losses
    assert [e.to_json() for e in fresh.session.events] == [e.to_json() for e in hosted.session.events]
    saved, now = hosted.state.sites["0"].module.histories, fresh.state.sites["0"].module.histories
    assert saved.keys() == now.keys() == {"input", "weight", "grad_output"}
    for k in saved:
        assert torch.equal(saved[k].history, now[k].history) and saved[k].count == now[k].count
    assert fresh.session.controller.state_dict() == hosted.session.controller.state_dict()


def test_a_folder_without_the_state_is_refused_saying_so(tmp_path):
    with pytest.raises(MissingRolloutStateError, match="holds no lowprec rollout state"):
        read_rollout_state(tmp_path)
    other = rollout_state_path(tmp_path, rank=1)     # what two ranks left
    other.parent.mkdir()
    other.write_bytes(b"x")
    with pytest.raises(MissingRolloutStateError, match=r"rank_00001\.pt: saved by another number of ranks"):
        read_rollout_state(tmp_path)


def test_no_stray_checkpoint_folder_is_made(trained, tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint folder"):
        save_rollout_state(trained[0].state_dict(), tmp_path / "checkpoint-3")
    assert not (tmp_path / "checkpoint-3").exists()


@pytest.mark.parametrize("damage", ["torn", "flipped"])
def test_a_torn_or_altered_file_is_refused(trained, tmp_path, damage):
    import shutil
    folder = tmp_path / "checkpoint-9"
    shutil.copytree(trained[1], folder)
    path = rollout_state_path(folder)
    data = bytearray(path.read_bytes())
    if damage == "torn":
        data = data[: len(data) // 2]
    else:   # one bit of the first history's bytes: the file still opens, its checksum does not match
        saved = trained[0].state.sites["0"].module.histories["input"].history
        at = bytes(data).find(saved.numpy().tobytes()[:8])
        assert at > 0
        data[at] ^= 0x01
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCheckpointError, match=str(path)):
        read_rollout_state(folder)


def test_a_state_that_does_not_fit_changes_nothing(trained):
    hosted, folder = trained
    saved = read_rollout_state(folder)
    other = _hosted()
    with pytest.raises(ValueError, match=r"saved by 2 rank\(s\) and 1 run now"):
        other.load_state_dict({**saved, "world_size": 2})
    sites = saved["precision"]["sites"]
    wrong = {**saved, "precision": {**saved["precision"], "sites": {**sites, "9": sites["0"]}}}   # another model's
    with pytest.raises(ValueError, match="unknown sites"):
        other.load_state_dict(wrong)
    with pytest.raises(ValueError, match="not a lowprec rollout state"):
        other.load_state_dict({"precision": saved["precision"]})
    assert other.state.formats() == {"0": "bf16", "2": "bf16"} and other.step == 0 and not other.session.events


def test_the_weight_fingerprint_names_what_changed():
    model = _hosted().model
    saved = weights_fingerprint(model)
    assert differing_weights(saved, model) == []
    with torch.no_grad():
        model[2].bias[0] += 1e-6            # one element of one parameter
    assert differing_weights(saved, model) == ["2.bias"]
    assert differing_weights({k: v for k, v in saved.items() if k != "0.weight"}, model) == ["0.weight", "2.bias"]
