"""A small Llama (random init, byte vocabulary) and real text for the framework integration tests."""

from __future__ import annotations

import torch

from experiments.data import split_texts   # the local copy of the corpus where present, else the sdist
from lowprec.evals.corpora import clean_text

BLOCK = 64

CONFIG = """\
precision:
  backend: emulated
  default: bf16
  keep_high_precision: [{fqns: [lm_head]}]
  rules:
    - {name: all, select: {module_type: Linear}, format: bf16, ladder: [fp8_tensorwise, bf16]}
rollout:
  check_every: 5
  min_steps: 10
  rewind: {enabled: true, skip_batches: 0, snapshot_every: 5, keep: 4}
  stages:
    - {name: mlp_fp8, select: {glob: "*.mlp.*"}, format: fp8_tensorwise}
    - {name: attn_fp8, select: {glob: "*.self_attn.*"}, format: fp8_tensorwise}
tracking: {experiment: hf-integration}
"""

# the same model all in BF16 (a baseline run), and an lm-eval suite run once, at the end
BF16_CONFIG = """\
precision:
  backend: emulated
  default: bf16
  keep_high_precision: [{fqns: [lm_head]}]
  rules:
    - {name: all, select: {module_type: Linear}, format: bf16}
"""
# the gate tests' runs: the gate reads their numbers; the report pictures are tested elsewhere
NO_PICTURES = "tracking: {report: false}\n"
FINAL_EVAL = "eval: {suite: default, every: 0, mode: fast, final_mode: fast, gates: null, high_precision: false, limit: 8}\n"


def gate_table(forks, baseline: str, candidate: str, uri: str, out) -> str:
    """`lowprec gate` between two runs with the in-loop gate file, forked from `forks` (the session's
    `lowprec_forks`); its markdown table (asserting a verdict)."""
    from pathlib import Path
    gates = Path(__file__).resolve().parents[3] / "gates" / "inloop.yaml"
    p = forks.run(["gate", "--baseline", baseline, "--candidate", candidate, "--gates", str(gates),
                   "--tracking-uri", uri, "--markdown", str(out)], Path(out).parent, timeout=300)
    assert p.returncode in (0, 1), p.stdout + p.stderr   # a verdict (pass or regression), not unusable input
    return Path(out).read_text()


def tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=BLOCK,
                      tie_word_embeddings=False)
    return LlamaForCausalLM(cfg)


def shakespeare_blocks(n: int, block: int = BLOCK, offset: int = 0) -> list[dict[str, torch.Tensor]]:
    """`n` examples of `block` bytes of the Shakespeare training plays: input_ids = labels."""
    text = clean_text(split_texts()[0][0].read_bytes()).encode("utf-8")
    data = torch.frombuffer(bytearray(text[offset: offset + n * block]), dtype=torch.uint8).long()
    return [{"input_ids": x, "labels": x.clone()} for x in data.view(n, block)]


def optimizer_state(opt: torch.optim.Optimizer) -> dict:
    """A deep copy of the optimizer's per-parameter state (moments, step counts)."""
    return {i: {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in s.items()}
            for i, s in enumerate(opt.state.values())}


def same_state(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys() and all(torch.equal(a[i][k], b[i][k]) if isinstance(a[i][k], torch.Tensor)
                                           else a[i][k] == b[i][k] for k in a[i]) for i in a)


def lowprec_now(callback) -> dict:
    """What a resumed run must get back of a lowprec callback: each layer's format, lowprec's
    step, its events and its losses."""
    return {"formats": callback.state.formats(), "step": callback.step,
            "events": [e.to_json() for e in callback.session.events], "losses": list(callback.hosted.losses)}


def assert_same_progress(got: dict, want: dict) -> None:
    """Two `lowprec_now` records agree; losses bit for bit, the NaN of a skipped step included."""
    assert got["formats"] == want["formats"]
    assert got["step"] == want["step"]
    assert got["events"] == want["events"]
    a, b = got["losses"], want["losses"]
    assert len(a) == len(b) and all(x == y or (x != x and y != y) for x, y in zip(a, b)), (a, b)
