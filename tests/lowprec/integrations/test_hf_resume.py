"""Resuming a Hugging Face `Trainer` from its checkpoint resumes lowprec too.

Run A trains 30 steps, saving a checkpoint at step 20: the MLP stage promotes, and a NaN
in one MLP layer while it runs in FP8 makes it fall back to BF16. Run B is a new process's
view of the same job: a fresh model and callback, `trainer.train(resume_from_checkpoint=True)`.
It must start where A was at step 20 (that layer in BF16, the other MLP layers in FP8,
the controller past its first stage, the same events and step count), not from the plan,
and train steps 21-30 with the same losses as A. A checkpoint without lowprec's state is
refused before anything changes.
"""

from __future__ import annotations

import shutil

import pytest

pytestmark = pytest.mark.slow   # two real Trainer runs

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from llama_helpers import CONFIG, assert_same_progress, lowprec_now, shakespeare_blocks, tiny_llama  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from lowprec.policy.events import EventKind  # noqa: E402
from lowprec.integrations.hf import LowprecCallback  # noqa: E402
from lowprec.integrations.state_files import MissingRolloutStateError  # noqa: E402
from lowprec.runtime.trainer.faults import FaultKind, Faults, Injection  # noqa: E402

NAN_SITE = "model.layers.0.mlp.down_proj"
NAN_AT, SAVE_AT, STEPS = 16, 20, 30
QUIET = CONFIG.replace("tracking: {experiment: hf-integration}", "tracking: {enabled: false}")


class Seen(TrainerCallback):
    """After lowprec's callback: what lowprec looked like when the Trainer saved, and when it began."""

    def __init__(self, lp: LowprecCallback, faults: Faults | None = None):
        self.lp, self.faults = lp, faults
        self.at_save: dict[int, dict] = {}   # Trainer step -> lowprec then
        self.at_begin: dict | None = None

    def on_train_begin(self, args, state, control, **kw):
        self.at_begin = lowprec_now(self.lp)

    def on_step_begin(self, args, state, control, **kw):
        if self.faults is not None:
            self.faults.tick(state.global_step)

    def on_save(self, args, state, control, **kw):
        self.at_save[state.global_step] = lowprec_now(self.lp)



def _args(out) -> TrainingArguments:
    return TrainingArguments(output_dir=str(out), max_steps=STEPS, per_device_train_batch_size=8, learning_rate=3e-3,
                             warmup_steps=5, report_to=[], use_cpu=True, save_strategy="steps", save_steps=SAVE_AT,
                             seed=0, disable_tqdm=True)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("hf-resume")
    (tmp / "lowprec.yaml").write_text(QUIET)
    data = shakespeare_blocks(8 * 40)
    model = tiny_llama()
    lp = LowprecCallback.from_yaml(tmp / "lowprec.yaml", model)
    first = Seen(lp, Faults(model, [Injection(FaultKind.NAN, NAN_AT, NAN_AT + 1, NAN_SITE)]))
    Trainer(model=model, args=_args(tmp / "out"), train_dataset=data, callbacks=[lp, first]).train()
    saved = tmp / "saved-checkpoint"   # a copy, for the refusal test (run B's own saves leave it alone)
    shutil.copytree(tmp / "out" / f"checkpoint-{SAVE_AT}", saved)

    model_b = tiny_llama()
    lp_b = LowprecCallback.from_yaml(tmp / "lowprec.yaml", model_b)
    second = Seen(lp_b)
    Trainer(model=model_b, args=_args(tmp / "out"), train_dataset=data,
            callbacks=[lp_b, second]).train(resume_from_checkpoint=str(tmp / "out" / f"checkpoint-{SAVE_AT}"))
    return tmp, (lp, first), (lp_b, second), saved


def test_run_a_fell_back_before_its_checkpoint(runs):
    _, (lp, first), _, _ = runs
    falls = [(e.step, e.sites) for e in lp.session.events if e.kind == EventKind.FALLBACK]
    assert falls == [(NAN_AT, (NAN_SITE,))]
    assert sorted(first.at_save) == [SAVE_AT, STEPS]   # the Trainer saves at the last step too
    at_save = first.at_save[SAVE_AT]
    assert at_save["formats"][NAN_SITE] == "bf16"
    assert at_save["formats"]["model.layers.1.mlp.down_proj"] == "fp8_tensorwise"


def test_the_resumed_run_starts_where_the_checkpoint_was(runs):
    _, (_, first), (_, second), _ = runs
    begin, at_save = second.at_begin, first.at_save[SAVE_AT]
    assert_same_progress(begin, at_save)       # not the plan's start: every layer BF16, step 0
    assert begin["formats"][NAN_SITE] == "bf16" and begin["step"] == SAVE_AT


def test_the_resumed_run_goes_on_as_the_first_did(runs):
    _, (lp, _), (lp_b, _), _ = runs
    assert lp.step == STEPS
    assert_same_progress(lowprec_now(lp_b), lowprec_now(lp))   # steps 21-30 trained again, bit for bit


def test_a_checkpoint_without_lowprec_state_is_refused(runs, tmp_path):
    tmp, _, _, saved = runs
    folder = tmp_path / "out" / f"checkpoint-{SAVE_AT}"
    shutil.copytree(saved, folder)
    shutil.rmtree(folder / "lowprec")
    lp = LowprecCallback.from_yaml(tmp / "lowprec.yaml", tiny_llama())
    trainer = Trainer(model=lp.model, args=_args(tmp_path / "out"), train_dataset=shakespeare_blocks(8 * 40),
                      callbacks=[lp])
    with pytest.raises(MissingRolloutStateError, match=r"resumes at step 20.*restore="):
        trainer.train(resume_from_checkpoint=str(folder))
    assert lp.session is None and trainer.args.max_grad_norm == 1.0   # nothing was started or changed
    assert not (folder / "lowprec").exists()


def _resume_refused(tmp, folder, match, **callback_kw):
    lp = LowprecCallback.from_yaml(tmp / "lowprec.yaml", tiny_llama(), **callback_kw)
    trainer = Trainer(model=lp.model, args=_args(folder.parent), train_dataset=shakespeare_blocks(8 * 40),
                      callbacks=[lp])
    with pytest.raises(ValueError, match=match):
        trainer.train(resume_from_checkpoint=str(folder))
    assert lp.session is None


def test_a_state_from_another_checkpoint_is_not_taken_for_this_one(runs, tmp_path):
    """The Trainer resumes from a folder it does not tell callbacks about; lowprec's state is
    checked to be that checkpoint's: the same Trainer step, the same weights."""
    tmp, _, _, saved = runs
    folder = tmp_path / "out" / f"checkpoint-{SAVE_AT}"
    shutil.copytree(saved, folder)
    # restore= naming the final checkpoint (step 30) while the Trainer resumes step 20
    _resume_refused(tmp, folder, r"state of Trainer step 30, and the Trainer resumes at step 20",
                    restore=tmp / "out" / f"checkpoint-{STEPS}")
    # the weights of step 20 changed under the state (another run's checkpoint-20 in its place)
    from safetensors.torch import load_file, save_file
    weights = load_file(folder / "model.safetensors")
    name = "model.layers.1.mlp.up_proj.weight"
    weights[name] = weights[name] * 1.01
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    _resume_refused(tmp, folder, rf"other weights than the ones the Trainer resumed \(1 parameter\(s\) differ, "
                                 rf"e.g. {name}\)")
