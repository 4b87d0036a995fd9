"""The `lm_eval` evaluator of lowprec's training runtime (entry point `lowprec.evaluators`).

`lowprec run` finds it by the config's `eval.evaluator: lm_eval` and never imports this
package itself. It runs an eval suite (`eval.suite`) with lm-eval over local data on the
model being trained, in the fast subset or the full set, and returns per-task metrics and
per-example scores (`lowprec.runtime.session.evals.EvalOutcome`). The tasks' files are prepared when
it is built, before step 0: an opt-in task whose data is not in `eval.data_dir` is an error
then (DataUnavailable, which lowprec reports as a config error at `eval`), never a warning.
"""

from __future__ import annotations

import copy

from lowprec.base.parse import ConfigError
from lowprec.runtime.session.evals import EvalOutcome

from lowprec.evals.corpora import DataUnavailable
from lowprec.evals.suite import get_suite, run_suite
from lowprec.evals.tasks import prepare_tasks
from lowprec.evals.tokenizers import ByteTokenizer

__all__ = ["LMEvalEvaluator"]


class LMEvalEvaluator:
    """lm-eval tasks of one suite on a byte-level (or given) tokenizer."""

    def __init__(self, config, model, *, max_length: int, tokenizer=None, forward=None):
        self.check_config(config)
        self.config, self.model = config, model
        self.max_length = max_length
        self.tokenizer = tokenizer or ByteTokenizer()
        self.forward = forward or model
        suite = get_suite(config.suite)
        self.data_dir = getattr(config, "data_dir", None)
        try:
            prepared = prepare_tasks(suite.tasks, data_dir=self.data_dir)
        except DataUnavailable as e:
            raise DataUnavailable(f"eval.suite {config.suite!r}: {e} as eval.data_dir") from None
        self.tasks = tuple(prepared.ready)

    def with_forward(self, forward) -> "LMEvalEvaluator":
        """The same evaluator (its prepared tasks) scoring through `forward` (LongTensor[B, T] ->
        logits): under pipeline stages, `lowprec run` asks for one with the Pipeline engine's
        forward through every stage."""
        other = copy.copy(self)
        other.forward = forward
        return other

    @staticmethod
    def task_names(config) -> tuple[str, ...]:
        """The tasks of the config's suite, by name (before any task is prepared)."""
        return get_suite(config.suite).tasks

    @staticmethod
    def check_config(config) -> None:
        try:
            get_suite(config.suite)
        except KeyError as e:
            raise ConfigError("eval.suite", str(e.args[0])) from None

    def evaluate(self, mode: str) -> EvalOutcome | None:
        """This process's outcome; None on a torchrun rank other than local rank 0 (lm-eval's results
        are there only), which runs the same forwards."""
        r = run_suite(self.config.suite, self.forward, self.tokenizer, self.max_length, mode=mode,
                      batch_size=self.config.batch_size, model=self.model, data_dir=self.data_dir,
                      limit=getattr(self.config, "limit", None))
        return None if r is None else EvalOutcome(r.results, r.samples, r.seconds)
