"""An lm-eval `LM` around the model being trained: a logits function and a tokenizer.

`LMAdapter(forward, tokenizer, max_length)` scores text with any causal LM given as
`forward(LongTensor[B, T]) -> FloatTensor[B, T, V]` (logits; an object with `.logits`, as
Hugging Face models return, is accepted too), T <= max_length. It implements lm-eval's three
request types:

- `loglikelihood(context, continuation)`: (sum of log-probs of the continuation's tokens,
  whether greedy decoding would produce every one of them). The pair is tokenized as lm-eval's
  HFLM does: trailing spaces of the context move to the continuation, the whole string is
  encoded and the context's tokens split off. An empty context is the prefix token.
- `loglikelihood_rolling(text)`: the log-prob of the whole text, conditioned on the tokenizer's
  prefix token (`prefix_token_id`; a newline for `ByteTokenizer`, BOS/EOS for a Hugging Face
  tokenizer). Token windows: the first window predicts the first `max_length` tokens from the
  prefix; each later window predicts the next `max_length - rolling_context_len + 1` tokens
  and is filled on the left with the tokens before them up to `max_length` in all, so every
  token is scored exactly once. `rolling_context_len=1` gives lm-eval's HFLM windows exactly.
- `generate_until(context, {"until": [...], "max_gen_toks": N})`: greedy decoding, one token at
  a time over the last `max_length` tokens, until a stop string (cut off), the tokenizer's EOS
  or max_gen_toks tokens.

Long inputs are cut the same way for loglikelihood (a continuation longer than max_length is
scored in several windows). Windows of equal length are batched (never padded, so a
quantized model's scaling never sees padding); batches are formed in a fixed order, so the
same requests give the same numbers. Everything runs under `torch.no_grad()` with the model
in eval mode; each module's training flag is restored afterwards. The adapter keeps only what
it is given: no global state.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from itertools import groupby

import torch
from lm_eval.api.model import LM
from torch import nn

from lowprec.evals.tokenizers import Tokenizer
from lowprec.runtime.trainer.console import PROGRESS_LOG

PROGRESS_EVERY_S = 10.0   # a scoring pass longer than this says how far it is, as the steps do


class _Ticker:
    """Progress lines of one scoring pass (`lowprec.progress`, which `lowprec run`'s console
    shows on the terminal): one every PROGRESS_EVERY_S seconds, and a last one if any was said."""

    def __init__(self, total: int):
        self.total, self.t0, self.said = total, time.monotonic(), False
        self.next = self.t0 + PROGRESS_EVERY_S

    def tick(self, done: int) -> None:
        now = time.monotonic()
        if now < self.next and not (self.said and done >= self.total):
            return
        self.next, self.said = now + PROGRESS_EVERY_S, True
        rate = done / max(now - self.t0, 1e-9)
        eta = f", ETA {int((self.total - done) / rate // 60)}:{int((self.total - done) / rate % 60):02d}" \
            if 0 < done < self.total else ""
        logging.getLogger(PROGRESS_LOG).info(
            f"eval: {done:,}/{self.total:,} windows scored ({done / max(self.total, 1):.0%}), {rate:,.1f} windows/s{eta}")

Forward = Callable[[torch.Tensor], torch.Tensor]


def _module_of(forward: Forward, model: nn.Module | None) -> nn.Module | None:
    if model is not None:
        return model
    if isinstance(forward, nn.Module):
        return forward
    owner = getattr(forward, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


@contextlib.contextmanager
def evaluating(module: nn.Module | None) -> Iterator[None]:
    """no_grad with `module` in eval mode; every submodule's training flag restored after."""
    modes = [(m, m.training) for m in module.modules()] if module is not None else []
    if module is not None:
        module.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        for m, training in modes:
            m.training = training


def window_plan(n_tokens: int, first_target: int, max_length: int, context_len: int = 1
                ) -> list[tuple[int, int, int]]:
    """Windows (a, s, e) that score tokens first_target..n_tokens-1 of a sequence exactly once:
    input tokens[a:e-1] (at most max_length), predicting tokens[s:e] from its last e-s positions.
    The first window predicts up to max_length tokens, later ones up to max_length-context_len+1."""
    if not 1 <= context_len <= max_length:
        raise ValueError(f"context_len must be in 1..max_length ({max_length}), got {context_len}")
    if first_target < 1:
        raise ValueError("the first scored token needs a token before it (first_target >= 1)")
    plan, s, piece = [], first_target, max_length
    while s < n_tokens:
        e = min(n_tokens, s + piece)
        plan.append((max(0, e - 1 - max_length), s, e))
        s, piece = e, max_length - context_len + 1
    return plan


class LMAdapter(LM):
    """lm-eval's LM interface over a logits function; see the module docstring for conventions."""

    def __init__(self, forward: Forward, tokenizer: Tokenizer, max_length: int, batch_size: int = 32,
                 device: str | torch.device = "cpu", model: nn.Module | None = None,
                 rolling_context_len: int = 1, max_gen_toks: int = 256):
        super().__init__()
        for name, value in (("max_length", max_length), ("batch_size", batch_size), ("max_gen_toks", max_gen_toks)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not 1 <= rolling_context_len <= max_length:
            raise ValueError(f"rolling_context_len must be in 1..max_length ({max_length}), got {rolling_context_len}")
        missing = [a for a in ("encode", "decode", "prefix_token_id") if not hasattr(tokenizer, a)]
        if missing:
            raise TypeError(f"tokenizer {tokenizer!r} lacks {missing}; it needs encode(str)->list[int], "
                            f"decode(list[int])->str and prefix_token_id (e.g. lowprec.evals.ByteTokenizer)")
        self.forward, self.tokenizer, self.max_length = forward, tokenizer, max_length
        self.batch_size, self.rolling_context_len, self.max_gen_toks = batch_size, rolling_context_len, max_gen_toks
        self.module = _module_of(forward, model)
        self._device = torch.device(device)

    # -- scoring -------------------------------------------------------------------------
    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        out = self.forward(x)
        logits = getattr(out, "logits", out)
        if not (isinstance(logits, torch.Tensor) and logits.dim() == 3 and logits.shape[:2] == x.shape):
            got = tuple(logits.shape) if isinstance(logits, torch.Tensor) else type(logits).__name__
            raise ValueError(f"forward must return logits of shape [B, T, V] = [{x.shape[0]}, {x.shape[1]}, V] "
                             f"for input [B, T]; got {got}")
        return logits

    def score(self, sequences: Sequence[tuple[Sequence[int], int]]) -> list[tuple[float, bool]]:
        """For each (tokens, first_target): (sum of log-probs of tokens[first_target:], all greedy)."""
        windows = []  # (request, input tokens, target tokens)
        for r, (tokens, first) in enumerate(sequences):
            tokens = list(tokens)
            for a, s, e in window_plan(len(tokens), first, self.max_length, self.rolling_context_len):
                windows.append((r, tokens[a:e - 1], tokens[s:e]))
        # equal input lengths share a forward; within a batch, equal target counts share the maths
        order = sorted(range(len(windows)), key=lambda i: (len(windows[i][1]), len(windows[i][2]), i))
        sums: list[torch.Tensor] = []
        greedy: list[torch.Tensor] = []
        owners: list[int] = []
        ticker, done = _Ticker(len(windows)), 0
        with evaluating(self.module):
            for _, same_length in groupby(order, key=lambda i: len(windows[i][1])):
                same_length = list(same_length)
                for b in range(0, len(same_length), self.batch_size):
                    rows = same_length[b:b + self.batch_size]
                    x = torch.tensor([windows[i][1] for i in rows], dtype=torch.long, device=self._device)
                    logits = self._logits(x)
                    start = 0
                    for k, same_k in groupby(rows, key=lambda i: len(windows[i][2])):
                        n = len(list(same_k))
                        t = torch.tensor([windows[i][2] for i in rows[start:start + n]], dtype=torch.long,
                                         device=logits.device)
                        logp = logits[start:start + n, -k:].float().log_softmax(-1)
                        sums.append(logp.gather(-1, t[..., None]).squeeze(-1).sum(-1))
                        greedy.append((logp.argmax(-1) == t).all(-1))
                        owners.extend(windows[i][0] for i in rows[start:start + n])
                        start += n
                    done += len(rows)
                    ticker.tick(done)
        out = [[0.0, True] for _ in sequences]
        if owners:
            for r, v, g in zip(owners, torch.cat(sums).tolist(), torch.cat(greedy).tolist()):
                out[r][0] += v
                out[r][1] = out[r][1] and bool(g)
        return [(float(v), bool(g)) for v, g in out]

    def encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """(context tokens, continuation tokens) as lm-eval's HFLM splits them."""
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        if not context:
            return [self.tokenizer.prefix_token_id], list(self.tokenizer.encode(continuation))
        whole = list(self.tokenizer.encode(context + continuation))
        ctx = list(self.tokenizer.encode(context))
        return ctx, whole[len(ctx):]

    # -- lm-eval's interface ----------------------------------------------------------------
    def loglikelihood(self, requests) -> list[tuple[float, bool]]:
        seqs = []
        for req in requests:
            ctx, cont = self.encode_pair(*req.args[:2])
            seqs.append((ctx + cont, len(ctx)))
        return self.score(seqs)

    def loglikelihood_rolling(self, requests) -> list[float]:
        seqs = [([self.tokenizer.prefix_token_id] + list(self.tokenizer.encode(req.args[0])), 1) for req in requests]
        return [ll for ll, _ in self.score(seqs)]

    def generate_until(self, requests) -> list[str]:
        return [self.generate(req.args[0], req.args[1] if len(req.args) > 1 else None) for req in requests]

    def generate(self, context: str, gen_kwargs: dict | None = None) -> str:
        """Greedy continuation of context until a stop string (cut off), EOS or max_gen_toks tokens."""
        kwargs = dict(gen_kwargs or {})
        until = kwargs.get("until") or []
        until = [s for s in ([until] if isinstance(until, str) else until) if s]
        max_new = int(kwargs.get("max_gen_toks", self.max_gen_toks))
        if kwargs.get("do_sample") or float(kwargs.get("temperature", 0.0) or 0.0) > 0:
            raise ValueError(f"LMAdapter decodes greedily only; got do_sample={kwargs.get('do_sample')!r}, "
                             f"temperature={kwargs.get('temperature')!r}. Use do_sample=False / temperature=0")
        tokens = list(self.tokenizer.encode(context)) or [self.tokenizer.prefix_token_id]
        eos = getattr(self.tokenizer, "eos_token_id", None)
        new: list[int] = []
        with evaluating(self.module):
            for _ in range(max_new):
                x = torch.tensor([(tokens + new)[-self.max_length:]], dtype=torch.long, device=self._device)
                nxt = int(self._logits(x)[0, -1].argmax())
                if eos is not None and nxt == eos:
                    break
                new.append(nxt)
                if until and any(stop in self.tokenizer.decode(new) for stop in until):
                    break
        text = self.tokenizer.decode(new)
        for stop in until:
            if stop and stop in text:
                text = text[:text.index(stop)]
        return text
