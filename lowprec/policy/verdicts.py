"""Gate verdicts, defined once: what an evaluation gate says and what the controller reads.

A gate (lowprec.gates, or any checker of a user's) compares a candidate's evals with a baseline's
and answers with an object that has a `verdict` and a one-sentence `reason`
(`GateOutcome`). The rollout controller reads only those two: `regress` rolls the newest
stage back, `pass` lets the next stage through, `inconclusive` holds it.

`Verdict` is a str-valued enum: `Verdict.PASS == "pass"`, and `str()`, f-strings and
JSON give the plain value, which is what events, MLflow tags and reports keep.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from lowprec.base.enums import StrEnum

__all__ = ["Verdict", "GateOutcome"]


class Verdict(StrEnum):
    """A gate's answer: the candidate is no worse than allowed, worse, or the data cannot tell."""

    PASS = "pass"
    REGRESS = "regress"
    INCONCLUSIVE = "inconclusive"


@runtime_checkable
class GateOutcome(Protocol):
    """What the controller reads from a gate's result (lowprec.gates.GateSummary is one)."""

    @property
    def verdict(self) -> Verdict: ...

    @property
    def reason(self) -> str: ...
