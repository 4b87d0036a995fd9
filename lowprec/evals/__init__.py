"""What is evaluated: suites of lm-eval tasks over shipped or given data, and the LM adapter that runs them.

    from eval_suites import ByteTokenizer, run_suite
    result = run_suite("default", model, ByteTokenizer(), max_length=128, mode="fast")
    tracker.log_eval(step, result.results, samples=result.samples)

Importing this package is light (no lm-eval, no datasets): `LMAdapter` (which subclasses
lm-eval's LM) is imported on first use, and `run_suite` imports lm-eval when it runs.
Imports flow experiments -> eval_suites -> lowprec; nothing here imports experiments or gates.
"""

from __future__ import annotations

from typing import Any

from eval_suites.corpora import DataUnavailable
from eval_suites.suite import SUITES, EvalResult, EvalSuite, get_suite, run_suite
from eval_suites.tasks import TASKS, TaskSpec, build_docs, default_cache_dir, get_task, prepare_tasks
from eval_suites.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = ["SUITES", "TASKS", "ByteTokenizer", "DataUnavailable", "EvalResult", "EvalSuite", "HFTokenizer",
           "LMAdapter", "TaskSpec", "Tokenizer", "build_docs", "default_cache_dir", "get_suite", "get_task",
           "prepare_tasks", "run_suite"]


def __getattr__(name: str) -> Any:
    if name == "LMAdapter":
        from eval_suites.adapter import LMAdapter
        return LMAdapter
    raise AttributeError(f"module 'eval_suites' has no attribute {name!r}")
