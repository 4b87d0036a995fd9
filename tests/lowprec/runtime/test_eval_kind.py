"""EvalCheckpoints tells the tracker which kind of eval it logs (mode, suite), for `lowprec gate`."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

from lowprec.runtime.evals import EvalCheckpoints, EvalOutcome


class _Evaluator:
    tasks = ("t",)

    def evaluate(self, mode):
        return EvalOutcome({"t": {"acc": 0.5}})


class _State:
    sites = {"a": SimpleNamespace(format=SimpleNamespace(is_high_precision=False))}

    def collect_stats(self, on):
        pass

    @contextlib.contextmanager
    def high_precision(self):
        yield


class _Tracker:
    def __init__(self):
        self.calls = []

    def log_eval(self, step, results, samples=None, prefix="eval", **kind):
        self.calls.append((step, prefix, kind))

    def log_metrics(self, step, metrics):
        pass


def test_in_loop_and_final_evals_are_logged_with_their_mode_and_suite():
    cfg = SimpleNamespace(every=5, mode="fast", final_mode="full", high_precision=True, suite="mini")
    tracker = _Tracker()
    ev = EvalCheckpoints(cfg, _Evaluator(), None, _State(), tracker=tracker)
    ev.evaluate(5)
    ev.final(10)
    assert tracker.calls == [(5, "eval", {"mode": "fast", "suite": "mini"}), (5, "eval_hp", {"mode": "fast", "suite": "mini"}),
                             (10, "eval", {"mode": "full", "suite": "mini"}), (10, "eval_hp", {"mode": "full", "suite": "mini"})]
