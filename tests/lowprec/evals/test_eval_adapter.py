"""The LM adapter against independent computations.

- A bigram "model" (logits depend on the current token only) makes a document's exact
  log-likelihood a plain sum over its tokens whatever the windows, so a token scored twice or
  missed shows up in the total.
- For a real (tiny, seeded) GPT, the reference is lm-eval's own rolling windows
  (`get_rolling_token_windows` + `make_disjoint_window`) scored the way lm-eval's HFLM does,
  with direct log_softmax sums; documents are longer than max_length.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from lm_eval import utils as lm_utils  # noqa: E402
from torch import nn  # noqa: E402

from lowprec.evals.adapter import LMAdapter, window_plan  # noqa: E402
from lowprec.evals.tokenizers import ByteTokenizer, HFTokenizer  # noqa: E402
from experiments.model import build_gpt  # noqa: E402

L = 16
TOK = ByteTokenizer()
DOCS = ["To be, or not to be, that is the question:\nWhether 'tis nobler in the mind to suffer",
        "short", "x", "Ünïcödé bytes: ſ þ ð — and more text to pass the window"]


def req(*args):
    return SimpleNamespace(args=args)


@pytest.fixture(scope="module")
def gpt():
    torch.manual_seed(0)
    return build_gpt(vocab_size=256, block_size=L, n_layer=1, n_head=2, d_model=16)


class Bigram(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.table = nn.Embedding(256, 256)
        nn.init.normal_(self.table.weight, std=3.0)

    def forward(self, x):
        return self.table(x)


def bigram_ll(model: Bigram, tokens: list[int]) -> float:
    logp = model.table.weight.detach().double().log_softmax(-1)
    return sum(float(logp[a, b]) for a, b in zip(tokens[:-1], tokens[1:]))


def hflm_reference(model, context: list[int], cont: list[int], max_length: int) -> tuple[float, bool]:
    """lm-eval HFLM's _loglikelihood_tokens for one request, with a direct log_softmax."""
    inp = (context + cont)[-(max_length + 1):][:-1]
    with torch.no_grad():
        logits = model(torch.tensor([inp]))[0, -len(cont):]
    logp = logits.double().log_softmax(-1)
    t = torch.tensor(cont)
    return float(logp.gather(-1, t[:, None]).sum()), bool((logp.argmax(-1) == t).all())


def rolling_reference(model, text: str, max_length: int, context_len: int) -> float:
    tokens = TOK.encode(text)
    windows = map(lm_utils.make_disjoint_window,
                  lm_utils.get_rolling_token_windows(tokens, TOK.prefix_token_id, max_length, context_len))
    return sum(hflm_reference(model, ctx, pred, max_length)[0] for ctx, pred in windows)


@pytest.mark.parametrize("n,first,max_length,context_len",
                         [(n, f, m, c) for n in (1, 2, 5, 16, 17, 40, 100) for f in (1, 3) for m in (1, 4, 16)
                          for c in (1, 2, 4) if c <= m])
def test_window_plan_scores_every_token_once(n, first, max_length, context_len):
    plan = window_plan(n, first, max_length, context_len)
    scored = [p for _, s, e in plan for p in range(s, e)]
    assert scored == list(range(first, n))
    for a, s, e in plan:
        assert 0 <= a < s and e - 1 - a <= max_length        # input tokens[a:e-1] fits the model


@pytest.mark.parametrize("context_len", [1, 5])
def test_rolling_is_the_exact_sum_for_a_bigram_model(context_len):
    model = Bigram()
    lm = LMAdapter(model, TOK, max_length=L, batch_size=3, rolling_context_len=context_len)
    got = lm.loglikelihood_rolling([req(d) for d in DOCS])
    want = [bigram_ll(model, [TOK.prefix_token_id] + TOK.encode(d)) for d in DOCS]
    assert len(TOK.encode(DOCS[0])) > 4 * L
    assert got == pytest.approx(want, rel=1e-5, abs=1e-4)


@pytest.mark.parametrize("context_len", [1, 7])
def test_rolling_matches_lm_eval_windows_on_a_gpt(gpt, context_len):
    lm = LMAdapter(gpt, TOK, max_length=L, batch_size=4, rolling_context_len=context_len)
    got = lm.loglikelihood_rolling([req(d) for d in DOCS])
    want = [rolling_reference(gpt, d, L, context_len) for d in DOCS]
    assert got == pytest.approx(want, rel=1e-5, abs=1e-4)


def test_loglikelihood_matches_direct_computation(gpt):
    pairs = [("The quick brown", " fox"), ("", "hello"), ("Ends in a space ", "word"),
             ("a much longer context than the sixteen-byte window of this model", " and a tail")]
    lm = LMAdapter(gpt, TOK, max_length=L, batch_size=2)
    got = lm.loglikelihood([req(c, x) for c, x in pairs])
    for (ctx, cont), (ll, greedy) in zip(pairs, got):
        c_tok, x_tok = lm.encode_pair(ctx, cont)
        if not ctx:
            assert c_tok == [TOK.prefix_token_id]          # empty context: the prefix token
        if ctx.endswith(" "):
            assert x_tok[0] == ord(" ")                    # trailing space moves to the continuation
        ref_ll, ref_greedy = hflm_reference(gpt, c_tok, x_tok, L)
        assert ll == pytest.approx(ref_ll, rel=1e-5, abs=1e-4)
        assert greedy == ref_greedy


def test_long_continuation_is_scored_whole():
    model = Bigram()
    lm = LMAdapter(model, TOK, max_length=L, batch_size=8)
    ctx, cont = "context ", "a continuation much longer than the sixteen-token window"
    (ll, _), = lm.loglikelihood([req(ctx, cont)])
    toks = TOK.encode(ctx + cont)
    want = bigram_ll(model, toks[len(TOK.encode(ctx.rstrip())) - 1:])
    assert ll == pytest.approx(want, rel=1e-5, abs=1e-4)


def test_is_greedy_flag():
    model = Bigram()
    logp = model.table.weight.detach().log_softmax(-1)
    best = int(logp[ord("a")].argmax())
    lm = LMAdapter(model, TOK, max_length=L)
    (_, g1), (_, g2) = lm.loglikelihood([req("a", TOK.decode([best])), req("a", TOK.decode([(best + 1) % 128]))])
    assert g1 is True and g2 is False


def test_eval_mode_no_grad_and_modes_restored(gpt):
    seen = []

    def forward(x):
        seen.append((torch.is_grad_enabled(), gpt.training))
        return gpt(x)

    gpt.train()
    gpt.blocks[0].mlp.eval()                 # a submodule deliberately in eval mode stays so
    lm = LMAdapter(forward, TOK, max_length=L, model=gpt)
    lm.loglikelihood_rolling([req(DOCS[0])])
    assert seen and all(s == (False, False) for s in seen)
    assert gpt.training and gpt.blocks[0].attn.training and not gpt.blocks[0].mlp.training
    gpt.eval()


def test_rejects_bad_arguments(gpt):
    with pytest.raises(ValueError, match="max_length"):
        LMAdapter(gpt, TOK, max_length=0)
    with pytest.raises(ValueError, match="rolling_context_len"):
        LMAdapter(gpt, TOK, max_length=8, rolling_context_len=9)
    with pytest.raises(TypeError, match="encode"):
        LMAdapter(gpt, object(), max_length=8)
    lm = LMAdapter(lambda x: torch.zeros(x.shape[0], 256), TOK, max_length=8)
    with pytest.raises(ValueError, match=r"\[B, T, V\]"):
        lm.loglikelihood_rolling([req("abc")])


class Cycle(nn.Module):
    """Next byte after c is the next character of CYCLE (a deterministic 'model')."""
    CYCLE = "abcde,"

    def forward(self, x):
        out = torch.full((*x.shape, 256), -10.0)
        for i, c in enumerate(self.CYCLE):
            out[x == ord(c), ord(self.CYCLE[(i + 1) % len(self.CYCLE)])] = 10.0
        return out


def test_generate_until_stops_at_a_stop_string():
    lm = LMAdapter(Cycle(), TOK, max_length=4)
    got = lm.generate_until([req("xa", {"until": [","], "max_gen_toks": 50}),
                             req("a", {"until": ["de", ","]}),
                             req("a", {"until": ["zzz"], "max_gen_toks": 8}),
                             req("a", {"until": ",", "do_sample": False})])
    assert got == ["bcde", "bc", "bcde,abc", "bcde"]
    with pytest.raises(ValueError, match="greedily"):
        lm.generate_until([req("a", {"until": [","], "do_sample": True})])


def test_generate_stops_at_eos():
    tok = ByteTokenizer()
    tok.eos_token_id = ord("d")              # instance attribute: this test's tokenizer only
    lm = LMAdapter(Cycle(), tok, max_length=4)
    assert lm.generate("a", {"until": [","]}) == "bc"
    assert ByteTokenizer().eos_token_id is None


def test_hf_tokenizer_wrapper():
    class Fake:                              # the parts of a Hugging Face tokenizer the wrapper uses
        bos_token_id, eos_token_id = None, 2

        def encode(self, text, add_special_tokens=True):
            return ([1] if add_special_tokens else []) + [ord(c) for c in text]

        def decode(self, ids):
            return "".join(chr(i) for i in ids)

    tok = HFTokenizer(Fake())
    assert tok.prefix_token_id == 2 and tok.eos_token_id == 2     # no BOS: EOS conditions the first token
    assert tok.encode("hi") == [104, 105] and tok.decode([104, 105]) == "hi"
    Fake.eos_token_id = None
    with pytest.raises(ValueError, match="neither a BOS nor an EOS"):
        HFTokenizer(Fake())


def test_a_long_scoring_pass_shows_its_progress_on_the_console(gpt, monkeypatch, capsys):
    """`make run`'s long evals left the progress line silent for minutes: a scoring pass longer
    than PROGRESS_EVERY_S writes progress lines, which the console shows on the terminal
    (other libraries' INFO lines stay in the log)."""
    import logging
    from lowprec.evals import adapter as adapter_mod
    from lowprec.runtime.trainer.console import Console
    monkeypatch.setattr(adapter_mod, "PROGRESS_EVERY_S", 0.0)   # every batch is "long" here
    lm = LMAdapter(gpt, ByteTokenizer(), max_length=L, batch_size=2)
    with Console("run"):
        logging.getLogger("lm_eval.evaluator").info("an lm-eval INFO line")
        lm.loglikelihood_rolling([req(t) for t in ("to be or not", "a horse, a horse", "my kingdom", "for a")])
    lines = capsys.readouterr().err.splitlines()
    said = [ln for ln in lines if ln.startswith("lowprec run: eval: ")]
    assert len(said) >= 2 and "windows scored" in said[0], lines
    assert said[-1].startswith("lowprec run: eval: ") and "(100%)" in said[-1]
    assert not any("an lm-eval INFO line" in ln for ln in lines)
