"""Tokenizers the LM adapter accepts: bytes for the reference GPT, a wrapper for Hugging Face.

The adapter needs `encode(str) -> list[int]`, `decode(list[int]) -> str`, `prefix_token_id`
(the token a document's first token is conditioned on, and the context of an empty
context) and `eos_token_id` (a token that ends a generation, or None).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable


@runtime_checkable
class Tokenizer(Protocol):
    prefix_token_id: int
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, tokens: Sequence[int]) -> str: ...


class ByteTokenizer:
    """UTF-8 bytes as tokens (vocabulary 256), what experiments/model.py's GPT is trained on.

    There is no end-of-text token among 256 byte values, so the prefix token is the newline
    byte (10): the eval documents begin at line boundaries, which is what follows a newline
    in the training text. Decoding replaces an incomplete UTF-8 sequence with U+FFFD."""

    vocab_size = 256
    prefix_token_id = 10
    eos_token_id: int | None = None

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, tokens: Sequence[int]) -> str:
        return bytes(int(t) for t in tokens).decode("utf-8", errors="replace")

    def __repr__(self) -> str:
        return "ByteTokenizer()"


class HFTokenizer:
    """A Hugging Face tokenizer seen through the adapter's interface: no special tokens added
    by `encode`; the prefix token is BOS where the tokenizer has one, else EOS (lm-eval's
    convention); generation stops at EOS."""

    def __init__(self, tokenizer: Any):
        eos, bos = getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "bos_token_id", None)
        prefix = bos if bos is not None else eos
        if prefix is None:
            raise ValueError(f"{type(tokenizer).__name__} has neither a BOS nor an EOS token id; the "
                             f"adapter needs one to condition a document's first token on. Pass a "
                             f"tokenizer with eos_token_id set")
        self.tokenizer, self.prefix_token_id, self.eos_token_id = tokenizer, int(prefix), eos

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, tokens: Sequence[int]) -> str:
        return self.tokenizer.decode(list(tokens))

    def __repr__(self) -> str:
        return f"HFTokenizer({type(self.tokenizer).__name__}, prefix={self.prefix_token_id})"
