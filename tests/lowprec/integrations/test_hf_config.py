"""The Hugging Face callback's config is checked whole at `from_yaml`, before any Trainer: a
baseline run that is not in the store, a stage that selects nothing and a gate file that is
not there are ConfigErrors then, and `lowprec plan --model-factory` checks the same YAML from
the command line. Under the Trainer's MLflow reporting the run goes to the YAML's `tracking:`
store and experiment (said on stderr when training starts), with the baseline loss curve."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from llama_helpers import shakespeare_blocks, tiny_llama  # noqa: E402

from lowprec.base.parse import ConfigError  # noqa: E402
from lowprec.cli import main  # noqa: E402
from lowprec.integrations.hf import LowprecCallback  # noqa: E402
from lowprec.tracking.outbox import local_artifact_location  # noqa: E402

PRECISION = """\
precision:
  backend: emulated
  default: bf16
  keep_high_precision: [{fqns: [lm_head]}]
  rules:
    - {name: all, select: {module_type: Linear}, format: bf16, ladder: [fp8_tensorwise, bf16]}
"""


def rollout(*, baseline: str, select: str = '"*.mlp.*"') -> str:
    return f"""\
rollout:
  check_every: 5
  min_steps: 5
  rewind: {{enabled: false}}
  thresholds: {{loss_gap: 0.5}}
  baseline: {baseline}
  stages:
    - {{name: mlp_fp8, select: {{glob: {select}}}, format: fp8_tensorwise}}
"""


def write(tmp_path, text: str):
    (tmp_path / "lowprec.yaml").write_text(text)
    return tmp_path / "lowprec.yaml"


def losses_file(tmp_path, n: int = 40):
    (tmp_path / "bf16.json").write_text(json.dumps([5.5 - 0.05 * i for i in range(n)]))
    return tmp_path / "bf16.json"


def test_a_baseline_run_not_in_the_store_is_refused_at_from_yaml(tmp_path, sqlite_store):
    uri = sqlite_store(tmp_path / "store")
    path = write(tmp_path, PRECISION + rollout(baseline="{mlflow_run: bf16-baseline}")
                 + f"tracking: {{uri: '{uri}', experiment: hf}}\n")
    with pytest.raises(ConfigError, match="rollout.baseline.*bf16-baseline") as e:
        LowprecCallback.from_yaml(path, tiny_llama())
    # how to make one with the Trainer, not with `lowprec run`, which a Trainer user does not use
    assert "with your trainer" in str(e.value) and "lowprec run" not in str(e.value)


def test_a_stage_that_selects_nothing_is_refused_at_from_yaml(tmp_path):
    path = write(tmp_path, PRECISION + rollout(baseline=f"{{losses: {losses_file(tmp_path)}}}", select='"*.ffn.*"')
                 + "tracking: {enabled: false}\n")
    with pytest.raises(ConfigError, match=r"stages\[0\].*mlp_fp8.*selects no"):
        LowprecCallback.from_yaml(path, tiny_llama())


def test_a_gate_file_that_is_not_there_is_refused_at_from_yaml(tmp_path):
    path = write(tmp_path, PRECISION + "eval: {suite: default, every: 0, gates: no-such-gate}\n"
                 + "tracking: {enabled: false}\n")
    with pytest.raises(ConfigError, match="eval.*no-such-gate"):
        LowprecCallback.from_yaml(path, tiny_llama())


FACTORY = """\
def build():
    from transformers import LlamaConfig, LlamaForCausalLM
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64))
"""


def test_lowprec_plan_checks_a_callbacks_yaml_against_its_model(tmp_path, capsys):
    (tmp_path / "hfmodel.py").write_text(FACTORY)
    good = PRECISION + rollout(baseline=f"{{losses: {losses_file(tmp_path)}}}") + "tracking: {enabled: false}\n"
    path = write(tmp_path, good)
    assert main(["plan", str(path)]) == 2                       # a callback's YAML has no model: section
    assert "model" in capsys.readouterr().err
    assert main(["plan", str(path), "--model-factory", "hfmodel:build"]) == 0
    out = capsys.readouterr().out
    assert "model.layers.1.mlp.down_proj" in out and "mlp_fp8: 6 sites -> fp8_tensorwise" in out
    write(tmp_path, good.replace('"*.mlp.*"', '"*.ffn.*"'))
    assert main(["plan", str(path), "--model-factory", "hfmodel:build"]) == 2
    err = capsys.readouterr().err
    assert "selects no precision site" in err and "Traceback" not in err


@pytest.mark.slow
def test_the_trainers_mlflow_run_goes_to_the_yamls_store_with_the_baseline_curve(tmp_path, sqlite_store, capsys,
                                                                                 monkeypatch):
    from mlflow.tracking import MlflowClient
    from transformers import Trainer, TrainingArguments
    monkeypatch.chdir(tmp_path)      # a store the Trainer would pick by default lands here, and must not
    uri = sqlite_store(tmp_path / "store")
    path = write(tmp_path, PRECISION + rollout(baseline=f"{{losses: {losses_file(tmp_path)}}}")
                 + f"tracking: {{uri: '{uri}', experiment: hf-yaml}}\n")
    model = tiny_llama()
    lp = LowprecCallback.from_yaml(path, model)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=12, per_device_train_batch_size=8,
                             learning_rate=3e-3, report_to=["mlflow"], use_cpu=True, save_strategy="no", seed=0,
                             disable_tqdm=True, logging_steps=4)
    Trainer(model=model, args=args, train_dataset=shakespeare_blocks(8 * 12), callbacks=[lp]).train()
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("hf-yaml")
    (run,) = client.search_runs([exp.experiment_id])
    assert run.info.status == "FINISHED" and "loss" in run.data.metrics           # the Trainer's own metrics
    assert "train/baseline_loss" in run.data.metrics                              # the baseline curve
    assert not (tmp_path / "mlflow.db").exists()                                  # no default store made
    assert f"lowprec: tracking into MLflow run {run.info.run_id} (experiment 'hf-yaml'" in capsys.readouterr().err


def test_the_start_line_names_the_experiment_mlflows_own_variable_sent_the_run_to(tmp_path, sqlite_store, capsys,
                                                                                 monkeypatch):
    """MLFLOW_EXPERIMENT_NAME is MLflow's (the Trainer's reporting obeys it, over the YAML's
    experiment): the line says where the run really went, and lowprec tracks into it. That
    experiment, new, keeps its artifacts beside the store as the YAML's would, not in the
    launch folder's ./mlruns."""
    from mlflow.tracking import MlflowClient
    from transformers import Trainer, TrainingArguments
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "from-mlflow-env")
    uri = sqlite_store(tmp_path / "store")
    path = write(tmp_path, PRECISION + "tracking: {uri: '%s', experiment: hf-yaml}\n" % uri)
    model = tiny_llama()
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, per_device_train_batch_size=4,
                             report_to=["mlflow"], use_cpu=True, save_strategy="no", seed=0, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=shakespeare_blocks(8),
            callbacks=[LowprecCallback.from_yaml(path, model)]).train()
    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("from-mlflow-env")
    (run,) = client.search_runs([exp.experiment_id])
    assert "train/loss" in run.data.metrics                      # lowprec's metrics in the Trainer's run
    beside = local_artifact_location(uri, "from-mlflow-env")     # <store dir>/mlruns/<experiment>
    assert exp.artifact_location == beside and run.info.artifact_uri.startswith(beside)
    assert client.list_artifacts(run.info.run_id) and not (tmp_path / "mlruns").exists()
    assert client.search_runs([client.get_experiment_by_name("hf-yaml").experiment_id]) == []
    err = capsys.readouterr().err
    assert f"lowprec: tracking into MLflow run {run.info.run_id} (experiment 'from-mlflow-env'" in err, err[-2000:]
