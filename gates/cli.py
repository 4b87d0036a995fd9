"""`lowprec gate`: compare a candidate run with a baseline run stored in MLflow, gate by gate.

    lowprec gate --baseline RUN --candidate RUN --gates FILE [--tracking-uri URI] [--step N]
                 [--markdown FILE] [--junit FILE] [--inconclusive {pass,fail}]

The arguments are declared in lowprec.cli (so that `lowprec --help` stays fast); this module
does the work when the command runs: it reads the gate file (gates.spec), each run's eval
metrics and per-example scores (gates.runs), checks every gate (gates.gate), prints the table,
appends Markdown to `--markdown` (append, so `$GITHUB_STEP_SUMMARY` keeps what other steps
wrote) and writes JUnit XML to `--junit`.

Exit status: 0 every gate passes (inconclusive ones too, unless `--inconclusive fail`),
1 a gate regressed (or was inconclusive under `--inconclusive fail`), 2 the input cannot be
used (a bad gate file, a missing run or metric, a store that does not answer) - the message on
stderr, no traceback.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from gates.errors import GateInputError, GateSpecError
from gates.gate import GateSummary, check_all, summarize
from gates.report import junit_xml, markdown, table
from gates.runs import load_scores, open_client
from gates.spec import GateSpec

from lowprec.cli_tracking import default_tracking_uri
from lowprec.verdicts import Verdict

__all__ = ["GateArgs", "run", "main", "EXIT_PASS", "EXIT_REGRESS", "EXIT_UNUSABLE"]

EXIT_PASS, EXIT_REGRESS, EXIT_UNUSABLE = 0, 1, 2


@dataclass(frozen=True)
class GateArgs:
    """The command's arguments (argparse's Namespace has the same fields)."""

    baseline: str
    candidate: str
    gates: str
    tracking_uri: str | None = None
    step: int | None = None
    markdown: str | None = None
    junit: str | None = None
    inconclusive: str = "pass"

    @classmethod
    def from_namespace(cls, ns) -> "GateArgs":
        return cls(**{f: getattr(ns, f) for f in cls.__dataclass_fields__})


def evaluate(args: GateArgs) -> tuple[GateSummary, str, str]:
    """Gate file + both runs -> the summary and how each run is described (GateSpecError or
    GateInputError when the input cannot be used)."""
    spec = GateSpec.from_yaml(args.gates)  # first: a bad file fails before MLflow is even imported
    if args.step is not None and args.step < 0:
        raise GateInputError(f"--step must be >= 0, got {args.step}")
    uri = args.tracking_uri or default_tracking_uri()
    client = open_client(uri)
    base = load_scores(uri, args.baseline, metrics=spec.metrics, step=args.step, client=client)
    cand = load_scores(uri, args.candidate, metrics=spec.metrics, step=args.step, client=client)
    return summarize(check_all(spec, base, cand)), base.source, cand.source


def run(args: GateArgs, out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    """The whole command; returns the exit status."""
    if args.inconclusive not in ("pass", "fail"):
        print(f"lowprec gate: --inconclusive must be pass or fail, got {args.inconclusive!r}", file=err)
        return EXIT_UNUSABLE
    try:
        summary, base, cand = evaluate(args)
    except (GateSpecError, GateInputError) as e:
        print(f"lowprec gate: {e}", file=err)
        return EXIT_UNUSABLE
    print(f"baseline:  {base}\ncandidate: {cand}\n", file=out)
    print(table(summary.results), file=out)
    print(f"\nlowprec gate: {summary.verdict.value.upper()}: {summary.reason}", file=out)
    fail_inconclusive = args.inconclusive == "fail"
    try:
        if args.markdown:
            with open(args.markdown, "a") as f:
                f.write(markdown(summary, base, cand))
        if args.junit:
            Path(args.junit).write_text(junit_xml(summary, base, cand, inconclusive_fails=fail_inconclusive))
    except OSError as e:
        print(f"lowprec gate: cannot write the report: {e}", file=err)
        return EXIT_UNUSABLE
    if summary.verdict is Verdict.REGRESS or (summary.verdict is Verdict.INCONCLUSIVE and fail_inconclusive):
        return EXIT_REGRESS
    assert summary.verdict in (Verdict.PASS, Verdict.INCONCLUSIVE)
    return EXIT_PASS


def main(ns) -> int:
    """Entry from lowprec.cli's `gate` handler (an argparse Namespace)."""
    return run(GateArgs.from_namespace(ns))
