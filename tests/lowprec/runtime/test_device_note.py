"""`backend: torch` where `torch._scaled_mm` runs in software (this CPU): `lowprec plan` shows it
and `lowprec run` says it at start, naming `emulated` as the fast choice there."""

from __future__ import annotations

import pytest
import torch
import yaml

from lowprec.cli import main
from lowprec.runtime.trainer.device_note import fast_path_note, scaled_mm_in_hardware


def _config(backend: str) -> dict:
    return {
        "model": {"factory": "tinylm:build", "args": {"vocab": 64, "width": 32}},
        "data": {"factory": "tinylm:tokens", "block_size": 16},
        "train": {"steps": 2, "batch_size": 4, "warmup": 1, "ckpt_every": 2, "log_every": 1},
        "precision": {"backend": backend, "default": "bf16", "keep_high_precision": [{"fqns": ["head"]}],
                      "rules": [{"name": "mlp", "select": {"fqns": ["up", "down"]}, "format": "fp8_tensorwise"}]},
        "tracking": {"enabled": False},
    }


@pytest.fixture
def project(tmp_path, monkeypatch, tiny_lm):
    tiny_lm(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    for backend in ("torch", "emulated"):
        (tmp_path / f"{backend}.yaml").write_text(yaml.safe_dump(_config(backend)))
    return tmp_path


def test_the_note_names_the_cpu_and_the_fast_choice():
    cpu = torch.device("cpu")
    assert not scaled_mm_in_hardware(cpu)
    note = fast_path_note("torch", cpu)
    assert "the CPU" in note and "emulated in software" in note and "`precision.backend: emulated`" in note
    assert fast_path_note("emulated", cpu) is None


def test_plan_shows_it_and_run_says_it_at_start(project, capsys):
    assert main(["plan", "torch.yaml"]) == 0
    out = capsys.readouterr().out
    assert "backend: precision.backend is 'torch', and on the CPU torch._scaled_mm is emulated in software" in out
    assert main(["plan", "emulated.yaml"]) == 0
    assert "emulated in software" not in capsys.readouterr().out

    assert main(["run", "torch.yaml", "--out", "run"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("lowprec run: precision.backend is 'torch', and on the CPU torch._scaled_mm is emulated "
                          "in software"), err
