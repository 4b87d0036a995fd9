"""What is evaluated: suites of lm-eval tasks over shipped or given data, and the LM adapter that runs them.

    from lowprec.evals import ByteTokenizer, run_suite
    result = run_suite("default", model, ByteTokenizer(), max_length=128, mode="fast")
    tracker.log_eval(step, result.results, samples=result.samples)

Importing this package is light (no lm-eval, no datasets): `LMAdapter` (which subclasses
lm-eval's LM) is imported on first use, and `run_suite` imports lm-eval when it runs.
The suites' texts are package data, `lowprec.evals.texts` (the repository's top-level
`eval_suites/texts/` folder). No other layer imports this package: the runtime finds
`runtime.LMEvalEvaluator` through an entry point (pyproject.toml).

May import: lowprec.runtime, lowprec.base.
"""

from __future__ import annotations

from typing import Any

from lowprec.evals.corpora import DataUnavailable
from lowprec.evals.suite import SUITES, EvalResult, EvalSuite, get_suite, run_suite
from lowprec.evals.tasks import TASKS, TaskSpec, build_docs, default_cache_dir, get_task, prepare_tasks
from lowprec.evals.tokenizers import ByteTokenizer, HFTokenizer, Tokenizer

__all__ = ["SUITES", "TASKS", "ByteTokenizer", "DataUnavailable", "EvalResult", "EvalSuite", "HFTokenizer",
           "LMAdapter", "TaskSpec", "Tokenizer", "build_docs", "default_cache_dir", "get_suite", "get_task",
           "prepare_tasks", "run_suite"]


def __getattr__(name: str) -> Any:
    if name == "LMAdapter":
        from lowprec.evals.adapter import LMAdapter
        return LMAdapter
    raise AttributeError(f"module 'lowprec.evals' has no attribute {name!r}")
