"""Evaluation documents built from local text: pure, deterministic functions.

Three kinds, each a list of JSON-ready dicts with a stable string `id`:

- rolling documents (`text`): a corpus cut at line boundaries into pieces of about
  `target_bytes` bytes, scored whole with loglikelihood_rolling (perplexity, bits per byte);
- cloze items (`context`, `target`): the last word of a line, predicted from the ~100 bytes
  before it (`target` is " word"), scored with loglikelihood like lm-eval's lambada;
- multiple-choice items (`query`, `choices`, `gold`): BIG-bench JSON tasks and HellaSwag,
  scored with lm-eval's multiple_choice (one loglikelihood per choice).

`shuffled` orders a task's documents with a fixed seed, so that the first N documents (what
lm-eval's `limit` takes) are a sample of every source, not the opening of the first one.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable
from pathlib import Path

_MANY_BLANK_LINES = re.compile(r"\n{3,}")
_LAST_WORD = re.compile(r"(?<=\S) ([A-Za-z]{3,})[.,;:!?]*$")


def _utf8_len(s: str) -> int:
    return len(s.encode("utf-8"))


def _split_long_line(line: str, target_bytes: int) -> list[str]:
    """A line longer than target_bytes, cut at spaces into pieces of at most about target_bytes."""
    pieces, current = [], ""
    for word in line.split(" "):
        candidate = f"{current} {word}" if current else word
        if current and _utf8_len(candidate) > target_bytes:
            pieces.append(current)
            current = word
        else:
            current = candidate
    if current:
        pieces.append(current)
    return pieces


def rolling_documents(source: str, text: str, target_bytes: int = 1000,
                      min_bytes: int = 200) -> list[dict]:
    """`text` cut at line boundaries into documents of at most about `target_bytes` bytes
    (runs of blank lines collapsed to one, surrounding blank lines stripped); pieces shorter
    than `min_bytes` (the tail of a text) are dropped. Ids are `source:NNNNN`."""
    if target_bytes < 2 * min_bytes:
        raise ValueError(f"target_bytes ({target_bytes}) must be at least twice min_bytes ({min_bytes})")
    text = _MANY_BLANK_LINES.sub("\n\n", text)
    docs: list[str] = []
    current: list[str] = []
    size = 0
    for line in text.split("\n"):
        line = line.rstrip()
        for piece in _split_long_line(line, target_bytes) if _utf8_len(line) > target_bytes else [line]:
            n = _utf8_len(piece) + 1
            if current and size + n > target_bytes:
                docs.append("\n".join(current))
                current, size = [], 0
            current.append(piece)
            size += n
    if current:
        docs.append("\n".join(current))
    docs = [d.strip("\n") for d in docs]
    return [{"id": f"{source}:{i:05d}", "text": d}
            for i, d in enumerate(d for d in docs if _utf8_len(d) >= min_bytes)]


def cloze_items(source: str, text: str, context_bytes: int = 100, min_context_bytes: int = 60,
                min_words: int = 5) -> list[dict]:
    """Last-word items: for a line of at least `min_words` words that ends in a word of three or
    more letters (trailing punctuation allowed), the context is the `context_bytes` bytes of text
    before " word" (started at a word boundary), the target is " word". Items never share text:
    a line is used only when its context starts after the previous item's word. Ids are
    `source:OFFSET`, the character offset of the target word in the cleaned text."""
    items: list[dict] = []
    offset, used_until = 0, 0
    for line in text.split("\n"):
        line_start, offset = offset, offset + len(line) + 1
        stripped = line.rstrip()
        m = _LAST_WORD.search(stripped)
        if m is None or len(stripped.split()) < min_words:
            continue
        word_at = line_start + m.start(1)             # the target word, after its space
        ctx_end = word_at - 1                          # the context stops before the space
        start = max(0, ctx_end - context_bytes)
        if start > 0:                                  # begin at a word boundary
            space = re.search(r"\s", text[start:ctx_end])
            if space is None:
                continue
            start += space.end()
        if start < used_until:
            continue
        context = text[start:ctx_end]
        if _utf8_len(context) < min_context_bytes:
            continue
        items.append({"id": f"{source}:{word_at}", "context": context, "target": " " + m.group(1)})
        used_until = word_at + len(m.group(1))
    return items


def bigbench_items(path: Path) -> list[dict]:
    """A BIG-bench JSON task's examples as multiple-choice items, prompted the way BIG-bench
    formats a zero-shot example: task_prefix + example_input_prefix ("\\nQ: ") + input, the
    choices appended ("\\n  choice: ...") when append_choices_to_input (default true), then
    example_output_prefix ("\\nA: "), surrounding whitespace stripped. Choices are the keys of
    target_scores in file order, surrounding whitespace stripped (some end in a space); gold is
    the first key with the highest score. Ids are
    `<task>:NNNNN`, the example's index in the file."""
    task = json.loads(path.read_text(encoding="utf-8"))
    name = path.stem
    prefix = task.get("task_prefix") or ""
    in_prefix = task.get("example_input_prefix", "\nQ: ")
    out_prefix = task.get("example_output_prefix", "\nA: ")
    choice_prefix = task.get("choice_prefix", "\n  choice: ")
    append = task.get("append_choices_to_input", True)
    items = []
    for i, ex in enumerate(task["examples"]):
        scores = ex.get("target_scores")
        if not scores:
            raise ValueError(f"{path}: example {i} has no target_scores; only multiple-choice "
                             f"BIG-bench tasks (examples[].target_scores) can be used")
        choices = list(scores)
        gold = max(range(len(choices)), key=lambda k: (scores[choices[k]], -k))
        listed = "".join(choice_prefix + c for c in choices) if append else ""
        query = (prefix + in_prefix + ex["input"] + listed + out_prefix).strip()
        items.append({"id": f"{name}:{i:05d}", "query": query, "choices": [c.strip() for c in choices],
                      "gold": gold})
    return items


def _hellaswag_clean(text: str) -> str:
    """lm-eval's HellaSwag preprocessing: WikiHow `[title]` markers and bracketed artefacts out."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub(r"\[.*?\]", "", text)
    return text.replace("  ", " ")


def hellaswag_items(path: Path) -> list[dict]:
    """HellaSwag items as lm-eval's hellaswag task builds them (query = activity label + ": " +
    context, endings as choices, both cleaned the same way); this file has the joined `ctx`,
    so ctx_b is not capitalised as lm-eval does from the separate fields. Ids are
    `hellaswag:NNNNN`, the line index in the file."""
    items = []
    with path.open(encoding="utf-8") as f:
        for i, line in enumerate(f):
            if not line.strip():
                continue
            d = json.loads(line)
            items.append({"id": f"hellaswag:{i:05d}",
                          "query": _hellaswag_clean(d["activity_label"] + ": " + d["ctx"]),
                          "choices": [_hellaswag_clean(e) for e in d["endings"]],
                          "gold": int(d["label"])})
    return items


def shuffled(docs: Iterable[dict], seed: str, max_docs: int | None = None) -> list[dict]:
    """The documents in a fixed pseudo-random order (seeded by a string), at most max_docs of
    them; raises if two documents share an id."""
    docs = list(docs)
    ids = [d["id"] for d in docs]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})[:5]
        raise ValueError(f"document ids must be unique; repeated: {dup}")
    random.Random(seed).shuffle(docs)
    return docs if max_docs is None else docs[:max_docs]
