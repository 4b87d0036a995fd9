"""Gate results as text: a terminal table, Markdown for a CI summary, JUnit XML for CI test reports.

* `table(results)`: one row per gate: metric, baseline, candidate, regression (+ = worse),
  interval, allowed regression, n, verdict; then one reason per gate.
* `markdown(summary, baseline, candidate)`: a heading with the overall verdict, the two runs,
  the same table, the reasons (`$GITHUB_STEP_SUMMARY` renders it on the job page).
* `junit_xml(summary, ...)`: one `<testcase>` per gate; a regression is a `<failure>`, an
  inconclusive gate is `<skipped>` (or a `<failure>` when inconclusive counts as failing). An
  informational gate never fails: its verdict is in its output and its properties.
* `power_table(results)` (`--power`, also a Markdown section and JUnit properties with
  `power=True`): per gate the smallest regression detected with 80% probability.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

from lowprec.gates.gate import GateResult, GateSummary
from lowprec.policy.verdicts import Verdict

__all__ = ["table", "markdown", "junit_xml", "power_table", "power_rows", "HEADERS", "POWER_HEADERS"]

HEADERS = ("metric", "baseline", "candidate", "delta (+ = worse)", "interval", "tolerance", "n", "verdict")
_MARK = {Verdict.PASS: "pass", Verdict.REGRESS: "REGRESS", Verdict.INCONCLUSIVE: "inconclusive"}
POWER_HEADERS = ("metric", "tolerance", "n", "detectable regression (80% power)", "relative", "from")


def _num(x: float | None, signed: bool = False) -> str:
    if x is None:
        return "-"
    if not math.isfinite(x):
        return str(x)
    return f"{x:+.4g}" if signed else f"{x:.4g}"


def _row(r: GateResult) -> tuple[str, ...]:
    interval = "-" if r.interval is None else f"[{_num(r.interval[0], True)}, {_num(r.interval[1], True)}]"
    return (r.metric, _num(r.baseline_value), _num(r.candidate_value), _num(r.delta, True), interval,
            r.tolerance or "-", "-" if r.n is None else str(r.n),
            _MARK[r.verdict] + (" (informational)" if r.informational else ""))


def power_rows(results) -> list[tuple[str, ...]]:
    rows = []
    for r in results:
        d = r.detectable
        rel = "-" if d is None or not r.baseline_value else f"{d / abs(r.baseline_value):.2%}"
        rows.append((r.metric, r.tolerance or "-", "-" if r.n is None else str(r.n),
                     "-" if d is None else _num(d), rel, r.power_note or "-"))
    return rows


def power_table(results) -> str:
    """Per gate: the smallest true regression it calls `regress` with 80% probability."""
    rows = [POWER_HEADERS] + power_rows(results)
    widths = [max(len(row[i]) for row in rows) for i in range(len(POWER_HEADERS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "Power: the smallest regression each gate detects with 80% probability\n" + "\n".join(lines)


def table(results: list[GateResult] | tuple[GateResult, ...]) -> str:
    rows = [HEADERS] + [_row(r) for r in results]
    widths = [max(len(row[i]) for row in rows) for i in range(len(HEADERS))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + [""] + [f"- {r.verdict.value}: {r.reason}" for r in results])


def _md_cell(s: str) -> str:
    return s.replace("|", "\\|")


def markdown(summary: GateSummary, baseline: str, candidate: str, power: bool = False) -> str:
    icon = {Verdict.PASS: ":white_check_mark:", Verdict.REGRESS: ":x:", Verdict.INCONCLUSIVE: ":grey_question:"}[
        summary.verdict]
    out = [f"### {icon} lowprec gate: {summary.verdict.value}", "",
           f"Baseline: {_md_cell(baseline)}  ", f"Candidate: {_md_cell(candidate)}", "",
           "| " + " | ".join(HEADERS) + " |", "|" + "|".join("---" for _ in HEADERS) + "|"]
    for r in summary.results:
        cells = list(_row(r))
        cells[0] = f"`{cells[0]}`"
        cells[-1] = f"**{cells[-1]}**" if r.verdict is not Verdict.PASS else cells[-1]
        out.append("| " + " | ".join(_md_cell(c) for c in cells) + " |")
    out += [""] + [f"- **{r.verdict.value}**: {_md_cell(r.reason)}" for r in summary.results] + [""]
    if power:
        out += ["Power: the smallest regression each gate detects with 80% probability", "",
                "| " + " | ".join(POWER_HEADERS) + " |", "|" + "|".join("---" for _ in POWER_HEADERS) + "|"]
        out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in power_rows(summary.results)] + [""]
    return "\n".join(out) + "\n"


def junit_xml(summary: GateSummary, baseline: str, candidate: str, inconclusive_fails: bool = False,
              power: bool = False) -> str:
    results = summary.results
    failing = {Verdict.REGRESS, Verdict.INCONCLUSIVE} if inconclusive_fails else {Verdict.REGRESS}
    failures = sum(r.verdict in failing and not r.informational for r in results)
    skipped = sum(r.verdict is Verdict.INCONCLUSIVE and not r.informational for r in results) \
        if not inconclusive_fails else 0
    attrs = {"name": "lowprec gate", "tests": str(len(results)), "failures": str(failures), "errors": "0",
             "skipped": str(skipped)}
    root = ET.Element("testsuites", attrs)
    suite = ET.SubElement(root, "testsuite", attrs)
    props = ET.SubElement(suite, "properties")
    for k, v in (("baseline", baseline), ("candidate", candidate), ("verdict", summary.verdict.value)):
        ET.SubElement(props, "property", {"name": k, "value": v})
    for r in results:
        case = ET.SubElement(suite, "testcase", {"classname": "lowprec.gate", "name": r.metric, "time": "0"})
        if power or r.informational:
            cprops = ET.SubElement(case, "properties")
            if r.informational:
                ET.SubElement(cprops, "property", {"name": "informational", "value": r.verdict.value})
            if power:
                ET.SubElement(cprops, "property", {"name": "detectable_regression_80",
                                                   "value": "-" if r.detectable is None else repr(r.detectable)})
                ET.SubElement(cprops, "property", {"name": "power_from", "value": r.power_note or "-"})
        # an informational gate is reported, never a failure or a skip
        if r.verdict in failing and not r.informational:
            ET.SubElement(case, "failure", {"message": r.reason, "type": r.verdict.value}).text = r.reason
        elif r.verdict == Verdict.INCONCLUSIVE and not r.informational:
            ET.SubElement(case, "skipped", {"message": r.reason})
        ET.SubElement(case, "system-out").text = r.reason
    ET.indent(root)
    return '<?xml version="1.0" encoding="utf-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"
