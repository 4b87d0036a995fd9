"""Evaluation checkpoints in the training loop, behind two small protocols.

The runtime does not know what is evaluated or how a verdict is reached. It takes:

* an `Evaluator`: `evaluate(mode) -> EvalOutcome` (per task: metrics; per example:
  scores, for paired statistics) and the `tasks` it produces; optionally
  `use_forward(forward)`, which `lowprec run` calls under pipeline stages with the pipeline's
  logits function (no rank holds the whole model's forward there; an evaluator without it
  is refused under `parallel: {pp: N}`);
* a `GateChecker`: `check(baseline, candidate) -> GateOutcome` (a `Verdict` and a
  reason) and the `metrics` it gates (`eval/<task>/<metric>`).

Implementations are found by name through Python entry points, so the runtime never imports
them: the group `lowprec.evaluators` (`eval.evaluator` in a config; lowprec declares `lm_eval`,
lowprec.evals.runtime) and `lowprec.gate_checkers` (`default`: the gate files of
lowprec.gates.inloop). Each entry point is a class; `check_config(eval_config)`, when
it has one, validates a config before step 0.

`EvalCheckpoints` runs them: every `eval.every` steps, before every stage promotion (the
controller's `gate(step)`) and at the end; the model as it is and, where any layer runs
below high precision, the same weights under `state.high_precision()` (`eval_hp/...`);
the in-loop gate compares the two, so the cost of precision is measured directly. Under
torchrun (`share`) every rank runs the same evals, since a sharded model's forwards are
collective; the rank that has the results logs and gates and its outcome goes to every rank.
Whether any layer runs below high precision (so an `eval_hp` pass runs) is read from
`formats()`, by default the state's; under pipeline stages the run hands the whole model's
record (`lowprec.sites.precision_state.StagedPrecisionMap.formats`), so every rank runs the
same passes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Protocol

__all__ = ["EvalOutcome", "Evaluator", "GateChecker", "EvalCheckpoints", "load_entry_point", "eval_checkpoints"]

EVALUATORS, GATE_CHECKERS = "lowprec.evaluators", "lowprec.gate_checkers"


@dataclass
class EvalOutcome:
    results: dict[str, dict[str, float]]             # task -> metric -> value
    samples: dict[str, Any] = field(default_factory=dict)   # task -> per-example scores
    seconds: float = 0.0


class Evaluator(Protocol):
    tasks: tuple[str, ...]

    def evaluate(self, mode: str) -> EvalOutcome: ...


class GateChecker(Protocol):
    metrics: tuple[str, ...]

    def check(self, baseline: EvalOutcome, candidate: EvalOutcome) -> Any: ...


def load_entry_point(group: str, name: str):
    """The object an installed package declares as `name` in entry point group `group`."""
    found = {ep.name: ep for ep in entry_points(group=group)}
    if name not in found:
        from lowprec.base.parse import suggest
        have = ", ".join(sorted(found)) or "none are installed"
        raise LookupError(f"no {group} entry point named {name!r}.{suggest(name, list(found))} Installed: {have}. "
                          f"A package provides one in its pyproject.toml under "
                          f"[project.entry-points.\"{group}\"]")
    return found[name].load()


class _NoGate:
    verdict = "pass"
    reason = "no in-loop gate file configured"


class EvalCheckpoints:
    """The periodic, pre-promotion and end-of-run evals of one training run."""

    def __init__(self, config, evaluator: Evaluator, checker: GateChecker | None, state, *, tracker=None,
                 share=None):
        self.config, self.evaluator, self.checker, self.state, self.tracker = config, evaluator, checker, state, tracker
        # under torchrun: rank 0's (outcome, results, results_hp) handed to every rank (None: one process)
        self.share = share
        self.formats = state.formats   # fqn -> format name of every site (see the module docstring)
        for metric in checker.metrics if checker is not None else ():
            parts = metric.split("/")
            if len(parts) != 3 or parts[0] != "eval" or parts[1] not in evaluator.tasks:
                raise ValueError(f"eval.gates gates {metric!r}, which the evaluator does not produce (its tasks: "
                                 f"{', '.join(evaluator.tasks)}); gate on eval/<task>/<metric> of those tasks")
        self.history: list[dict] = []   # one entry per eval: step, mode, verdict, results, results_hp
        self.last: EvalOutcome | None = None

    def state_dict(self) -> dict:
        """The gate checker's state (its checks made so far: its error budget), when it keeps one."""
        keeps = callable(getattr(self.checker, "state_dict", None))
        return {"checker": self.checker.state_dict() if keeps else None}

    def load_state_dict(self, saved: dict) -> None:
        if saved.get("checker") is not None and callable(getattr(self.checker, "load_state_dict", None)):
            self.checker.load_state_dict(saved["checker"])

    def due(self, step: int) -> bool:
        return self.config.every > 0 and step > 0 and step % self.config.every == 0

    def _measure(self, mode: str) -> tuple[EvalOutcome | None, EvalOutcome | None]:
        """(the model as it is, the same weights in high precision or None). Under torchrun every
        rank runs both (the forwards are collective); an evaluator returns None where its
        results are not (lm-eval: any rank but local rank 0)."""
        current = self.evaluator.evaluate(mode)
        from lowprec.numerics.formats import get_format
        low = any(not get_format(name).is_high_precision for name in self.formats().values())
        hp = None
        if self.config.high_precision:
            if low:
                with self.state.high_precision():
                    hp = self.evaluator.evaluate(mode)
            else:
                hp = current   # every layer is in high precision already: the same numbers
        return current, hp

    def evaluate(self, step: int, mode: str | None = None):
        """Evaluate now (and in high precision where that differs), log, gate; returns the
        in-loop gate's outcome (None without a gate). Under torchrun the rank with the results
        logs and gates, and `share` hands its outcome to every rank, so every controller decides alike."""
        mode = mode or self.config.mode
        self.state.collect_stats(False)   # evals feed no quantizer statistics (the session turns them back on)
        current, hp = self._measure(mode)
        if self.tracker is not None and current is not None:
            kind = dict(mode=mode, suite=getattr(self.config, "suite", None))   # the gate compares only evals of one kind
            self.tracker.log_eval(step, current.results, samples=current.samples, prefix="eval", **kind)
            if hp is not None:
                self.tracker.log_eval(step, hp.results, samples=hp.samples, prefix="eval_hp", **kind)
            seconds = current.seconds + (hp.seconds if hp is not None and hp is not current else 0.0)
            self.tracker.log_metrics(step, {"time/eval_seconds": seconds})
        outcome = None
        if self.checker is not None and hp is not None and current is not None:
            outcome = self.checker.check(hp, current)
        seconds = current.seconds if current is not None else 0.0
        results, results_hp = (current.results if current is not None else None,
                               hp.results if hp is not None else None)
        if self.share is not None:
            outcome, results, results_hp = self.share((outcome, results, results_hp))
            current = current if current is not None else EvalOutcome(results)
        self.last = current
        verdict = getattr(outcome, "verdict", None)
        self.history.append({"step": step, "mode": mode, "verdict": None if verdict is None else str(
            getattr(verdict, "value", verdict)), "reason": getattr(outcome, "reason", ""),
            "results": results, "results_hp": results_hp, "seconds": seconds})
        return outcome

    def gate(self, step: int):
        """The controller's `gate(step)`: evaluate now and say whether precision costs too much."""
        outcome = self.evaluate(step)
        return _NoGate() if outcome is None else outcome

    def final(self, step: int):
        return self.evaluate(step, self.config.final_mode)


def eval_checkpoints(config, model, state, *, max_length: int, tracker=None, **evaluator_kwargs) -> EvalCheckpoints:
    """The `eval:` section's checkpoints for `model`: its evaluator and the default gate
    checker found through their entry points and checked (the gate's metrics must be ones the
    evaluator produces here). `evaluator_kwargs` (e.g. `forward=`, `tokenizer=`) go to the
    evaluator. Every problem is a ConfigError at `eval`."""
    from lowprec.base.parse import ConfigError
    try:
        ev_cls = load_entry_point(EVALUATORS, config.evaluator)
        if hasattr(ev_cls, "check_config"):
            ev_cls.check_config(config)
        evaluator = ev_cls(config, model, max_length=max_length, **evaluator_kwargs)
        checker = load_entry_point(GATE_CHECKERS, "default")(config.gates) if config.gates else None
        return EvalCheckpoints(config, evaluator, checker, state, tracker=tracker)
    except ConfigError:
        raise
    except (LookupError, ValueError, KeyError, FileNotFoundError) as e:
        raise ConfigError("eval", str(e).strip("'\"")) from None
