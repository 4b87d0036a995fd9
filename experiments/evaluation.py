"""Evaluation checkpoints in a training loop: run a suite, log it, and gate on it.

    eval:
      suite: default            # an eval_suites suite (held-out Shakespeare, cloze, shift texts)
      every: 100                # steps between periodic evals (0: only before promotions and at the end)
      mode: fast                # in-loop subset; the end-of-run eval uses final_mode
      final_mode: full
      high_precision: true      # also evaluate the same weights in high precision (eval_hp/...)
      gates: gates/inloop.yaml  # the in-loop gate: current precision vs the same weights in high precision

An `EvalCheckpoints` evaluates the model as it is, and, where any layer runs below high
precision, the same weights under `state.high_precision()`: the difference is the cost of
precision, measured directly, example by example. Both go to the tracker (`eval/...` and
`eval_hp/...`, with per-example scores). The in-loop gate compares the two with the gate file:
the controller calls `gate(step)` before each stage promotion, and the training loop hands a
periodic checkpoint's verdict to `RolloutSession.after_eval` (a regression rolls the newest
stage back). The end-of-run eval (`final`) is what `lowprec gate` compares between runs.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

from eval_suites import ByteTokenizer, EvalResult, get_suite, run_suite
from gates import GateSpec, Scores, check_all, summarize
from gates.gate import GateSummary
from lowprec.verdicts import Verdict

ROOT = Path(__file__).resolve().parents[1]


class EvalConfigError(ValueError):
    pass


@dataclass(frozen=True)
class EvalConfig:
    suite: str = "default"
    every: int = 100
    mode: str = "fast"
    final_mode: str = "full"
    high_precision: bool = True
    gates: str | None = "gates/inloop.yaml"
    batch_size: int = 32

    def __post_init__(self) -> None:
        where = "eval:"
        try:
            get_suite(self.suite)
        except KeyError as e:
            raise EvalConfigError(f"{where} suite: {e.args[0]}") from None
        for name in ("mode", "final_mode"):
            if getattr(self, name) not in ("fast", "full"):
                raise EvalConfigError(f"{where} {name} is {getattr(self, name)!r}; allowed: fast, full")
        if not isinstance(self.every, int) or self.every < 0:
            raise EvalConfigError(f"{where} every is {self.every!r}; give a step count >= 0 (0: no periodic evals)")
        if self.gates is not None and not self.gate_path.is_file():
            raise EvalConfigError(f"{where} gates file {self.gates!r} not found (looked at {self.gate_path}); "
                                  f"give a gate file path (see docs/gates.md) or null for no in-loop gate")

    @property
    def gate_path(self) -> Path:
        p = Path(self.gates)
        return p if p.is_absolute() else ROOT / p

    @classmethod
    def from_dict(cls, d: dict | None) -> "EvalConfig":
        d = dict(d or {})
        allowed = [f.name for f in fields(cls)]
        unknown = [k for k in d if k not in allowed]
        if unknown:
            raise EvalConfigError(f"eval: unknown key(s) {unknown}; allowed: {', '.join(allowed)}")
        return cls(**d)


class EvalCheckpoints:
    """The periodic and end-of-run evals of one training run (see the module docstring)."""

    def __init__(self, config: EvalConfig, model, state, *, max_length: int, tracker=None,
                 tokenizer=None, forward=None):
        self.config = config
        self.model, self.state, self.tracker = model, state, tracker
        self.max_length = max_length
        self.tokenizer = tokenizer or ByteTokenizer()
        self.forward = forward or model
        self.spec = GateSpec.from_yaml(config.gate_path) if config.gates else None
        tasks = get_suite(config.suite).tasks
        for metric in self.spec.metrics if self.spec else ():
            parts = metric.split("/")
            if len(parts) != 3 or parts[0] != "eval" or parts[1] not in tasks:
                raise EvalConfigError(f"eval: the gate file {config.gates} gates {metric!r}, which suite "
                                      f"{config.suite!r} does not produce (its tasks: {', '.join(tasks)}); "
                                      f"gate on eval/<task>/<metric> of those tasks or pick a suite that has it")
        self.history: list[dict] = []     # one entry per eval: step, mode, verdict, results, results_hp
        self.last: EvalResult | None = None

    def due(self, step: int) -> bool:
        return self.config.every > 0 and step > 0 and step % self.config.every == 0

    def _run(self, mode: str) -> EvalResult:
        return run_suite(self.config.suite, self.forward, self.tokenizer, self.max_length, mode=mode,
                         batch_size=self.config.batch_size, model=self.model)

    def evaluate(self, step: int, mode: str | None = None) -> GateSummary | None:
        """Evaluate now (and in high precision where that differs), log, gate; returns the
        in-loop gate's summary (None without a gate file)."""
        mode = mode or self.config.mode
        self.state.collect_stats(False)   # evals feed no quantizer statistics; before_step turns them back on
        current = self._run(mode)
        self.last = current
        low = any(not self.state.site(f).format.is_high_precision for f in self.state.formats())
        hp = None
        if self.config.high_precision:
            if low:
                with self.state.high_precision():
                    hp = self._run(mode)
            else:
                hp = current   # every layer is in high precision already: the same numbers
        if self.tracker is not None:
            self.tracker.log_eval(step, current.results, samples=current.samples, prefix="eval")
            if hp is not None:
                self.tracker.log_eval(step, hp.results, samples=hp.samples, prefix="eval_hp")
            self.tracker.log_metrics(step, {"eval/seconds": current.seconds + (hp.seconds if hp is not current
                                                                                and hp is not None else 0.0)})
        summary = None
        if self.spec is not None and hp is not None:
            summary = summarize(check_all(self.spec, Scores.from_eval(hp.results, hp.samples, source="high precision"),
                                          Scores.from_eval(current.results, current.samples, source="as trained")))
        self.history.append({"step": step, "mode": mode, "verdict": summary.verdict.value if summary else None,
                             "reason": summary.reason if summary else "", "results": current.results,
                             "results_hp": hp.results if hp is not None else None,
                             "seconds": current.seconds})
        return summary

    def gate(self, step: int) -> GateSummary:
        """The controller's `gate(step)`: evaluate now and say whether precision costs too much."""
        summary = self.evaluate(step)
        if summary is None:
            return GateSummary(Verdict.PASS, "no in-loop gate file configured", ())
        return summary

    def final(self, step: int) -> GateSummary | None:
        return self.evaluate(step, self.config.final_mode)
