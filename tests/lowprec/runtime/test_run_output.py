"""What `lowprec run` writes to stdout and stderr is lowprec's own; other libraries' output is in the log.

"lowprec's own", precisely:
* stdout is the run's summary: its first line `run NAME: N steps, ...`, every other line
  indented by two spaces;
* every stderr line begins with `lowprec`, a name and a colon (`lowprec run: `,
  `lowprec tracking: `): the progress line (`lowprec run: step 4/8 (50%), ... tokens/s, loss
  ..., bf16 100%, ETA ...`), lowprec's warnings, and warnings raised in the user's code.

The run below has an `eval:` section (lm-eval's progress bars, its "bootstrapping for
stddev" print and its `git describe` subprocess, outside a git repository here), a new
SQLite store (MLflow's "Creating initial MLflow database tables" INFO lines, its system
metrics lines) and a warning raised in the user's model factory (which must show); all the
rest must be in the run's lowprec.log and nowhere on the terminal.
"""

from __future__ import annotations

import logging
import re
import subprocess
import sys
import warnings

import pytest
import yaml

from lowprec.runtime.trainer.console import Console

SUMMARY_FIRST = re.compile(r"run \S+: \d+ steps, .*")
SUMMARY_REST = re.compile(r"  \S.*")
STDERR_LINE = re.compile(r"lowprec( [\w.-]+)*: \S.*")
PROGRESS = re.compile(r"lowprec run: step (\d+)/8 \(\d+%\), [\d,]+ tokens/s, loss \d+\.\d{4}, "
                      r"(\w+ \d+%)( \w+ \d+%)*, ETA \S+")

WARNING_MODEL = '''
import warnings
import tinylm

def build(**kw):
    warnings.warn("width 32 is a toy width")   # the user's own code warns: this concerns the run
    return tinylm.build(**kw)
'''

CONFIG = {
    "model": {"factory": "warnmodel:build", "args": {"vocab": 256, "width": 32}},
    "data": {"factory": "tinylm:tokens", "args": {"vocab": 256}, "block_size": 16},
    "train": {"steps": 8, "batch_size": 4, "warmup": 2, "ckpt_every": 10, "log_every": 2},
    "precision": {"backend": "emulated", "default": "bf16", "keep_high_precision": [{"fqns": ["head"]}],
                  "rules": [{"name": "mlp", "select": {"fqns": ["up", "down"]}, "format": "bf16",
                             "ladder": ["fp8_tensorwise", "bf16"]}]},
    "rollout": {"check_every": 2, "min_steps": 2,
                "stages": [{"name": "mlp", "select": {"fqns": ["up", "down"]}, "format": "fp8_tensorwise"}]},
    "eval": {"suite": "shakespeare", "every": 0, "mode": "fast", "final_mode": "fast", "high_precision": False,
             "gates": None, "limit": 8},
}


@pytest.fixture
def project(tmp_path, tiny_lm):
    tiny_lm(tmp_path)
    (tmp_path / "warnmodel.py").write_text(WARNING_MODEL)
    return tmp_path


def _run(project, *extra, db="mlflow.db"):
    cfg = {**CONFIG, "tracking": {"uri": f"sqlite:///{project / db}", "experiment": "quiet"}}
    (project / "tiny.yaml").write_text(yaml.safe_dump(cfg))
    return subprocess.run([sys.executable, "-m", "lowprec.cli", "run", "tiny.yaml", *extra], cwd=project,
                          capture_output=True, text=True, timeout=900)


@pytest.mark.slow
def test_every_line_on_stdout_and_stderr_is_lowprecs_own(project):
    p = _run(project, "--out", "r")
    assert p.returncode == 0, p.stderr
    out, err = p.stdout.splitlines(), p.stderr.splitlines()
    assert out and SUMMARY_FIRST.fullmatch(out[0]), p.stdout
    assert all(SUMMARY_REST.fullmatch(line) for line in out[1:]), p.stdout
    assert any(line.startswith("  eval heldout_shakespeare: ") for line in out)   # the eval ran
    strange = [line for line in err if not STDERR_LINE.fullmatch(line)]
    assert not strange, p.stderr
    steps = [int(m.group(1)) for m in map(PROGRESS.fullmatch, err) if m]
    assert steps and steps[-1] == 8 and steps == sorted(steps), p.stderr   # the progress line, to the end
    assert "lowprec run: warning: UserWarning: width 32 is a toy width" in err   # the user's warning shows
    log = (project / "r" / "lowprec.log").read_text()
    for chatter in ("bootstrapping for stddev", "Creating initial MLflow database tables",
                    "8/8 [", "UserWarning: width 32 is a toy width"):   # lm-eval's progress bar (eval.limit 8)
        assert chatter in log, chatter
        assert chatter not in p.stdout and (chatter not in p.stderr or chatter.startswith("UserWarning"))
    # MLflow's system-metrics monitor starts when the sender thread has created the run, which
    # on a busy machine can come after an 8-step run's end: wherever its line came, not here
    assert "Started monitoring system metrics" not in p.stdout + p.stderr
    # datasets' "Generating test split" bars come only when its cache is new; wherever they came, not here
    assert "Generating" not in p.stdout + p.stderr
    assert "\r" not in log   # a bar rewritten in place is one line in the log


@pytest.mark.slow
def test_verbose_shows_the_other_libraries_output(project):
    p = _run(project, "--out", "v", "--verbose", "--steps", "2", db="other.db")
    assert p.returncode == 0, p.stderr
    assert "Creating initial MLflow database tables" in p.stderr and "bootstrapping for stddev" in p.stdout
    assert "bootstrapping for stddev" in (project / "v" / "lowprec.log").read_text()


def test_the_console_routes_and_restores(tmp_path, capsys):
    """In process: chatter to the log only, lowprec's lines to the terminal, everything put back."""
    root = logging.getLogger()
    before = (sys.stdout, sys.stderr, list(root.handlers), root.level, warnings.showwarning)
    with Console("run") as console:
        print("a library prints")
        sys.stderr.write("\r  0%|          | 0/4\r100%|##########| 4/4\n")
        logging.getLogger("mlflow.store").info("Creating initial MLflow database tables...")
        logging.getLogger("mlflow.store").warning("an MLflow warning")
        logging.getLogger("lowprec.tracking").warning("lowprec tracking: the store is away")
        logging.getLogger("mymodel").warning("something about your model")
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.warn("raised in the user's code")
        console.log_to(tmp_path / "r" / "lowprec.log")
        console.print("run x: 1 steps")
        console.say("step 1/1 (100%)")
    assert (sys.stdout, sys.stderr, list(root.handlers), root.level, warnings.showwarning) == before
    captured = capsys.readouterr()
    assert captured.out == "run x: 1 steps\n"
    assert captured.err.splitlines() == [
        "lowprec tracking: the store is away",
        "lowprec run: warning (mymodel): something about your model",
        "lowprec run: warning: UserWarning: raised in the user's code",
        "lowprec run: step 1/1 (100%)"]
    log = (tmp_path / "r" / "lowprec.log").read_text()
    for line in ("a library prints\n", "100%|##########| 4/4\n", "Creating initial MLflow database tables",
                 "an MLflow warning", "UserWarning: raised in the user's code", "run x: 1 steps\n"):
        assert line in log
    assert "0/4" not in log and "\r" not in log
