"""One object for a run's life (issue 55): `RunLife` builds every host's tracker, wires its evals
and ends its run; no host builds a Tracker or ends its run itself. On c13c165 four hosts did
(runtime/trainer/run.py, runtime/trainer/parallel_run.py, integrations/core.py; torchtitan_trainer.py ended its
run through its own try/except)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from lowprec.config import ConfigRole, LowprecConfig
from lowprec.runtime.session.run_life import RunLife
from lowprec.tracking.records import RunStatus

ROOT = Path(__file__).resolve().parents[3]
HOSTS = ("lowprec/runtime", "lowprec/integrations")


def test_no_host_builds_a_tracker_or_ends_a_run_itself():
    found = []
    for folder in HOSTS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            if path.name == "run_life.py":
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if not isinstance(node, ast.Call):
                    continue
                fn = ast.unparse(node.func)
                if fn == "Tracker" or fn.endswith(".Tracker") or fn.endswith("tracker.finish"):
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {fn}(...)")
    assert len(list((ROOT / "lowprec/integrations").glob("*.py"))) > 5
    assert not found, "build the tracker and end the run through RunLife (lowprec.runtime.session.run_life):\n" + \
        "\n".join(found)


def test_the_run_ends_once_failed_when_training_raises():
    cfg = LowprecConfig.from_dict({"precision": {"backend": "emulated"}, "tracking": {"enabled": False}},
                                  role=ConfigRole.FRAMEWORK)
    ended = []
    life = RunLife(cfg, "run", None, on_end=ended.append)
    assert life.tracker is None
    with pytest.raises(KeyError):
        with life.running():
            raise KeyError("the framework's loop failed")
    life.end(RunStatus.FINISHED)   # a host's own end afterwards changes nothing
    assert ended == [RunStatus.FAILED] and life.status is RunStatus.FAILED
    done = RunLife(cfg, "run", None, on_end=ended.append)
    with done.running():
        pass
    assert ended == [RunStatus.FAILED, RunStatus.FINISHED]
