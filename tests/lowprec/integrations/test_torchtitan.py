"""lowprec's torchtitan model converter (`lowprec.integrations.torchtitan`) on torchtitan's
llama3 `debugmodel`, on CPU.

torchtitan's `Trainer` cannot run on a CPU-only machine (torchtitan 0.2.2 picks "cuda" as
its device type when no accelerator is found, then sets that device), so the run below
does what `torchtitan/train.py` does, with torchtitan's own parts: the job config parsed
by torchtitan's ConfigManager from a TOML file (the user's lines), the model built from
the llama3 train spec on the meta device, the converters built from torchtitan's registry
and applied before `to_empty` + `init_weights`, torchtitan's optimizers container with the
converters' `post_optimizer_hook` registered as its step post-hook, its lr schedulers and
its loss function. The data: real text (a Shakespeare play), one token per byte.
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
  keep_high_precision: [{fqns: [output]}]
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

# the lines a user adds, and what this CPU run needs besides
TOML = """\
[job]
custom_config_module = "lowprec.integrations.torchtitan"
[model]
name = "llama3"
flavor = "debugmodel"
converters = ["lowprec"]
[lowprec]
config = "{plan}"
event_log = "{events}"
[training]
seq_len = 64
local_batch_size = 2
steps = 12
max_norm = 1.0
[lr_scheduler]
warmup_steps = 2
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


def _job_config(tmp_path: Path, plan_text: str = PLAN_YAML):
    from torchtitan.config import ConfigManager
    plan = tmp_path / "precision.yaml"
    plan.write_text(plan_text)
    toml = tmp_path / "job.toml"
    toml.write_text(TOML.format(plan=plan, events=tmp_path / "events.jsonl"))
    return ConfigManager().parse_args(["--job.config_file", str(toml)])


def _batches(seq_len: int, batch: int):
    """Real text, one token per byte (the debug model's vocabulary is 2048): a Shakespeare play
    (fixed text: the run's decisions must not move when the repository's docs are edited)."""
    from eval_suites.corpora import clean_text, split_texts
    text = clean_text(split_texts()[0][0].read_bytes())
    ids = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    n = seq_len + 1
    rows = ids[: len(ids) // n * n].view(-1, n)
    for i in range(0, len(rows) - batch + 1, batch):
        r = rows[i:i + batch]
        yield r[:, :-1], r[:, 1:]


@pytest.mark.slow
def test_debugmodel_rollout_promotes_and_falls_back_on_overflow(titan, tmp_path):
    from torchtitan.distributed import ParallelDims
    from torchtitan.protocols.model_converter import build_model_converters
    from torchtitan.protocols.train_spec import get_train_spec

    from lowprec.policy.events import EventKind
    from lowprec.integrations.torchtitan import LowprecConverter
    from lowprec.sites.layers import PrecisionLinear

    torch.manual_seed(0)
    job = _job_config(tmp_path)
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=1, pp=1, ep=1, etp=1, world_size=1)
    spec = get_train_spec(job.model.name)
    args = spec.model_args[job.model.flavor]
    args.update_from_config(job)
    with torch.device("meta"):
        model = spec.model_cls(args)
    converters = build_model_converters(job, dims)          # from torchtitan's registry, by name
    (conv,) = converters.converters
    assert isinstance(conv, LowprecConverter)
    converters.convert(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    parts = [model]
    optimizers = spec.build_optimizers_fn(parts, job.optimizer, dims)
    schedulers = spec.build_lr_schedulers_fn(optimizers, job.lr_scheduler, job.training.steps)
    optimizers.register_step_post_hook(lambda *a, **k: converters.post_optimizer_hook(parts))
    loss_fn = spec.build_loss_fn(job, parallel_dims=dims)

    linears = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    planned = {n for n in linears if n.startswith("layers.")}
    assert len(planned) == 6 * 7 and all(isinstance(linears[n], PrecisionLinear) for n in planned)
    assert not isinstance(linears["output"], PrecisionLinear)   # kept in high precision
    assert set(conv.state.formats()) == planned
    assert set(conv.state.formats().values()) == {"bf16"}        # the plan's starting format
    ladder = conv.state.sites[INJECTED].ladder
    assert [f.name for f in ladder] == ["fp8_delayed", "bf16"]

    formats_after: dict[int, dict[str, str]] = {}
    losses = []
    data = _batches(job.training.seq_len, job.training.local_batch_size)
    for step in range(job.training.steps):
        if step == INJECT_AT:
            with torch.no_grad():   # an overflow: this weight jumps far past its amax history
                conv.state.sites[INJECTED].module.weight.mul_(64.0)
        x, y = next(data)
        optimizers.zero_grad()
        loss = loss_fn(model(x), y)
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


def test_converter_refuses_what_the_protocol_cannot_carry(titan, tmp_path):
    from lowprec.integrations.torchtitan import LowprecConverter, load_config
    rewind = PLAN_YAML.replace("attribution: {replay: false}", "rewind: true")
    with pytest.raises(ConfigError, match=r"rollout\.rewind\.enabled.*set `rewind: false`"):
        LowprecConverter(_job_config(tmp_path, rewind), None)
    gap = PLAN_YAML.replace("site_patience: 1}", "site_patience: 1, loss_gap: 0.03}\n  baseline: {losses: b.json}")
    p = tmp_path / "gap.yaml"
    p.write_text(gap)
    with pytest.raises(ConfigError, match=r"loss_gap.*never reaches the converter"):
        load_config(p)
    bad = PLAN_YAML.replace("format: fp8_delayed}", "format: fp8_delayd}", 1)
    with pytest.raises(ConfigError, match=r"fp8_delayd"):
        LowprecConverter(_job_config(tmp_path, bad), None)


def test_converter_without_the_config_section_says_how_to_add_it(titan):
    from torchtitan.config import JobConfig

    from lowprec.integrations.torchtitan import LowprecConverter
    with pytest.raises(ConfigError, match=r"custom_config_module = \"lowprec\.integrations\.torchtitan\""):
        LowprecConverter(JobConfig(), None)


def test_import_without_torchtitan_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "torchtitan", None)   # as if not installed
    monkeypatch.delitem(sys.modules, "lowprec.integrations.torchtitan", raising=False)
    with pytest.raises(MissingExtraError, match=r"pip install 'lowprec\[torchtitan\]'"):
        importlib.import_module("lowprec.integrations.torchtitan")
