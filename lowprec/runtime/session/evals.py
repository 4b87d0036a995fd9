"""Evaluation checkpoints in the training loop, behind two small protocols.

The runtime does not know what is evaluated or how a verdict is reached. It takes:

* an `Evaluator`: `evaluate(mode) -> EvalOutcome` (per task: metrics; per example:
  scores, for paired statistics) and the `tasks` it produces; optionally
  `with_forward(forward)`, the same evaluator scoring through `forward` (a new object), which
  `lowprec run` asks for under pipeline stages with the pipeline's logits function (no rank
  holds the whole model's forward there; an evaluator without it is refused under
  `parallel: {pp: N}`);
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
the in-loop gate compares the two, so the cost of precision is measured directly. That
comparison cannot see damage already in the weights (both passes share it), so each
checkpoint also compares its own numbers with the run's previous checkpoint and, where
`rollout.baseline` names an MLflow run with evals, with the baseline's at the same step
(`lowprec.runtime.session.eval_damage`): a non-finite or exploded metric fails the checkpoint
(verdict `regress`, whatever the gate said), which holds a promotion and, at a periodic eval,
takes the controller's rollback path. Under
torchrun (`share`) every rank runs the same evals, since a sharded model's forwards are
collective; the rank that has the results logs and gates and its outcome goes to every rank.
Whether any layer runs below high precision (so an `eval_hp` pass runs) is read from
`formats()`, by default the state's; under pipeline stages the run hands the whole model's
record (`lowprec.sites.precision_state.StagedPrecisionMap.formats`), so every rank runs the
same passes.

Everything is given at construction: `lowprec run` checks the `eval:` section before step 0
(`eval_checkpoints`, no tracker yet) and builds the run's checkpoints from the checked ones
with `for_run(tracker=, share=, formats=, forward=)` once the tracker and the engine exist.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from importlib.metadata import entry_points
from typing import Any, Callable, Protocol

from lowprec.runtime.session.eval_damage import DEFAULT_RATIO, DamageVerdict, damage

__all__ = ["EvalOutcome", "Evaluator", "GateChecker", "EvalCheckpoints", "load_entry_point", "eval_checkpoints",
           "eval_config_errors", "check_limit"]

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


def check_gated_tasks(metrics, tasks, config) -> None:
    """A ConfigError at `eval.gates` where the gate file gates a metric the suite's `tasks` do not
    produce, with the fix: a suite that has the task, or a gate file without it, or no gate."""
    from lowprec.base.parse import ConfigError
    for metric in metrics:
        parts = metric.split("/")
        if len(parts) != 3 or parts[0] != "eval" or parts[1] not in tasks:
            raise ConfigError("eval.gates", (
                f"{config.gates!r} gates {metric!r}, which suite {config.suite!r} does not produce (its tasks: "
                f"{', '.join(tasks)}). Fix: a suite with that task (eval.suite: default has the shipped ones), a "
                f"gate file that gates eval/<task>/<metric> of {config.suite!r}'s tasks (eval.gates: PATH), or "
                f"eval.gates: null for no in-loop gate"))


def check_limit(samples_needed: dict[str, int], config) -> None:
    """A ConfigError at `eval.limit` where it caps a task below what a deciding gate of the in-loop
    gate file needs (`min_samples`): every check would be inconclusive there."""
    from lowprec.base.parse import ConfigError
    limit = getattr(config, "limit", None)
    short = {t: n for t, n in samples_needed.items() if limit is not None and limit < n}
    if short:
        task, need = max(short.items(), key=lambda kv: kv[1])
        raise ConfigError("eval.limit", (
            f"{limit} documents per task is below what in-loop gate {config.gates!r} needs for {task} "
            f"(min_samples {need}): every check would be inconclusive. Fix: eval.limit: {need} or more, "
            f"null (each eval's own set), or a gate file with a lower min_samples"))


def _plain(obj):
    """`obj` as plain data a checkpoint loads with `weights_only=True` (lm-eval's numbers may be numpy's)."""
    if isinstance(obj, dict):
        return {str(k): _plain(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_plain(v) for v in obj]
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    try:
        return float(obj)
    except (TypeError, ValueError):
        return str(obj)


class _NoGate:
    verdict = "pass"
    reason = "no in-loop gate file configured"


class EvalCheckpoints:
    """The periodic, pre-promotion and end-of-run evals of one training run."""

    def __init__(self, config, evaluator: Evaluator, checker: GateChecker | None, state, *, tracker=None,
                 share=None, formats=None, baseline: Callable[[int, str], dict | None] | None = None,
                 damage_ratio: float = DEFAULT_RATIO):
        """`baseline(step, mode)`: the baseline run's results at that step (None: it has none there)."""
        self.config, self.evaluator, self.checker, self.state, self.tracker = config, evaluator, checker, state, tracker
        self.baseline, self.damage_ratio = baseline, damage_ratio
        # under torchrun: rank 0's (outcome, results, results_hp) handed to every rank (None: one process)
        self.share = share
        # () -> fqn -> format name of every site: the state's, or the whole model's (module docstring)
        self.formats = formats or state.formats
        if checker is not None:
            check_gated_tasks(checker.metrics, evaluator.tasks, config)
            check_limit(getattr(checker, "samples_needed", {}), config)
        self.history: list[dict] = []   # one entry per eval: step, mode, verdict, results, results_hp
        self.last: EvalOutcome | None = None

    def for_run(self, *, tracker=None, share=None, formats=None, forward=None) -> "EvalCheckpoints":
        """New checkpoints with this one's checked evaluator and gate, for a run: tracked by
        `tracker`, outcomes handed to every rank by `share`, passes decided on `formats()`,
        scored through `forward` (an evaluator's `with_forward`) when given."""
        evaluator = self.evaluator if forward is None else self.evaluator.with_forward(forward)
        return EvalCheckpoints(self.config, evaluator, self.checker, self.state, tracker=tracker, share=share,
                               formats=formats, baseline=self.baseline, damage_ratio=self.damage_ratio)

    def state_dict(self) -> dict:
        """The gate checker's state (its checks made so far: its error budget), when it keeps one,
        and the evals so far (`history`: the damage check's previous checkpoint, the pictures),
        as plain data."""
        keeps = callable(getattr(self.checker, "state_dict", None))
        return {"checker": self.checker.state_dict() if keeps else None, "history": _plain(self.history)}

    def load_state_dict(self, saved: dict) -> None:
        if saved.get("checker") is not None and callable(getattr(self.checker, "load_state_dict", None)):
            self.checker.load_state_dict(saved["checker"])
        self.history = [dict(h) for h in saved.get("history", ())]   # absent before resumes carried it
        done = [h for h in self.history if h.get("results") is not None]
        self.last = EvalOutcome(done[-1]["results"]) if done else None

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
        problems = self._damage(step, mode, current)
        if problems:
            outcome = DamageVerdict(tuple(problems), outcome)
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
            "results": results, "results_hp": results_hp, "seconds": seconds, "damage": problems})
        return outcome

    def _damage(self, step: int, mode: str, current: EvalOutcome | None) -> list[str]:
        """What this checkpoint's results show against the previous checkpoint of its mode (the
        last undamaged one) and the baseline run's at this step (`lowprec.runtime.session.eval_damage`)."""
        if current is None:   # a rank without results: the outcome comes from the rank that has them
            return []
        refs = []
        prev = next((h for h in reversed(self.history) if h["mode"] == mode and not h.get("damage")
                     and h["results"] is not None and h["step"] < step), None)
        if prev is not None:
            refs.append((f"the previous checkpoint (step {prev['step']})", prev["results"]))
        base = self.baseline(step, mode) if self.baseline is not None else None
        if base:
            refs.append((f"the baseline run at step {step}", base))
        return damage(current.results, refs, self.damage_ratio)

    def gate(self, step: int):
        """The controller's `gate(step)`: evaluate now and say whether precision costs too much."""
        outcome = self.evaluate(step)
        return _NoGate() if outcome is None else outcome

    def final(self, step: int):
        return self.evaluate(step, self.config.final_mode)


def eval_checkpoints(config, model, state, *, max_length: int, tracker=None, share=None, formats=None, baseline=None,
                     **evaluator_kwargs) -> EvalCheckpoints:
    """The `eval:` section's checkpoints for `model`: its evaluator and the default gate
    checker found through their entry points and checked (the gate's metrics must be ones the
    evaluator produces here). `baseline(step, mode)`: the baseline run's evals
    (`lowprec.runtime.session.baseline.baseline_evals`). `evaluator_kwargs` (e.g. `forward=`,
    `tokenizer=`) go to the evaluator. Every problem is a ConfigError at `eval`."""
    with eval_config_errors():
        ev_cls = load_entry_point(EVALUATORS, config.evaluator)
        if hasattr(ev_cls, "check_config"):
            ev_cls.check_config(config)
        evaluator = ev_cls(config, model, max_length=max_length, **evaluator_kwargs)
        checker = load_entry_point(GATE_CHECKERS, "default")(config.gates) if config.gates else None
        return EvalCheckpoints(config, evaluator, checker, state, tracker=tracker, share=share, formats=formats,
                               baseline=baseline)


@contextlib.contextmanager
def eval_config_errors():
    """Every problem inside (an evaluator's, a gate file's, an unknown entry point) as a ConfigError
    at `eval`: a gate file's error keeps its file, gate and key under `eval`."""
    from lowprec.base.parse import ConfigError
    try:
        yield
    except ConfigError as e:
        if e.path.startswith("eval"):
            raise
        raise ConfigError("eval", str(e)) from None
    except (LookupError, ValueError, KeyError, FileNotFoundError) as e:
        raise ConfigError("eval", str(e).strip("'\"")) from None
