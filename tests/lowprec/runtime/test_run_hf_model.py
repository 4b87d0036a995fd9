"""`lowprec run` on a Hugging Face causal LM: the loop's `model(x, y)` reaches the model as
`input_ids=x, labels=...`, and the loss it trains on is the model's own loss of y.

A `LlamaForCausalLM` built from a config (random init, byte vocabulary, no hub download) by a
model factory beside the config; the data is Shakespeare bytes."""

from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("transformers")

from lowprec.cli import main  # noqa: E402
from lowprec.runtime.trainer.run import prepare_run  # noqa: E402
from lowprec.config import LowprecConfig  # noqa: E402

FACTORY = """\
import torch


def build():
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
"""
CONFIG = """\
model: {factory: "hfllama:build"}
data: {factory: "experiments.data:shakespeare_tokens", args: {max_bytes: 100000}, block_size: 32}
train: {steps: 8, batch_size: 8, lr: 3.0e-3, warmup: 2, ckpt_every: 100, seed: 0}
precision:
  backend: emulated
  keep_high_precision: [{fqns: [lm_head]}]
  rules:
    - {name: mlp, select: {glob: "*.mlp.*"}, format: fp8_tensorwise, ladder: [fp8_tensorwise, bf16]}
tracking: {enabled: false}
"""


@pytest.fixture
def hf_config(tmp_path, monkeypatch):
    from pathlib import Path
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[3]))   # experiments.data
    (tmp_path / "hfllama.py").write_text(FACTORY)
    (tmp_path / "run.yaml").write_text(CONFIG)
    return tmp_path / "run.yaml"


def test_the_loss_is_the_models_loss_of_the_targets(hf_config):
    prepared = prepare_run(LowprecConfig.from_yaml(hf_config))
    x, y = prepared.data.next()
    out = prepared.model(x, y)
    logits = prepared.model(input_ids=x).logits
    # HF shifts the labels itself: each row's last target is not counted
    want = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, 256).float(), y[:, :-1].reshape(-1))
    assert out.loss is not None and torch.allclose(out.loss, want, rtol=1e-6, atol=1e-6)


def test_lowprec_run_trains_a_hugging_face_causal_lm(hf_config, tmp_path, capsys):
    assert main(["run", str(hf_config), "--out", str(tmp_path / "out")]) == 0
    losses = json.loads((tmp_path / "out" / "losses.json").read_text())
    assert len(losses) == 8 and all(math.isfinite(v) for v in losses)
    assert abs(losses[0] - math.log(256)) < 0.5 and losses[-1] < losses[0]
