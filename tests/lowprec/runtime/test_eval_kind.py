"""EvalCheckpoints tells the tracker which kind of eval it logs (mode, suite), for `lowprec gate`."""

from __future__ import annotations

import contextlib
from types import SimpleNamespace

from lowprec.runtime.session.evals import EvalCheckpoints, EvalOutcome


class _Evaluator:
    tasks = ("t",)

    def evaluate(self, mode):
        return EvalOutcome({"t": {"acc": 0.5}})


class _State:

    def formats(self):
        return {"a": "fp8_tensorwise"}

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


class _Absent(_Evaluator):
    """lm-eval on a torchrun rank other than local rank 0: the forwards ran, the results are elsewhere."""

    def __init__(self):
        self.calls = 0

    def evaluate(self, mode):
        self.calls += 1
        return None


def test_a_rank_without_results_takes_the_shared_outcome_and_logs_nothing():
    cfg = SimpleNamespace(every=5, mode="fast", final_mode="fast", high_precision=True, suite="mini")
    lead = SimpleNamespace(verdict="fail", reason="too costly")
    sent = []

    def share(payload):   # rank 0's payload replaces this rank's
        sent.append(payload)
        return lead, {"t": {"acc": 0.25}}, {"t": {"acc": 0.5}}

    tracker, evaluator = _Tracker(), _Absent()
    ev = EvalCheckpoints(cfg, evaluator, None, _State(), tracker=tracker, share=share)
    assert ev.gate(5) is lead
    assert evaluator.calls == 2   # the model as it is and in high precision: the same forwards as rank 0's
    assert sent == [(None, None, None)] and tracker.calls == []
    assert ev.last.results == {"t": {"acc": 0.25}}
    assert ev.history[-1]["verdict"] == "fail" and ev.history[-1]["results_hp"] == {"t": {"acc": 0.5}}
