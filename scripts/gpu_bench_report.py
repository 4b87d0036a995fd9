"""scripts/gpu_bench.sh's reports: OUT/PHASE.md and OUT/PHASE.json for a phase, OUT/call.json
for the whole call. Standard library only (it runs on the GPU machine before anything else).

    python scripts/gpu_bench_report.py --phase linear --rc 0 --seconds 212 --timeout 420 \
        --log /tmp/gpu_bench/linear.log --work /tmp/gpu_bench --out $OUT
    python scripts/gpu_bench_report.py --summary --out $OUT --phases tests quantize
"""

from __future__ import annotations

import argparse
import json
import platform
import time
import xml.etree.ElementTree as ET
from pathlib import Path

LOG_CHARS = 200_000      # the end of a log kept in PHASE.md (16 MiB a file comes back)


def status_of(rc: int) -> str:
    return {0: "passed", 124: "timed out", 137: "timed out (killed)", 3: "unfinished"}.get(rc, "failed")


def junit(path: Path) -> dict:
    """Counts of a pytest --junitxml file, and the names of failed tests."""
    if not path.is_file():
        return {}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    out = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    out["failed"] = [f"{c.get('classname')}::{c.get('name')}" for s in suites for c in s
                     if c.find("failure") is not None or c.find("error") is not None]
    return out


def table_lines(log: str) -> list[str]:
    """The markdown table and '#' header lines a benchmark printed."""
    return [ln for ln in log.splitlines() if ln.startswith(("|", "# "))]


def phase_result(phase: str, log: str, work: Path) -> tuple[dict, list[str]]:
    """(JSON result, markdown lines) of one phase from its log and its files under work."""
    if phase == "tests":
        res = {name: junit(work / f"tests-{name}.xml") for name in ("gpu", "kernels")}
        md = [f"- {name}: {r.get('tests', '?')} tests, {r.get('failures', '?')} failures, "
              f"{r.get('errors', '?')} errors, {r.get('skipped', '?')} skipped"
              + (f"; failed: {', '.join(r['failed'])}" if r.get("failed") else "") for name, r in res.items()]
        return res, md
    if phase in ("linear", "quantize", "profile", "host"):
        path = work / f"{phase}.json"
        res = json.loads(path.read_text()) if path.is_file() else {"note": f"no {path.name}: see the log"}
        return res, table_lines(log)
    if phase == "model":   # one JSON per model size
        res = {p.stem: json.loads(p.read_text()) for p in sorted(work.glob("model_*.json"))}
        return res or {"note": "no model_*.json: see the log"}, table_lines(log)
    if phase in ("mainjob", "temainjob"):
        runs = work / "runs" / phase
        res: dict = {"verdict": next((ln for ln in log.splitlines() if ln.startswith("Gate verdict")), None)}
        for name in ("bf16-baseline", "staged-rollout"):
            d = runs / name
            run = {"run_id": (d / "run_id").read_text().strip() if (d / "run_id").is_file() else None}
            for f in ("telemetry.json", "summary.json"):
                if (d / f).is_file():
                    try:
                        run[f.removesuffix(".json")] = json.loads((d / f).read_text())
                    except json.JSONDecodeError:
                        run[f] = "unreadable"
            res[name] = run
        gate = runs / "gate.md"
        md = [res["verdict"] or "no gate verdict (see the log)", ""]
        md += gate.read_text().splitlines() if gate.is_file() else []
        return res, md
    if phase == "moe":   # bench_moe prints its tables (and their header lines) only
        lines = [ln for ln in log.splitlines() if ln.startswith(("|", "experts "))]
        return {"tables": lines}, lines
    if phase == "te":
        stamps = [ln for ln in log.splitlines() if ln.startswith("== ") or ln.startswith("TE")]
        res = {"stamps": stamps, "tests": junit(work / "tests-te.xml")}
        rows = work / "linear_te.json"
        if rows.is_file():
            res["linear_te"] = json.loads(rows.read_text())
        return res, stamps + ([f"- tests: {res['tests']}"] if res["tests"] else []) + table_lines(log)
    return {}, []


def write_phase(args) -> None:
    out, work = Path(args.out), Path(args.work)
    out.mkdir(parents=True, exist_ok=True)
    log = Path(args.log).read_text(errors="replace") if Path(args.log).is_file() else ""
    try:
        result, md = phase_result(args.phase, log, work)
    except Exception as e:  # noqa: BLE001 - a report must not hide the log
        result, md = {"report_error": f"{type(e).__name__}: {e}"}, [f"report error: {e}"]
    record = {"phase": args.phase, "rc": args.rc, "status": status_of(args.rc), "seconds": args.seconds,
              "timeout_s": args.timeout, "finished_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "host": platform.node(), "result": result}
    (out / f"{args.phase}.json").write_text(json.dumps(record, indent=1, default=str) + "\n")
    tail = log[-LOG_CHARS:]
    text = [f"# gpu_bench phase `{args.phase}`: {record['status']} (exit {args.rc}, {args.seconds} s "
            f"of {args.timeout} s)", "", *md, "", "## Log" + (" (its end)" if len(log) > len(tail) else ""),
            "", "```", tail.rstrip(), "```", ""]
    (out / f"{args.phase}.md").write_text("\n".join(text))


def write_summary(args) -> None:
    out = Path(args.out)
    phases = []
    for p in args.phases:
        f = out / f"{p}.json"
        rec = json.loads(f.read_text()) if f.is_file() else {"phase": p, "status": "no report"}
        phases.append({k: rec.get(k) for k in ("phase", "status", "rc", "seconds", "timeout_s")})
    (out / "call.json").write_text(json.dumps({"phases": phases}, indent=1) + "\n")
    for rec in phases:
        print(f"{rec['phase']:10s} {rec['status']:20s} {rec.get('seconds')} s")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase")
    p.add_argument("--rc", type=int, default=0)
    p.add_argument("--seconds", type=int, default=0)
    p.add_argument("--timeout", type=int, default=0)
    p.add_argument("--log", default="")
    p.add_argument("--work", default="/tmp/gpu_bench")
    p.add_argument("--out", required=True)
    p.add_argument("--summary", action="store_true")
    p.add_argument("--phases", nargs="*", default=[])
    args = p.parse_args(argv)
    write_summary(args) if args.summary else write_phase(args)


if __name__ == "__main__":
    main()
