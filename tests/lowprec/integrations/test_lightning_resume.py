"""Resuming a Lightning `Trainer` from its checkpoint resumes lowprec too.

Run A trains 30 steps with a ModelCheckpoint at step 20 (the end of the first epoch): the
MLP stage promotes, and a NaN in one MLP layer while it runs in FP8 makes it fall back to
BF16. Run B is a fresh module and callback with `trainer.fit(..., ckpt_path=<step 20>)`:
Lightning hands the callback its saved state, and training must start where A was at
step 20 (not from the plan) and go on as A did. A checkpoint whose callback state lacks
lowprec's is refused before anything changes.
"""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow   # real Lightning runs

pytest.importorskip("lightning")
pytest.importorskip("transformers")

import lightning  # noqa: E402
import torch  # noqa: E402

from lightning_helpers import LlamaModule, loader  # noqa: E402
from llama_helpers import CONFIG, assert_same_progress, lowprec_now  # noqa: E402
from lowprec.policy.events import EventKind  # noqa: E402
from lowprec.integrations.lightning import LowprecCallback  # noqa: E402
from lowprec.integrations.state_files import MissingRolloutStateError  # noqa: E402
from lowprec.runtime.trainer.faults import FaultKind, Faults, Injection  # noqa: E402

NAN_SITE = "model.layers.0.mlp.down_proj"
NAN_AT, SAVE_AT, STEPS = 16, 20, 30
QUIET = CONFIG.replace("tracking: {experiment: hf-integration}", "tracking: {enabled: false}")


class Seen(lightning.pytorch.Callback):
    """After lowprec's callback: lowprec when Lightning saved and when training started."""

    def __init__(self, lp: LowprecCallback, faults: Faults | None = None):
        self.lp, self.faults = lp, faults
        self.at_save: dict[int, dict] = {}
        self.at_start: dict | None = None

    def on_train_start(self, trainer, pl_module):
        self.at_start = lowprec_now(self.lp)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if self.faults is not None:
            self.faults.tick(trainer.global_step)

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        self.at_save[trainer.global_step] = lowprec_now(self.lp)


def _trainer(root, lp, seen, checkpoint=None) -> lightning.Trainer:
    callbacks = [lp, seen] + ([checkpoint] if checkpoint is not None else [])
    return lightning.Trainer(accelerator="cpu", devices=1, max_steps=STEPS, logger=False, enable_progress_bar=False,
                             enable_model_summary=False, default_root_dir=str(root), callbacks=callbacks,
                             enable_checkpointing=checkpoint is not None)



@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from lightning.pytorch.callbacks import ModelCheckpoint
    tmp = tmp_path_factory.mktemp("lightning-resume")
    (tmp / "lowprec.yaml").write_text(QUIET)
    torch.manual_seed(0)
    module = LlamaModule()
    lp = LowprecCallback.from_yaml(tmp / "lowprec.yaml", module.model)
    first = Seen(lp, Faults(module.model, [Injection(FaultKind.NAN, NAN_AT, NAN_AT + 1, NAN_SITE)]))
    every = ModelCheckpoint(dirpath=tmp / "ckpt", every_n_train_steps=SAVE_AT, save_top_k=-1)
    _trainer(tmp, lp, first, every).fit(module, loader(8 * SAVE_AT))   # one epoch = SAVE_AT steps
    path = tmp / "ckpt" / f"epoch=0-step={SAVE_AT}.ckpt"
    assert path.is_file(), sorted(p.name for p in (tmp / "ckpt").iterdir())

    torch.manual_seed(0)
    module_b = LlamaModule()
    lp_b = LowprecCallback.from_yaml(tmp / "lowprec.yaml", module_b.model)
    second = Seen(lp_b)
    _trainer(tmp / "b", lp_b, second).fit(module_b, loader(8 * SAVE_AT), ckpt_path=str(path))
    return tmp, path, (lp, first), (lp_b, second)


def test_the_checkpoint_holds_a_fallback(runs):
    _, _, (lp, first), _ = runs
    assert [(e.step, e.sites) for e in lp.session.events if e.kind == EventKind.FALLBACK] == [(NAN_AT, (NAN_SITE,))]
    at_save = first.at_save[SAVE_AT]
    assert at_save["formats"][NAN_SITE] == "bf16"
    assert at_save["formats"]["model.layers.1.mlp.down_proj"] == "fp8_tensorwise"


def test_the_resumed_run_starts_where_the_checkpoint_was_and_goes_on_alike(runs):
    _, _, (lp, first), (lp_b, second) = runs
    start, at_save = second.at_start, first.at_save[SAVE_AT]
    assert_same_progress(start, at_save)       # not the plan's start: every layer BF16, step 0
    assert start["formats"][NAN_SITE] == "bf16" and start["step"] == SAVE_AT
    assert lp.step == STEPS
    assert_same_progress(lowprec_now(lp_b), lowprec_now(lp))   # steps 21-30 trained again, bit for bit


def test_a_checkpoint_without_lowprec_state_is_refused(runs, tmp_path):
    tmp, path, _, _ = runs
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    ckpt["callbacks"] = {k: v for k, v in ckpt["callbacks"].items() if "LowprecCallback" not in k}
    bare = tmp_path / "bare.ckpt"
    torch.save(ckpt, bare)
    torch.manual_seed(0)
    module = LlamaModule()
    lp = LowprecCallback.from_yaml(tmp / "lowprec.yaml", module.model)
    with pytest.raises(MissingRolloutStateError, match="holds no lowprec rollout state.*restore=False"):
        _trainer(tmp_path, lp, Seen(lp)).fit(module, loader(8 * SAVE_AT), ckpt_path=str(bare))
    assert lp.session is None
