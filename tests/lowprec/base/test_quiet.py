"""What is not the user's business is silenced while other libraries load, and nothing else:
torchao's unloadable optional extensions and pytree's Enum deprecations when the Hugging Face
integration loads transformers (which imports torchao), while a torchao warning of any other
kind, the user's own warnings and logs still show, and the loggers carry no filter after."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest

from lowprec.base.quiet import quiet_imports

NOISE = ("Failed to load", "register_constant() on Enum subclasses is deprecated")
USER = """
import logging, warnings
logging.getLogger("torchao").warning("torchao: a message of another kind")
warnings.warn("the user's own warning")
"""


# One process imports torch (every order below imports it before anything else) and forks a child
# per snippet: each child is a fresh start for transformers, torchao and lowprec, whose lines are
# checked, without importing torch again. The child's stderr goes to its own file.
FORKS = """
import json, os, sys, traceback
import torch
codes, errs = json.loads(sys.argv[1]), json.loads(sys.argv[2])
for code, err in zip(codes, errs):
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        fd = os.open(err, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        os.dup2(fd, 2)
        try:
            exec(compile(code, "<snippet>", "exec"), {"__name__": "__main__"})
            status = 0
        except BaseException:
            traceback.print_exc()
            status = 1
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(status)
    _, status = os.waitpid(pid, 0)
    if status:
        sys.exit(f"{code!r} failed: " + open(err).read())
"""


def _stderrs(tmp_path, *codes: str) -> list[str]:
    """What each snippet wrote to stderr, run one after another as children of a process that imported torch."""
    errs = [str(tmp_path / f"{i}.err") for i in range(len(codes))]
    p = subprocess.run([sys.executable, "-c", FORKS, json.dumps(codes), json.dumps(errs)], capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    return [Path(e).read_text() for e in errs]


@pytest.mark.slow
def test_the_hf_integration_loads_transformers_without_the_chatter(tmp_path):
    """Quiet in either order of `import transformers` (lazy: it loads no model code) and the
    integration, and for the model code imported after. When the user's own `from transformers
    import Trainer` runs first, transformers loads torchao before any lowprec code exists in the
    process: the lines are transformers' and torchao's, shown as without lowprec, and the
    integration adds none."""
    pytest.importorskip("transformers")
    pytest.importorskip("torchao")
    orders = (("import lowprec.integrations.hf", "import transformers"),
              ("import transformers", "import lowprec.integrations.hf"))
    eager_first, *errs = _stderrs(tmp_path, "from transformers import Trainer\nimport lowprec.integrations.hf",
                                  *(f"{a}\n{b}\nfrom transformers import Trainer, LlamaForCausalLM\n" + USER
                                    for a, b in orders))
    assert all(n in eager_first for n in NOISE)     # what a user saw (the check can fail)
    assert all(any(n in line for n in NOISE) for line in eager_first.splitlines()), eager_first  # nothing more
    for (first, _), err in zip(orders, errs):
        assert not any(n in err for n in NOISE), (first, err)
        assert "torchao: a message of another kind" in err and "the user's own warning" in err


def test_only_the_known_records_and_only_inside_the_block(caplog):
    torchao, pytree = logging.getLogger("torchao"), logging.getLogger("torch.utils._pytree")
    noise = "Failed to load /x/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so: Could not load"
    enum = ("<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile as an "
            "opaque value type. Calling register_constant() on Enum subclasses is deprecated and will be an error")
    with caplog.at_level(logging.WARNING):
        with quiet_imports():
            torchao.warning(noise)
            pytree.warning(enum)
            torchao.warning("Failed to quantize layer 3")      # another torchao message: the user's business
        torchao.warning(noise)                                 # after the block: shown again
    assert [r.getMessage() for r in caplog.records] == ["Failed to quantize layer 3", noise]
    assert not torchao.filters and not pytree.filters


def test_artifact_downloads_draw_no_progress_bar_inside_the_block_and_the_switch_is_restored(tmp_path, capfd,
                                                                                               monkeypatch,
                                                                                               sqlite_store):
    import os

    from mlflow.tracking import MlflowClient

    from lowprec.base.quiet import quiet_artifact_downloads

    client = MlflowClient(sqlite_store(tmp_path))   # a copy of the session's migrated store
    run = client.create_run(client.create_experiment("quiet", artifact_location=(tmp_path / "art").as_uri()))
    (tmp_path / "events.jsonl").write_text("{}\n")
    client.log_artifact(run.info.run_id, str(tmp_path / "events.jsonl"))
    monkeypatch.delenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", raising=False)
    capfd.readouterr()
    client.download_artifacts(run.info.run_id, "events.jsonl", str(tmp_path / "a"))
    assert "Downloading artifacts" in capfd.readouterr().err   # MLflow's own bar, outside the block
    with quiet_artifact_downloads():
        client.download_artifacts(run.info.run_id, "events.jsonl", str(tmp_path / "b"))
    assert "Downloading artifacts" not in capfd.readouterr().err
    assert "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR" not in os.environ   # as it was: unset
    monkeypatch.setenv("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "true")
    with quiet_artifact_downloads():
        pass
    assert os.environ["MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"] == "true"   # the user's own setting kept
