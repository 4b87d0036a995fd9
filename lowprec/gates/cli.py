"""`lowprec gate`: compare a candidate run with a baseline run stored in MLflow, gate by gate.

    lowprec gate --baseline RUN [RUN ...] --candidate RUN --gates NAME|FILE [--tracking-uri URI] [--step final|N]
                 [--markdown FILE] [--junit FILE] [--inconclusive {pass,fail}] [--timeout S] [--power]

One baseline: the paired comparison of lowprec.gates.gate. Several (run ids, or one name that several
finished runs carry, e.g. one config at several seeds): seed-aware, lowprec.gates.gate.check_spread asks
whether the candidate lies outside the baselines' seed spread. A gate whose metric cannot move
(at its floor or ceiling: no candidate could regress by more than allowed) is refused (exit 2)
unless the gate file marks it `informational: true`. `--power` prints, per gate, the smallest
regression detected with 80% probability (lowprec.gates.power), also in the Markdown and the JUnit.

`register(subparsers)` adds the command to `lowprec`'s parser: pyproject.toml declares it in
the entry point group `lowprec.commands` (`gate = "lowprec.gates.cli:register"`), which lowprec.cli
reads, so the core never imports lowprec.gates. When the command runs, this module reads the gate file (lowprec.gates.spec), each run's eval
metrics and per-example scores (lowprec.gates.runs), checks every gate (lowprec.gates.gate), prints the table,
appends Markdown to `--markdown` (append, so `$GITHUB_STEP_SUMMARY` keeps what other steps
wrote) and writes JUnit XML to `--junit`.

Exit status: 0 every gate passes (inconclusive ones too, unless `--inconclusive fail`),
1 a gate regressed (or was inconclusive under `--inconclusive fail`), 2 the input cannot be
used (a bad gate file, a missing run or metric, a store that does not answer within --timeout,
60 s by default, a run that did not finish or evals of different modes without --step, evals
of different suites, a --step N that one run has no evals at, a --markdown/--junit path that
cannot be written, checked before any run is read) - the message on stderr, no traceback.
Without --step (`--step final`) each run's final evals are compared, at whatever step each
ended; a refusal suggests only a --step both runs can be read at.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from lowprec.gates.errors import GateInputError, GateSpecError, spec_error
from lowprec.gates.gate import GateSummary, check_all, check_spread, summarize
from lowprec.gates.report import junit_xml, markdown, power_table, table
from lowprec.gates.runs import check_comparable, check_named_step, load_scores, open_client, resolve_runs
from lowprec.gates.spec import GateSpec, gate_names

from lowprec.tracking.cli import default_tracking_uri
from lowprec.tracking.deadline import DEFAULT_TIMEOUT_S, Deadline, NoAnswer
from lowprec.policy.verdicts import Verdict

__all__ = ["GateArgs", "register", "run", "main", "EXIT_PASS", "EXIT_REGRESS", "EXIT_UNUSABLE"]

EXIT_PASS, EXIT_REGRESS, EXIT_UNUSABLE = 0, 1, 2
FINAL = "final"   # --step final: each run's final evals


@dataclass(frozen=True)
class GateArgs:
    """The command's arguments (argparse's Namespace has the same fields)."""

    baseline: str | tuple[str, ...]   # one run, or several (a seed-aware baseline)
    candidate: str
    gates: str
    tracking_uri: str | None = None
    step: int | str | None = None        # None or "final": each run's final evals
    markdown: str | None = None
    junit: str | None = None
    inconclusive: str = "pass"
    timeout: float = DEFAULT_TIMEOUT_S   # seconds for every read from the tracking store together
    power: bool = False                  # print each gate's detectable regression (80% power)

    @classmethod
    def from_namespace(cls, ns) -> "GateArgs":
        kw = {f: getattr(ns, f) for f in cls.__dataclass_fields__ if hasattr(ns, f)}
        if isinstance(kw.get("baseline"), list):
            kw["baseline"] = kw["baseline"][0] if len(kw["baseline"]) == 1 else tuple(kw["baseline"])
        return cls(**kw)


def evaluate(args: GateArgs) -> tuple[GateSummary, str, str]:
    """Gate file + both runs -> the summary and how each run is described (GateSpecError or
    GateInputError when the input cannot be used)."""
    spec = GateSpec.from_yaml(args.gates)  # first: a bad file fails before MLflow is even imported
    step = parse_step(args.step)
    uri = args.tracking_uri or default_tracking_uri()
    try:
        dl = Deadline(args.timeout, f"the tracking store {uri}")
    except ValueError as e:
        raise GateInputError(str(e)) from None
    import mlflow.tracking  # noqa: F401 - imported here, not in the time given to the store
    client = dl.run("opening it (listing experiments)", open_client, uri)
    refs = [args.baseline] if isinstance(args.baseline, str) else list(args.baseline)
    ids = dl.run(f"finding the baseline run(s) {' '.join(refs)}", resolve_runs, client, uri, refs)
    def read(step_: int | None):
        bases_ = [dl.run(f"reading the baseline run {rid}", load_scores, uri, rid, metrics=spec.metrics, step=step_,
                         client=client) for rid in ids]
        return bases_, dl.run(f"reading the candidate run {args.candidate}", load_scores, uri, args.candidate,
                              metrics=spec.metrics, step=step_, client=client)
    bases, cand = read(None)   # each run's final evals, and the steps it has
    if step is not None:
        for base in bases:
            check_named_step(base, cand, step)
        bases, cand = read(step)
    for base in bases:
        check_comparable(base, cand, step_named=step is not None)
    refuse_immovable(spec, bases)
    if len(bases) == 1:
        results = [g.with_power(r) for g, r in zip(spec.gates, check_all(spec, bases[0], cand))]
        source = bases[0].source
    else:
        results = [check_spread(g, bases, cand) for g in spec.gates]
        source = f"{len(bases)} baselines (seed spread): " + "; ".join(b.source for b in bases)
    return summarize(results), source, cand.source


def parse_step(step: int | str | None) -> int | None:
    """`--step`: `final` (or None, the default): each run's final evals; N >= 0: the evals at step N."""
    if step is None or step == FINAL:
        return None
    try:
        n = int(step)
    except (TypeError, ValueError):
        raise GateInputError(f"--step must be {FINAL} or a step number >= 0, got {step!r}") from None
    if n < 0:
        raise GateInputError(f"--step must be {FINAL} or a step number >= 0, got {n}")
    return n


def refuse_immovable(spec: GateSpec, bases) -> None:
    """GateSpecError naming every gate that cannot fire on these baselines (its metric at a floor
    or ceiling) and is not marked informational."""
    problems = []
    for i, g in enumerate(spec.gates):
        if g.informational:
            continue
        values = [b.get(g.metric).value for b in bases]
        why = g.cannot_fire(sum(values) / len(values))
        if why:
            problems.append(f"gates[{i}] ({g.metric}): {why}")
    if problems:
        raise spec_error("refusing a gate that cannot fail: " + "; ".join(problems) + ". A check that cannot "
                            "fail proves nothing. Fix: remove the gate, mark it `informational: true` (reported, "
                            "never fails), or gate a metric this model can move (a larger model, an easier task)",
                            source=spec.source)


def output_problem(path: str) -> str | None:
    """Why `path` cannot be written (or appended to), or None; creates nothing."""
    p = Path(path)
    if p.is_dir():
        return "is a folder, not a file"
    if p.exists():
        return None if os.access(p, os.W_OK) else "exists and is not writable"
    parent = p.parent
    if not parent.is_dir():
        return f"its folder {parent} does not exist"
    return None if os.access(parent, os.W_OK | os.X_OK) else f"its folder {parent} is not writable"


def run(args: GateArgs, out: TextIO | None = None, err: TextIO | None = None) -> int:
    """The whole command; returns the exit status. `out`/`err` default to sys.stdout/sys.stderr
    as they are at the call (not at import: this module is loaded whenever `lowprec` builds its
    parser, possibly while a caller has redirected them)."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    if args.inconclusive not in ("pass", "fail"):
        print(f"lowprec gate: --inconclusive must be pass or fail, got {args.inconclusive!r}", file=err)
        return EXIT_UNUSABLE
    for flag, path in (("--markdown", args.markdown), ("--junit", args.junit)):
        problem = output_problem(path) if path else None
        if problem:   # before any run is read: a long evaluation never ends in a write that cannot happen
            print(f"lowprec gate: {flag} {path}: {problem}; nothing was read or written. Pass a file in a "
                  f"folder that exists and that you can write to", file=err)
            return EXIT_UNUSABLE
    try:
        summary, base, cand = evaluate(args)
    except (GateSpecError, GateInputError, NoAnswer) as e:
        print(f"lowprec gate: {e}", file=err)
        return EXIT_UNUSABLE
    print(f"baseline:  {base}\ncandidate: {cand}\n", file=out)
    print(table(summary.results), file=out)
    if args.power:
        print("\n" + power_table(summary.results), file=out)
    print(f"\nlowprec gate: {summary.verdict.value.upper()}: {summary.reason}", file=out)
    fail_inconclusive = args.inconclusive == "fail"
    try:
        if args.markdown:
            with open(args.markdown, "a") as f:
                f.write(markdown(summary, base, cand, power=args.power))
        if args.junit:
            Path(args.junit).write_text(junit_xml(summary, base, cand, inconclusive_fails=fail_inconclusive,
                                                  power=args.power))
    except OSError as e:
        print(f"lowprec gate: cannot write the report: {e}", file=err)
        return EXIT_UNUSABLE
    if summary.verdict is Verdict.REGRESS or (summary.verdict is Verdict.INCONCLUSIVE and fail_inconclusive):
        return EXIT_REGRESS
    assert summary.verdict in (Verdict.PASS, Verdict.INCONCLUSIVE)
    return EXIT_PASS


def main(ns) -> int:
    """The `gate` command's handler: an argparse Namespace with GateArgs' fields."""
    return run(GateArgs.from_namespace(ns))


def register(sub) -> None:
    """Add `gate` to lowprec's subparsers (the `lowprec.commands` entry point)."""
    p = sub.add_parser("gate", help="compare a candidate run with a baseline run, gate by gate (exit 0 pass, "
                       "1 regression, 2 unusable input)",
                       description="Compare a candidate run's eval metrics with a baseline run's, stored in "
                       "MLflow, against the gates of a gate file (see docs/gates.md). Exit status: 0 pass, "
                       "1 regression, 2 unusable input.")
    p.add_argument("--baseline", required=True, nargs="+", metavar="RUN",
                   help="baseline MLflow run id (or unique run name); several run ids, or a name several finished "
                   "runs carry, gate against their seed spread")
    p.add_argument("--candidate", required=True, metavar="RUN", help="candidate MLflow run id (or unique run name)")
    p.add_argument("--gates", required=True, metavar="NAME|FILE",
                   help=f"a gate file that ships with lowprec, by name ({', '.join(gate_names())}), or the path "
                   f"of a gate file (YAML) of your own; see docs/gates.md")
    p.add_argument("--tracking-uri", default=None, metavar="URI",
                   help="MLflow tracking URI (default: sqlite:///<current directory>/mlflow.db)")
    p.add_argument("--step", default=FINAL, metavar="final|N",
                   help="final (the default): compare each run's final evals (its last step at which every gated "
                   "metric was evaluated); N: the evals at step N, which both runs must have")
    p.add_argument("--markdown", default=None, metavar="FILE",
                   help="append a Markdown summary to FILE (e.g. \"$GITHUB_STEP_SUMMARY\")")
    p.add_argument("--junit", default=None, metavar="FILE", help="write JUnit XML (one testcase per gate) to FILE")
    p.add_argument("--inconclusive", choices=("pass", "fail"), default="pass",
                   help="whether an inconclusive gate fails the command (default: pass; in JUnit it is skipped)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, metavar="S",
                   help=f"give up (exit 2) when the tracking store has not answered all reads in S seconds "
                   f"(default {DEFAULT_TIMEOUT_S:g})")
    p.add_argument("--power", action="store_true",
                   help="print each gate's smallest regression detected with 80%% probability (from the eval's "
                   "size and the gate file's calibrated noise); also in --markdown and --junit")
    p.set_defaults(func=main)
