"""`lowprec run`'s loop gives the recorded decisions, events and loss curve bit for bit.

The golden file (tests/lowprec/runtime/golden/loop_trace.json) holds what golden_trace.py
records: the decisions and events first recorded before the after-step logic and the config
moved (issue 31), and the loss curve's bits on one intra-op thread (golden_trace.THREADS); a
refactor that changes any decision, event or loss fails here. Re-record only for an intended
change.
"""

import json

import pytest

from golden_trace import GOLDEN, trace


@pytest.mark.slow
def test_loop_matches_the_golden_trace(tmp_path):
    want = json.loads(GOLDEN.read_text())
    got = json.loads(json.dumps(trace(tmp_path)))
    assert got["events"] == want["events"]
    assert (got["rewinds"], got["skipped"], got["passes"]) == (want["rewinds"], want["skipped"], want["passes"])
    assert got["formats"] == want["formats"]
    bad = [i for i, (a, b) in enumerate(zip(got["losses"], want["losses"])) if a != b]
    assert len(got["losses"]) == len(want["losses"]) and not bad, f"losses differ from step {bad[:1]}"
