"""Importing lowprec's evals and running an evaluation leave the process as they found it: no
environment variable set or changed (the Hub and datasets are offline only for the call,
`lowprec.evals.suite.hub_offline`), and huggingface_hub's offline switch as it was.

Run in a fresh interpreter: other test modules set HF_HUB_OFFLINE themselves."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]

_SCRIPT = r'''
import json, os, sys
before = dict(os.environ)
import lowprec.evals
from lowprec.evals import ByteTokenizer, EvalSuite, run_suite
after_import = dict(os.environ)
import huggingface_hub.constants as hub
hub_before = hub.HF_HUB_OFFLINE
import torch
from experiments.model import build_gpt
torch.manual_seed(0)
model = build_gpt(vocab_size=256, block_size=32, n_layer=1, n_head=2, d_model=16)
seen = {}
import lowprec.evals.suite as suite_module
inner = suite_module._lean_bookkeeping
def watching():   # what the evaluation itself sees: offline
    seen["inside"] = os.environ.get("HF_HUB_OFFLINE"), hub.HF_HUB_OFFLINE
    return inner()
suite_module._lean_bookkeeping = watching
r = run_suite(EvalSuite("tiny", ("heldout_shakespeare",)), model, ByteTokenizer(), 32, limit=2,
              bootstrap_iters=0, cache_dir=sys.argv[1])
json.dump({"import": sorted(set(after_import.items()) ^ set(before.items())),
           "eval": sorted(set(dict(os.environ).items()) ^ set(before.items())),
           "hub": [hub_before, hub.HF_HUB_OFFLINE], "inside": seen["inside"],
           "tasks": sorted(r.results)}, sys.stdout)
'''


def test_evals_import_and_a_whole_eval_leave_the_environment_as_they_found_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _SCRIPT, str(tmp_path / "cache")], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["tasks"] == ["heldout_shakespeare"]           # the eval ran
    assert got["inside"] == ["1", True]                       # offline while it ran
    assert got["import"] == [], got["import"]                 # importing set nothing
    assert got["eval"] == [], got["eval"]                     # nor did the eval, once over
    assert got["hub"] == [False, False]                       # huggingface_hub's switch as it was
