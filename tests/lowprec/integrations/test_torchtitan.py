"""lowprec's torchtitan converter (`lowprec.integrations.torchtitan`, torchtitan 0.3) on
torchtitan's llama3 `debugmodel`, on CPU.

torchtitan's `Trainer` cannot run on a CPU-only machine (it picks "cuda" as its device type
when no accelerator is found, then sets that device), so the run below does what
`Trainer.__init__` and `train_step` do, with torchtitan's own parts: the job config parsed by
torchtitan's ConfigManager from a user's config-registry module (`--module`, `--config`: the
lines a user writes), the model config updated from the job and built on the meta device
(the converters already applied by `model_registry`), torchtitan's Module-protocol check,
`to_empty` + `init_weights`, torchtitan's optimizers container, the model spec's
`post_optimizer_build_fn`, its lr schedulers and its loss. One thing this CPU run needs
besides: FlexAttention has no backward on CPU, so the layers' attention is swapped for
torchtitan's SDPA module, as torchtitan's own CPU-capable tests do. The data: real text (a
Shakespeare play), one token per byte.
"""

from __future__ import annotations

import importlib
import math
import sys
from pathlib import Path

import pytest
import torch

from lowprec.base.parse import ConfigError
from lowprec.integrations.extras import MissingExtraError


PLAN_YAML = """\
precision:
  backend: emulated
  default: bf16
  keep_high_precision: [{fqns: [lm_head]}]
  rules:
    - {name: blocks, select: {glob: "layers.*"}, format: bf16, ladder: [fp8_delayed, bf16]}
rollout:
  check_every: 2
  min_steps: 2
  cooldown_steps: 1000
  attribution: {replay: false}
  thresholds: {max_saturated_frac: 0.05, site_patience: 1}
  stages:
    - {name: mlp_fp8, select: {glob: "layers.*.feed_forward.*"}, format: fp8_delayed}
    - {name: attn_fp8, select: {glob: "layers.*.attention.*"}, format: fp8_delayed}
"""

# the lines a user writes (a config-registry module), and what this CPU run needs besides
CONFIGS = """\
from torchtitan.models.common.attention import ScaledDotProductAttention
from torchtitan.models.llama3 import model_registry
from torchtitan.models.llama3.config_registry import llama3_debugmodel

from lowprec.integrations.torchtitan import LowprecConverter, with_rollout


def llama3_debugmodel_lowprec():
    config = llama3_debugmodel()
    config.model_spec = with_rollout(model_registry("debugmodel", converters=[
        LowprecConverter.Config(config="{plan}", event_log="{events}")]))
    # this CPU run: FlexAttention has no backward on CPU
    for layer in config.model_spec.model.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    config.training.seq_len, config.training.local_batch_size, config.training.steps = 64, 2, 12
    config.training.max_norm = 1.0
    return config
"""

# check_every 2: the checks are steps 1, 3, 5, 7, 9, 11. The overflow is injected between
# checks, where the layers count, with full statistics off, the steps in which a delayed-
# scaling operand saturated (`PrecisionLinear.overflow_steps`); the next check reads them.
INJECT_AT = 8
CHECK_AFTER = 9
INJECTED = "layers.1.feed_forward.w2"


@pytest.fixture
def titan():
    return pytest.importorskip("torchtitan", reason="torchtitan is not installed (pip install 'lowprec[torchtitan]')")


def _job_config(tmp_path: Path, monkeypatch, plan_text: str = PLAN_YAML):
    """The job, as `torchtitan.train --module lowprec_configs --config llama3_debugmodel_lowprec` parses it."""
    from torchtitan.config import ConfigManager
    plan = tmp_path / "precision.yaml"
    plan.write_text(plan_text)
    (tmp_path / "lowprec_configs.py").write_text(CONFIGS.format(plan=plan, events=tmp_path / "events.jsonl"))
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "lowprec_configs", raising=False)
    return ConfigManager().parse_args(["--module", "lowprec_configs", "--config", "llama3_debugmodel_lowprec"])


def _batches(seq_len: int, batch: int):
    """Real text, one token per byte (the debug model's vocabulary is 2048): a Shakespeare play
    (fixed text: the run's decisions must not move when the repository's docs are edited)."""
    from lowprec.evals.corpora import clean_text, split_texts
    text = clean_text(split_texts()[0][0].read_bytes())
    ids = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    n = seq_len + 1
    rows = ids[: len(ids) // n * n].view(-1, n)
    for i in range(0, len(rows) - batch + 1, batch):
        r = rows[i:i + batch]
        yield r[:, :-1], r[:, 1:]


@pytest.mark.slow
def test_debugmodel_rollout_promotes_and_falls_back_on_overflow(titan, tmp_path, monkeypatch):
    from torchtitan.components.loss import ChunkedLossWrapper
    from torchtitan.distributed import ParallelDims

    from lowprec.integrations.torchtitan import TitanPrecisionLinear, rollout_of
    from lowprec.policy.events import EventKind

    torch.manual_seed(0)
    job = _job_config(tmp_path, monkeypatch)
    dims = ParallelDims.from_config(job.parallelism, world_size=1)
    spec = job.model_spec
    model_config = spec.model
    model_config.update_from_config(config=job)
    with torch.device("meta"):
        model = model_config.build()        # the converters ran in model_registry, on the config tree
    model.verify_module_protocol()          # every layer is a torchtitan Module, lowprec's included
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    parts = [model]
    optimizers = job.optimizer.build(model_parts=parts)
    spec.post_optimizer_build_fn(optimizers, parts, dims)     # with_rollout's: lowprec registers its hook
    schedulers = job.lr_scheduler.build(optimizers=optimizers, training_steps=job.training.steps)
    loss_fn = job.loss.build(compile_config=job.compile)
    if isinstance(loss_fn, ChunkedLossWrapper):   # as Trainer.__init__ does
        loss_fn.set_lm_head(model.lm_head)
        model._skip_lm_head = True
    conv = rollout_of(model)

    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    planned = {n for n in linears if n.startswith("layers.")}
    assert len(planned) == 6 * 5 and all(isinstance(linears[n], TitanPrecisionLinear) for n in planned)
    assert not isinstance(linears["lm_head"], TitanPrecisionLinear)   # kept in high precision
    assert set(conv.state.formats()) == planned
    assert set(conv.state.formats().values()) == {"bf16"}        # the plan's starting format
    ladder = conv.state.sites[INJECTED].ladder
    assert [f.name for f in ladder] == ["fp8_delayed", "bf16"]
    # torchtitan's init_weights initialized lowprec's layers with the replaced layers' param_init
    w = conv.state.sites["layers.0.feed_forward.w1"].module.weight
    assert abs(w.std().item() - 0.02) < 0.002, w.std().item()

    formats_after: dict[int, dict[str, str]] = {}
    losses = []
    data = _batches(job.training.seq_len, job.training.local_batch_size)
    for step in range(job.training.steps):
        if step == INJECT_AT:
            with torch.no_grad():   # an overflow: this weight jumps far past its amax history
                conv.state.sites[INJECTED].module.weight.mul_(64.0)
        x, y = next(data)
        positions = torch.arange(x.shape[1]).expand_as(x)
        optimizers.zero_grad()
        loss, _ = loss_fn(model(x, positions=positions), y, torch.tensor(y.numel()), positions=positions)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), job.training.max_norm)
        optimizers.step()          # the post-hook: lowprec concludes the step
        schedulers.step()
        losses.append(loss.item())
        formats_after[step] = dict(conv.state.formats())
    conv.close()

    assert conv.step == job.training.steps
    assert all(math.isfinite(v) for v in losses), losses
    mlp = {n for n in planned if ".feed_forward." in n}
    attn = planned - mlp
    promotions = [e for e in conv.events if e.kind == EventKind.PROMOTE]
    assert [e.stage for e in promotions] == ["mlp_fp8", "attn_fp8"]
    # min_steps 2 and checks every 2 steps: the MLPs at step 3, the attention at step 5
    assert promotions[0].step == 3 and promotions[1].step == 5
    assert {formats_after[2][n] for n in mlp} == {"bf16"}
    assert {formats_after[3][n] for n in mlp} == {"fp8_delayed"}
    assert {formats_after[4][n] for n in attn} == {"bf16"}
    assert {formats_after[5][n] for n in planned} == {"fp8_delayed"}
    # the injected overflow: the site saturates its own weight and falls back at that check
    fallbacks = [e for e in conv.events if e.kind == EventKind.FALLBACK]
    assert [(e.step, e.sites) for e in fallbacks] == [(CHECK_AFTER, (INJECTED,))], [e.summary() for e in fallbacks]
    assert fallbacks[0].evidence.get("weight/overflow_steps", 0) >= 1, fallbacks[0].evidence
    assert formats_after[INJECT_AT][INJECTED] == "fp8_delayed"
    assert formats_after[CHECK_AFTER][INJECTED] == "bf16"
    assert formats_after[job.training.steps - 1][INJECTED] == "bf16"   # cooldown 1000: no retry yet
    # the event log the [lowprec] section named holds the same events
    logged = (tmp_path / "events.jsonl").read_text().splitlines()
    assert len(logged) == len(conv.events) >= 3


def test_converter_refuses_what_the_protocol_cannot_carry(titan, tmp_path, monkeypatch):
    from lowprec.integrations.torchtitan import load_config
    rewind = PLAN_YAML.replace("attribution: {replay: false}", "rewind: true")
    with pytest.raises(ConfigError, match=r"rollout\.rewind\.enabled.*set `rewind: false`"):
        _job_config(tmp_path, monkeypatch, rewind)      # at start: when torchtitan reads the job
    gap = PLAN_YAML.replace("site_patience: 1}", "site_patience: 1, loss_gap: 0.03}\n  baseline: {losses: b.json}")
    p = tmp_path / "gap.yaml"
    p.write_text(gap)
    with pytest.raises(ConfigError, match=r"loss_gap.*never reaches the converter"):
        load_config(p)
    te = tmp_path / "te.yaml"
    te.write_text(PLAN_YAML.replace("backend: emulated", "backend: te"))
    with pytest.raises(ConfigError, match=r"precision\.backend.*torchtitan Modules.*backend: emulated"):
        load_config(te)
    bad = PLAN_YAML.replace("format: fp8_delayed}", "format: fp8_delayd}", 1)
    with pytest.raises(ConfigError, match=r"fp8_delayd") as e:
        _job_config(tmp_path, monkeypatch, bad)
    assert str(tmp_path / "precision.yaml") in str(e.value)   # which file the key is in


def test_pipeline_parallelism_and_a_missing_hook_are_refused(titan, tmp_path):
    """A rollout under pipeline parallelism is refused when torchtitan builds the optimizers;
    a model that trains without with_rollout's hook stops at its first forward."""
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import model_registry

    from lowprec.integrations.torchtitan import LowprecConverter, post_optimizer_build_fn
    plan = tmp_path / "precision.yaml"
    plan.write_text(PLAN_YAML)
    spec = model_registry("debugmodel", converters=[LowprecConverter.Config(config=str(plan))])
    assert spec.post_optimizer_build_fn is None    # the user did not wrap it with with_rollout
    model = spec.model.build()
    pp = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=2, ep=1, world_size=2)
    with pytest.raises(ConfigError, match=r"pipeline_parallel_degree.*degree 1"):
        post_optimizer_build_fn(torch.optim.SGD(model.parameters(), lr=0.1), [model], pp)
    with pytest.raises(RuntimeError, match=r"never attached.*with_rollout"):
        model(torch.zeros(1, 8, dtype=torch.long))


def test_import_without_torchtitan_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchtitan", None)   # as if not installed
    monkeypatch.delitem(sys.modules, "lowprec.integrations.torchtitan", raising=False)
    with pytest.raises(MissingExtraError, match=r"pip install 'lowprec\[torchtitan\]'"):
        importlib.import_module("lowprec.integrations.torchtitan")


def test_import_with_a_torchtitan_without_the_03_protocol_names_the_supported_versions(titan, monkeypatch):
    monkeypatch.setitem(sys.modules, "torchtitan.protocols.model", None)   # as torchtitan 0.2, which lacks it
    monkeypatch.delitem(sys.modules, "lowprec.integrations.torchtitan", raising=False)
    with pytest.raises(MissingExtraError, match=r"torchtitan 0\.3\.x.*torchtitan>=0\.3,<0\.4"):
        importlib.import_module("lowprec.integrations.torchtitan")
