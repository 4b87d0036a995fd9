"""`lowprec gate` end to end against a real MLflow SQLite store, runs logged with lowprec's Tracker.

Three runs, each with evals at steps 5 and 10 (`Tracker.log_eval(step, results, samples)`):
a baseline, a good candidate (answers shuffled a little, bits per byte within noise) and a bad
candidate (5% more bits per byte, 15 points less accuracy). The bad candidate is logged while
its tracking server is away (an HTTP URI nothing answers) and sent later with `sync_run_dir`,
so its eval artifacts went through the outbox. The CLI runs as a process of its own (exit codes),
forked from the session's pre-imported `lowprec_forks` server; tests/experiments/test_gate_e2e.py
runs the `lowprec` console script itself.
"""

from __future__ import annotations

import json
import subprocess
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

from lowprec.tracking.outbox import sync_run_dir
from lowprec.tracking.tracker import Tracker

pytestmark = pytest.mark.slow   # `lowprec gate` as a process per test
N = 400
FAST = dict(flush_interval_s=0.2, retry_max_s=1.0, probe_timeout_s=0.5)
GATES = """
gates:
  - metric: eval/heldout_shakespeare/bits_per_byte
    direction: lower_is_better
    max_regression: {relative: 0.02}
  - metric: eval/cloze_shakespeare/acc
    direction: higher_is_better
    max_regression: {absolute: 0.05}
  - metric: eval/shift_milton/bits_per_byte
    direction: lower_is_better
    max_regression: {relative: 0.5}
defaults: {min_samples: 50, bootstrap_samples: 1000}
"""


def _evals(kind: str, step: int) -> tuple[dict, dict]:
    """results and samples of one eval: per-example bits per byte and 0/1 cloze answers."""
    rng = np.random.default_rng(0)
    bpb = rng.gamma(20.0, 0.08, size=N)                   # per-document difficulty (~1.6 bits per byte)
    acc = (rng.random(N) < 0.6).astype(float)
    other = np.random.default_rng({"baseline": 1, "good": 2, "bad": 3}[kind] * 100 + step)
    if kind != "baseline":
        bpb = bpb * (1 + other.normal(0, 0.003, size=N)) * (1.05 if kind == "bad" else 1.0)
        flip = other.random(N) < (0.03 if kind == "good" else 0.0)
        acc = np.where(flip, 1 - acc, acc)
        if kind == "bad":
            acc[np.flatnonzero(acc)[:60]] = 0.0           # 60 of 400 right answers lost: -15 points
    keys = [f"doc{i:04d}" for i in range(N)]
    results = {"heldout_shakespeare": {"bits_per_byte": bpb.mean(), "bits_per_byte_stderr": bpb.std(ddof=1) / N ** .5},
               "cloze_shakespeare": {"acc,none": acc.mean(), "acc_stderr,none": acc.std(ddof=1) / N ** .5},
               "shift_milton": {"bits_per_byte": 2.0 + step / 1000, "bits_per_byte_stderr": 0.02}}  # no samples
    samples = {"heldout_shakespeare": {"bits_per_byte": dict(zip(keys, bpb))},
               "cloze_shakespeare": {"acc,none": dict(zip(keys, acc))}}
    return results, samples


def _log_run(uri: str, name: str, kind: str, buffer_dir: Path, send_to: str | None = None) -> str:
    tracker = Tracker(send_to or uri, "gate-tests", name, buffer_dir=buffer_dir, **FAST)
    for step in (5, 10):
        tracker.log_metrics(step, {"train/loss": 2.0})
        tracker.log_eval(step, *_evals(kind, step))
    if kind == "baseline":
        tracker.log_eval(10, *_evals("good", 10), prefix="eval_hp")
    st = tracker.finish("FINISHED", timeout=2 if send_to else 120, report=False)
    if send_to:  # the server was away: everything waits in the buffer, then goes to the store
        assert st["pending"] > 0 and (buffer_dir / "files" / "evals" / "eval_step000010.json").is_file()
        res = sync_run_dir(buffer_dir, tracking_uri=uri, timeout=120)
        assert res.pending == 0 and not res.error, res
        return json.loads((buffer_dir / "run.json").read_text())["run_id"]
    assert st["pending"] == 0, st
    return tracker.run_id


@pytest.fixture(scope="module")
def store(tmp_path_factory, sqlite_store, lowprec_forks):
    root = tmp_path_factory.mktemp("gate-store")
    uri = sqlite_store(root)                     # a copy of the session's migrated store
    dead = "http://127.0.0.1:9"                  # nothing answers there: the "server away" case
    runs = {kind: _log_run(uri, f"{kind}-run", kind, root / kind, send_to=dead if kind == "bad" else None)
            for kind in ("baseline", "good", "bad")}
    gates = root / "gates.yaml"
    gates.write_text(GATES)
    return {"uri": uri, "root": root, "gates": gates, "forks": lowprec_forks, **runs}


def gate(store, *args: str, baseline: str | None = None, candidate: str | None = None,
         gates: str | None = None) -> subprocess.CompletedProcess:
    cmd = ["gate", "--baseline", baseline or store["baseline"], "--candidate", candidate or store["good"],
           "--gates", gates or str(store["gates"]), "--tracking-uri", store["uri"], *args]
    return store["forks"].run(cmd, cwd=store["root"], timeout=180)


def test_tracker_stores_eval_samples_as_artifacts(store):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store["uri"])
    run = client.get_run(store["baseline"])
    assert {"eval/heldout_shakespeare/bits_per_byte", "eval/cloze_shakespeare/acc_stderr",
            "eval_hp/cloze_shakespeare/acc"} <= set(run.data.metrics)
    names = {a.path for a in client.list_artifacts(store["baseline"], "evals")}
    assert names == {"evals/eval_step000005.json", "evals/eval_step000010.json", "evals/eval_hp_step000010.json"}
    doc = json.loads(Path(client.download_artifacts(store["baseline"], "evals/eval_step000010.json",
                                                    str(store["root"]))).read_text())
    assert doc["step"] == 10 and doc["prefix"] == "eval" and "acc" in doc["results"]["cloze_shakespeare"]
    assert len(doc["samples"]["cloze_shakespeare"]["acc"]) == N      # lm-eval's `acc,none` written `acc`
    bad = {a.path for a in client.list_artifacts(store["bad"], "evals")}
    assert "evals/eval_step000010.json" in bad                       # came through the outbox, later


def test_good_candidate_passes_with_table_markdown_and_junit(store):
    md, xml = store["root"] / "summary.md", store["root"] / "gate.xml"
    md.write_text("earlier step output\n")
    p = gate(store, "--markdown", str(md), "--junit", str(xml))
    assert p.returncode == 0, p.stdout + p.stderr
    out = p.stdout
    for col in ("metric", "baseline", "candidate", "delta", "interval", "tolerance", "n", "verdict"):
        assert col in out.splitlines()[3]
    assert "eval/heldout_shakespeare/bits_per_byte" in out and f"  {N}  " in out and "PASS" in out
    assert "at step 10" in out and "paired bootstrap over 400 examples" in out
    assert "no per-example scores" in out                           # shift_milton: stderr only
    text = md.read_text()
    assert text.startswith("earlier step output\n") and "lowprec gate: pass" in text  # appended, not replaced
    assert text.count("| `eval/") == 3
    suite = ET.parse(xml).getroot().find("testsuite")
    cases = suite.findall("testcase")
    assert [c.get("name") for c in cases] == ["eval/heldout_shakespeare/bits_per_byte", "eval/cloze_shakespeare/acc",
                                              "eval/shift_milton/bits_per_byte"]
    assert suite.get("failures") == "0" and all(c.find("failure") is None for c in cases)


def test_bad_candidate_regresses_naming_the_metric(store):
    xml = store["root"] / "bad.xml"
    p = gate(store, "--junit", str(xml), "--step", "5", candidate=store["bad"])
    assert p.returncode == 1, p.stdout + p.stderr
    assert "REGRESS" in p.stdout and "regress: eval/heldout_shakespeare/bits_per_byte: regression +" in p.stdout
    assert "at step 5" in p.stdout
    cases = {c.get("name"): c for c in ET.parse(xml).getroot().iter("testcase")}
    fail = cases["eval/cloze_shakespeare/acc"].find("failure")
    assert fail is not None and fail.get("type") == "regress" and "eval/cloze_shakespeare/acc" in fail.get("message")
    assert cases["eval/shift_milton/bits_per_byte"].find("failure") is None


def test_inconclusive_is_skipped_or_fails_on_request(store, tmp_path, capsys):
    """In-process through lowprec.cli.main (the same handler and status; saves a process start)."""
    from lowprec.cli import main

    tight = tmp_path / "tight.yaml"   # the stderr-only metric cannot show a 0.1% bound: inconclusive
    tight.write_text("gates:\n  - metric: eval/shift_milton/bits_per_byte\n    direction: lower_is_better\n"
                     "    max_regression: {relative: 0.001}\n")
    args = ["gate", "--baseline", store["baseline"], "--candidate", store["good"], "--gates", str(tight),
            "--tracking-uri", store["uri"], "--junit", str(tmp_path / "g.xml")]
    assert main(args) == 0 and "INCONCLUSIVE" in capsys.readouterr().out
    case = ET.parse(tmp_path / "g.xml").getroot().find("testsuite/testcase")
    assert case.find("skipped") is not None and case.find("failure") is None
    assert main(args + ["--inconclusive", "fail"]) == 1
    case = ET.parse(tmp_path / "g.xml").getroot().find("testsuite/testcase")
    assert case.find("failure").get("type") == "inconclusive" and case.find("skipped") is None


@pytest.mark.parametrize("case", ["bad gate file", "missing run", "missing metric", "missing store"])
def test_unusable_input_exits_2_with_a_clear_message(store, tmp_path, case):
    kw, args = {}, []
    if case == "bad gate file":
        bad = tmp_path / "bad.yaml"
        bad.write_text(GATES.replace("lower_is_better", "lower_is_beter", 1))
        kw["gates"], expect = str(bad), ["bad.yaml: gates[0]", "direction", "Did you mean 'lower_is_better'"]
    elif case == "missing run":
        kw["candidate"], expect = "0" * 32, [f"no run with id '{'0' * 32}'", store["uri"], "good-run", store["good"]]
    elif case == "missing metric":
        other = tmp_path / "other.yaml"
        other.write_text(GATES.replace("eval/cloze_shakespeare/acc", "eval/cloze_shakespeare/accuracy"))
        kw["gates"], expect = str(other), ["no metric 'eval/cloze_shakespeare/accuracy'",
                                           "Did you mean 'eval/cloze_shakespeare/acc'", "Metrics under eval/"]
    else:
        args, expect = ["--tracking-uri", f"sqlite:///{tmp_path / 'none.db'}"], ["does not exist", "none.db"]
    p = gate(store, *args, **kw)
    assert p.returncode == 2, p.stdout + p.stderr
    assert "Traceback" not in p.stderr and p.stderr.startswith("lowprec gate: ")
    for part in expect:
        assert part in p.stderr, f"{part!r} not in {p.stderr!r}"
    assert not (tmp_path / "none.db").exists()   # a store that is not there is reported, never created
