"""LowprecConfig: the default config loads; every bad config is a ConfigError naming the path."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

import lowprec.policy.rollout
from lowprec.config import DataConfig, EvalConfig, ModelConfig, LowprecConfig, TrackingConfig, TrainConfig
from lowprec.base.parse import ConfigError
from lowprec.sites.plan import PrecisionPlan

ROOT = Path(__file__).resolve().parents[3]
DEFAULT = ROOT / "experiments" / "configs" / "default.yaml"
HAS_ROLLOUT_CONFIG = hasattr(lowprec.policy.rollout, "RolloutConfig")


@pytest.fixture(autouse=True)
def _in_root(monkeypatch):
    monkeypatch.chdir(ROOT)   # eval.gates of the default config is relative to the checkout


def default_dict() -> dict:
    return yaml.safe_load(DEFAULT.read_text())


def test_default_config_loads():
    c = LowprecConfig.from_yaml(DEFAULT)
    assert c.model == ModelConfig("experiments.model:build_gpt",
                                  {"vocab_size": 256, "block_size": 128, "n_layer": 4, "n_head": 4, "d_model": 128})
    assert c.data == DataConfig("experiments.data:shakespeare_tokens", {"max_bytes": 2000000}, 128)
    assert c.train == TrainConfig(steps=300, batch_size=16, lr=3e-3, warmup=20, ckpt_every=50, seed=0)
    assert isinstance(c.precision, PrecisionPlan) and c.precision.rules[1].name == "middle_mlp"
    assert c.rollout is not None
    assert c.eval.every == 150 and c.eval.gates == "inloop"      # a shipped gate file, by name
    assert c.tracking == TrackingConfig(experiment="lowprec-default", run_name="staged-rollout")
    assert c.source == str(DEFAULT)
    assert c.rollout.baseline.mlflow_run == "bf16-baseline" and c.rollout.thresholds.loss_gap == 0.03


def test_train_defaults_and_ckpt_keep():
    t = TrainConfig()
    assert (t.steps, t.batch_size, t.lr, t.weight_decay, t.warmup, t.grad_clip, t.seed, t.ckpt_every, t.ckpt_keep,
            t.log_every, t.microbatches) == (300, 16, 3e-3, 0.1, 20, 1.0, 0, 50, 5, 10, 1)
    e = EvalConfig()
    assert (e.evaluator, e.suite, e.every, e.mode, e.final_mode, e.high_precision, e.gates, e.batch_size) == (
        "lm_eval", "default", 100, "fast", "full", True, "inloop", 32)


def test_optional_sections():
    d = default_dict()
    for k in ("data", "train", "rollout", "eval", "tracking"):
        d.pop(k, None)
    c = LowprecConfig.from_dict(d)
    assert (c.data, c.rollout, c.eval) == (None, None, None)
    assert c.train == TrainConfig() and c.tracking == TrackingConfig() and c.source == "<dict>"
    d["train"] = None   # an empty `train:` line means the defaults
    assert LowprecConfig.from_dict(d).train == TrainConfig()


def test_lr_written_as_3e_3_is_a_float(tmp_path):
    text = DEFAULT.read_text().replace("lr: 3.0e-3", "lr: 3e-3")
    assert "lr: 3e-3" in text and yaml.safe_load(text)["train"]["lr"] == "3e-3"   # what PyYAML does
    (tmp_path / "c.yaml").write_text(text)
    lr = LowprecConfig.from_yaml(tmp_path / "c.yaml").train.lr
    assert lr == 0.003 and isinstance(lr, float)


def _set(d: dict, dotted: str, value) -> dict:
    d = copy.deepcopy(d)
    *parents, last = dotted.split(".")
    node = d
    for p in parents:
        node = node[int(p)] if isinstance(node, list) else node.setdefault(p, {})
    if value is _DELETE:
        del node[last]
    else:
        node[last] = value
    return d


class _Delete:
    """The value that deletes a key (a stable repr: test ids must be the same in every worker)."""

    def __repr__(self) -> str:
        return "<deleted>"


_DELETE = _Delete()

# (key to set, value, the error's path, words in the message). A string where a number belongs in
# model.args cannot be caught at load (the factory's signature is only known once it is imported).
BAD = [
    ("train.lr", "fast", "train.lr", "expected a number, found the string 'fast'"),
    ("train.steps", "300", "train.steps", "write 300, without quotes"),
    ("train.steps", True, "train.steps", "found the boolean true"),
    ("train.steps", 1.5, "train.steps", "expected an integer"),
    ("train.steps", 0, "train.steps", ">= 1, found 0"),
    ("train.batch_size", 0, "train.batch_size", ">= 1"),
    ("train.microbatches", 3, "train.microbatches", "does not divide batch_size 16"),
    ("train.microbatches", 0, "train.microbatches", ">= 1"),
    ("train.lr", 0, "train.lr", "> 0"),
    ("train.lr", -1e-3, "train.lr", "> 0"),
    ("train.warmup", 0, "train.warmup", ">= 1"),
    ("train.ckpt_every", 0, "train.ckpt_every", ">= 1"),
    ("train.ckpt_keep", 0, "train.ckpt_keep", ">= 1"),
    ("train.log_every", 0, "train.log_every", ">= 1"),
    ("train.grad_clip", 0, "train.grad_clip", "or null"),
    ("train.weight_decay", "lots", "train.weight_decay", "found the string 'lots'"),
    ("train.lrr", 1e-3, "train.lrr", "Did you mean 'lr'"),
    ("train", [1], "train", "expected a mapping with keys steps, batch_size"),
    ("model", _DELETE, "model", "needs a `model:` section"),
    ("precision", _DELETE, "precision", "needs a `precision:` section"),
    ("model.factory", "build_gpt", "model.factory", "package.module:function"),
    ("model.factory", 3, "model.factory", "expected a string"),
    ("model.factory", _DELETE, "model.factory", "missing required key factory"),
    ("model.args", "n_layer=4", "model.args", "expected a mapping"),
    ("model.argz", {}, "model.argz", "Did you mean 'args'"),
    ("data.factory", "experiments/data.py", "data.factory", "package.module:function"),
    ("data.block_size", 0, "data.block_size", ">= 1"),
    ("data.block_size", "128", "data.block_size", "write 128"),
    ("data.blocksize", 128, "data.blocksize", "Did you mean 'block_size'"),
    ("eval.mode", "fsat", "eval.mode", "one of 'fast', 'full'"),
    ("eval.final_mode", "slow", "eval.final_mode", "one of 'fast', 'full'"),
    ("eval.every", -1, "eval.every", ">= 0"),
    ("eval.every", "150", "eval.every", "write 150"),
    ("eval.gates", "gates/nope.yaml", "eval.gates", "not found"),
    ("eval.evaluator", "", "eval.evaluator", "evaluator"),
    ("eval.high_precision", "yes", "eval.high_precision", "true or false"),
    ("eval.modee", "fast", "eval.modee", "Did you mean 'mode'"),
    ("tracking.experiment", "", "tracking.experiment", "experiment name"),
    ("tracking.enabled", "no", "tracking.enabled", "true or false"),
    ("tracking.uri", 5, "tracking.uri", "expected a string or null"),
    ("tracking.experimnt", "x", "tracking.experimnt", "Did you mean 'experiment'"),
    ("trian", {"steps": 1}, "trian", "Did you mean 'train'"),
    ("precision.backnd", "torch", "precision.backnd", "Did you mean 'backend'"),
    ("precision.rules.0.format", "fp9", "precision.rules[0].format", "unknown precision format 'fp9'"),
    ("precision.rules.0.select.glb", "x", "precision.rules[0].select.glb", "Did you mean 'glob'"),
    ("rollout.check_everyy", 10, "rollout", "Did you mean 'check_every'"),
    ("rollout.thresholds.spike_sigma", 6.0, "rollout.thresholds", "Did you mean 'spike_sigmas'"),
]


@pytest.mark.parametrize("key,value,path,words", BAD, ids=[f"{k}={v!r}" for k, v, _, _ in BAD])
def test_bad_config_names_the_path(key, value, path, words):
    with pytest.raises(ConfigError) as e:
        LowprecConfig.from_dict(_set(default_dict(), key, value), source=str(DEFAULT))
    assert e.value.path.startswith(path) and words in e.value.message, str(e.value)
    assert str(e.value).startswith(f"{e.value.path}: ")


def test_file_errors_name_the_file(tmp_path):
    def err(path) -> ConfigError:
        with pytest.raises(ConfigError) as e:
            LowprecConfig.from_yaml(path)
        assert e.value.path == str(path)
        return e.value

    assert "no such config file" in err(tmp_path / "missing.yaml").message
    assert "folder" in err(tmp_path).message
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    assert "not valid YAML" in err(tmp_path / "bad.yaml").message
    (tmp_path / "list.yaml").write_text("- model\n- precision\n")
    assert "expected a mapping with sections model, data" in err(tmp_path / "list.yaml").message
    (tmp_path / "empty.yaml").write_text("")
    assert "found null" in err(tmp_path / "empty.yaml").message
    (tmp_path / "evil.yaml").write_text('model: !!python/object/apply:os.system ["touch pwned"]\n')
    assert "safe loading refuses" in err(tmp_path / "evil.yaml").message
    assert not (tmp_path / "pwned").exists() and not (ROOT / "pwned").exists()
    (tmp_path / "latin.yaml").write_bytes(b"model: \xff\xfe\n")
    assert err(tmp_path / "latin.yaml").message


def test_gates_relative_to_the_config_folder_then_cwd(tmp_path, monkeypatch):
    d = default_dict()
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "my_gates.yaml").write_text("gates: []\n")
    d["eval"]["gates"] = "my_gates.yaml"
    (tmp_path / "cfg" / "run.yaml").write_text(yaml.safe_dump(d))
    assert LowprecConfig.from_yaml(tmp_path / "cfg" / "run.yaml").eval.gates == str(tmp_path / "cfg" / "my_gates.yaml")
    monkeypatch.chdir(tmp_path)
    d["eval"]["gates"] = "cfg/my_gates.yaml"   # not next to the config: found from the current folder
    assert LowprecConfig.from_dict(d).eval.gates == str(tmp_path / "cfg" / "my_gates.yaml")
    d["eval"]["gates"] = None
    assert LowprecConfig.from_dict(d).eval.gates is None


def test_a_plan_error_is_a_config_error():
    with pytest.raises(ConfigError):
        LowprecConfig.from_dict(_set(default_dict(), "precision.default", "fp9"))


def test_to_dict_round_trips():
    c = LowprecConfig.from_yaml(DEFAULT)
    if not HAS_ROLLOUT_CONFIG:   # the old rollout parser returns an object that is not plain data
        c = LowprecConfig.from_dict({k: v for k, v in default_dict().items() if k != "rollout"}, source=str(DEFAULT))
    d = c.to_dict()
    assert yaml.safe_load(yaml.safe_dump(d)) == d    # plain data
    assert LowprecConfig.from_dict(d) == c
    assert d["train"]["lr"] == 0.003 and d["eval"]["gates"] == "inloop"


# --- property: a default config with random keys replaced, added or removed loads or is a ConfigError ---

_junk = st.recursive(st.none() | st.booleans() | st.integers(-3, 400) | st.floats(allow_nan=True)
                     | st.sampled_from(["3e-3", "fast", "", "bf16", "fp8_tensorwise", "blocks.*", "a.b:c", "128"]),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
                     max_leaves=8)


def _paths(node, prefix=()) -> list[tuple]:
    out = [prefix] if prefix else []
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else ()
    for k, v in items:
        out += _paths(v, (*prefix, k))
    return out


_DEFAULT_PATHS = _paths(default_dict())


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(_DEFAULT_PATHS), st.sampled_from(["set", "del", "add"]), _junk,
                          st.sampled_from(["steps", "lr", "factory", "gates", "mode", "glob", "format", "x"])),
                max_size=3))
def test_mutated_configs_load_or_raise_config_error(edits):
    d = default_dict()
    for path, op, value, new_key in edits:
        parent = d
        try:
            for k in path[:-1]:
                parent = parent[k]
            if op == "set":
                parent[path[-1]] = value
            elif op == "del":
                del parent[path[-1]]
            elif isinstance(parent[path[-1]], dict):
                parent[path[-1]][new_key] = value
        except (KeyError, IndexError, TypeError):
            continue   # an earlier edit removed or replaced this path
    try:
        LowprecConfig.from_dict(d, source=str(DEFAULT))
    except ConfigError as e:
        assert e.path and str(e).startswith(f"{e.path}: ")


def test_eval_gates_by_name_or_path_and_data_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = tmp_path / "c.yaml"
    (tmp_path / "mine.yaml").write_text("gates: []\n")
    (tmp_path / "data").mkdir()
    base = "model: {factory: 'm:build'}\nprecision: {default: bf16}\n"
    for gates, want in [("inloop", "inloop"), ("mine.yaml", str(tmp_path / "mine.yaml")), (None, "inloop")]:
        cfg.write_text(base + (f"eval: {{gates: {gates}, data_dir: data}}\n" if gates else "eval: {}\n"))
        ev = LowprecConfig.from_yaml(cfg).eval
        assert ev.gates == want
        assert ev.data_dir == (str(tmp_path / "data") if gates else None)
    cfg.write_text(base + "eval: {data_dir: nowhere}\n")
    with pytest.raises(ConfigError, match=r"eval.data_dir: folder 'nowhere' not found.*Suites and eval data"):
        LowprecConfig.from_yaml(cfg)
