"""One config, every host, the same baseline: `rollout.baseline: {losses: bf16_losses.json}`
names a file beside the config, and each host finds it there when it runs from another working
folder (lowprec.runtime.session.host.read_baseline): `lowprec run` (prepare_run, which one process and
every torchrun rank call), the Hugging Face and Lightning callbacks, torchtitan's LowprecTrainer
(through its config loading: the trainer reads the baseline of that config with read_baseline)
and Session.from_yaml. On d588cb5 torchtitan's loading and Session.from_yaml read the file from
the working folder and failed ("no such file 'bf16_losses.json'")."""

from __future__ import annotations

import json

import pytest
import torch

from lowprec.base.parse import ConfigError
from lowprec.config import LowprecConfig
from lowprec.runtime.session.host import read_baseline

CURVE = [5.5 - 0.05 * i for i in range(50)]
MODEL = "model: {factory: 'experiments.model:build_gpt', args: {vocab_size: 64, block_size: 8, n_layer: 1, " \
        "n_head: 2, d_model: 16}}\n"
SECTIONS = """\
precision:
  backend: emulated
  default: bf16
  rules:
    - {name: all, select: {module_type: Linear}, format: bf16, ladder: [fp8_tensorwise, bf16]}
rollout:
  check_every: 5
  min_steps: 5
  rewind: {enabled: false}
  thresholds: {loss_gap: 0.5}
  baseline: {losses: bf16_losses.json}
  stages:
    - {name: mlp_fp8, select: {glob: "*.mlp.*"}, format: fp8_tensorwise}
"""


@pytest.fixture
def configs(tmp_path, monkeypatch):
    """(the `lowprec run` config, the framework/session config), both beside bf16_losses.json;
    the working folder is another one."""
    folder = tmp_path / "configs"
    folder.mkdir()
    (folder / "bf16_losses.json").write_text(json.dumps(CURVE))
    (folder / "run.yaml").write_text(MODEL + SECTIONS)
    (folder / "hosted.yaml").write_text(SECTIONS)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    return folder / "run.yaml", folder / "hosted.yaml"


def _gpt():
    from experiments.model import build_gpt
    torch.manual_seed(0)
    return build_gpt(vocab_size=64, block_size=8, n_layer=1, n_head=2, d_model=16)


def _curve(baseline) -> list[float]:
    return [baseline[i] for i in range(len(baseline))]


def test_every_host_reads_the_baseline_beside_its_config_from_another_working_folder(configs):
    run_yaml, hosted_yaml = configs
    from lowprec.runtime.trainer.run import prepare_run
    prepared = prepare_run(LowprecConfig.from_yaml(run_yaml), with_data=False)       # lowprec run
    assert _curve(prepared.baseline) == CURVE
    from lowprec.integrations.hf import LowprecCallback as HFCallback
    assert _curve(HFCallback.from_yaml(hosted_yaml, _gpt()).hosted.baseline) == CURVE
    from lowprec.integrations.lightning import LowprecCallback as LightningCallback
    assert _curve(LightningCallback(hosted_yaml, _gpt()).hosted.baseline) == CURVE
    from lowprec.integrations.torchtitan import _framework_config_with_probe
    assert _curve(read_baseline(_framework_config_with_probe(hosted_yaml))) == CURVE   # LowprecTrainer's
    from lowprec.runtime.session.session import Session
    model = _gpt()
    session = Session.from_yaml(hosted_yaml, model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert session.controller.loss_gap is not None


def test_a_baseline_file_nowhere_says_where_it_looked(configs):
    _, hosted_yaml = configs
    (hosted_yaml.parent / "bf16_losses.json").unlink()
    from lowprec.integrations.core import framework_config
    with pytest.raises(ConfigError, match=r"rollout.baseline.losses: 'bf16_losses.json' not found \(looked at .*configs"):
        read_baseline(framework_config(hosted_yaml))
