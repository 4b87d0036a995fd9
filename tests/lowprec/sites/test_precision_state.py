"""prepare / PrecisionState on a small GPT trained on real text: switching and resuming."""

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from experiments.model import build_gpt
from lowprec import prepare
from lowprec.sites.plan import PrecisionPlan
from small_gpt import MODEL, batches, corpus_bytes

ROOT = Path(__file__).resolve().parents[3]
PLAN = {
    "backend": "emulated",
    "keep_high_precision": [{"fqns": ["lm_head"]}],
    "rules": [{"name": "all", "select": {"glob": "blocks.*"}, "format": "fp8_tensorwise",
               "ladder": ["fp8_tensorwise", "bf16"]}],
}


def test_prepare_swaps_linears_and_keeps_parameter_objects():
    torch.manual_seed(0)
    model = build_gpt(**MODEL)
    params_before = {n: p for n, p in model.named_parameters()}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)  # created BEFORE prepare
    state = prepare(model, PrecisionPlan.from_dict(PLAN))
    assert set(state.sites) == {f"blocks.{i}.{m}" for i in range(2)
                                for m in ("attn.qkv", "attn.proj", "mlp.fc", "mlp.proj")}
    assert "lm_head" in state.kept_high_precision
    for n, p in model.named_parameters():
        assert p is params_before[n], n
    x, y = next(batches(corpus_bytes(), 1))
    _, loss = model(x, y)
    loss.backward()
    w = model.blocks[0].mlp.fc.weight
    before = w.detach().clone()
    opt.step()
    assert not torch.equal(before, w.detach())  # the old optimizer updates the live weights


def test_switch_bf16_fp8_fp4_bf16_keeps_params_and_optimizer_state():
    """Two identical models; one switches a site bf16 -> fp8 -> nvfp4 -> bf16 during
    training. Parameters and optimizer state stay the same objects, and afterwards its
    BF16 outputs equal those of a model that never switched, given equal weights."""
    tokens = corpus_bytes()
    torch.manual_seed(0)
    model = build_gpt(**MODEL)
    state = prepare(model, PrecisionPlan.from_dict({**PLAN, "rules": [{**PLAN["rules"][0], "format": "bf16",
                                                                       "ladder": ["bf16"]}]}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    site = "blocks.1.mlp.fc"
    w = state.site(site).module.weight
    for step, (x, y) in enumerate(batches(tokens, 8)):
        state.set_format(site, ["bf16", "fp8_tensorwise", "nvfp4", "bf16"][step // 2])
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        assert state.site(site).module.weight is w
        assert opt.state[w]["exp_avg"] is opt.state[w]["exp_avg"]
    exp_avg = opt.state[w]["exp_avg"]
    assert state.formats()[site] == "bf16"

    torch.manual_seed(0)
    never = build_gpt(**MODEL)
    prepare(never, PrecisionPlan.from_dict({**PLAN, "rules": [{**PLAN["rules"][0], "format": "bf16",
                                                               "ladder": ["bf16"]}]}))
    never.load_state_dict(model.state_dict())
    x, _ = next(batches(tokens, 1, seed=5))
    assert torch.equal(model(x), never(x))
    assert opt.state[w]["exp_avg"] is exp_avg and opt.state[w]["step"].item() == 8


def test_high_precision_context_restores_formats():
    model = build_gpt(**MODEL)
    state = prepare(model, PrecisionPlan.from_dict(PLAN))
    before = state.formats()
    with state.high_precision():
        assert set(state.formats().values()) == {"bf16"}
    assert state.formats() == before


def test_set_format_refuses_activation_blocks_that_do_not_divide_like_the_plan():
    """mxfp8's 1x32 weight blocks fit a (48, 64) weight, but its grad_output blocks (1x32
    over out = 48) do not: set_format refuses it with the plan's message, before it
    switches any of the sites it was given (here "0" fits and comes first)."""
    from lowprec.sites.plan import PlanError
    from lowprec.sites.resolution import resolve

    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 48))
    state = prepare(model, PrecisionPlan.from_dict({"backend": "emulated"}))  # bf16 everywhere
    with pytest.raises(ValueError) as e:
        state.set_format(["0", "1"], "mxfp8")
    assert state.formats() == {"0": "bf16", "1": "bf16"}
    runtime = str(e.value)
    assert runtime.startswith("layer '1' (weight 48 x 64, out x in) cannot run mxfp8: its grad_output "
                              "(tokens x out) of shape (1, 48) does not fit e4m3 blocks of 1x32")
    with pytest.raises(PlanError) as plan_time:  # the same check and words when planned
        resolve(nn.Sequential(nn.Linear(64, 48)), PrecisionPlan.from_dict(
            {"rules": [{"select": {"glob": "0"}, "format": "mxfp8"}]}))
    assert runtime.replace("layer '1'", "layer '0'") in str(plan_time.value)
    assert state.set_format(["0"], "mxfp8") == ["0"]  # a layer that fits switches


def test_state_dict_loads_with_weights_only(tmp_path):
    model = build_gpt(**MODEL)
    plan = dict(PLAN, rules=[dict(PLAN["rules"][0], format="fp8_delayed",
                                  ladder=["fp8_delayed", "bf16"])])
    state = prepare(model, PrecisionPlan.from_dict(plan))
    x, y = next(batches(corpus_bytes(), 1))
    model(x, y)[1].backward()
    state.set_format("blocks.0.mlp.fc", "bf16")
    torch.save(state.state_dict(), tmp_path / "p.pt")
    loaded = torch.load(tmp_path / "p.pt", weights_only=True)
    model2 = build_gpt(**MODEL)
    state2 = prepare(model2, PrecisionPlan.from_dict(plan))
    state2.load_state_dict(loaded)
    assert state2.formats() == state.formats()
    h1 = state.site("blocks.1.mlp.fc").module.histories["input"]
    h2 = state2.site("blocks.1.mlp.fc").module.histories["input"]
    assert torch.equal(h1.history, h2.history) and h1.count.item() == h2.count.item() == 1


RESUME_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {root!r}); sys.path.insert(0, {tests!r}); sys.path.insert(0, {here!r})
    from small_gpt import MODEL, batches, corpus_bytes
    from test_precision_state import PLAN
    from experiments.model import build_gpt
    from lowprec import prepare
    from lowprec.sites.plan import PrecisionPlan
    mode, ckpt = sys.argv[1], sys.argv[2]
    plan = dict(PLAN, rules=[dict(PLAN["rules"][0], format="nvfp4",  # stochastic rounding too
                                  ladder=["nvfp4", "fp8_tensorwise", "bf16"])])
    torch.manual_seed(0)
    model = build_gpt(**MODEL)
    state = prepare(model, PrecisionPlan.from_dict(plan), seed=3)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = list(batches(corpus_bytes(), 30))
    start = 0
    if mode == "resume":
        ck = torch.load(ckpt, weights_only=True)
        model.load_state_dict(ck["model"]); opt.load_state_dict(ck["optim"])
        state.load_state_dict(ck["precision"]); torch.set_rng_state(ck["rng"]); start = ck["step"]
    losses = []
    for step in range(start, 30):
        if mode == "full" and step == 10:
            torch.save({{"model": model.state_dict(), "optim": opt.state_dict(),
                        "precision": state.state_dict(), "rng": torch.get_rng_state(), "step": step}}, ckpt)
        if step == 15:
            state.set_format("blocks.0.attn.qkv", "fp8_tensorwise")
        x, y = data[step]
        opt.zero_grad(); _, loss = model(x, y); loss.backward(); opt.step()
        if step >= 10:
            losses.append(loss.item())
    print(" ".join(repr(v) for v in losses))
""")


@pytest.mark.slow   # two fresh processes, each importing torch and training 20 steps
def test_checkpoint_resumes_bit_identically_in_a_fresh_process(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(RESUME_SCRIPT.format(root=str(ROOT), tests=str(Path(__file__).parents[1]),
                                            here=str(Path(__file__).parent)))
    ckpt = str(tmp_path / "ckpt.pt")

    def run(mode):
        out = subprocess.run([sys.executable, str(script), mode, ckpt], capture_output=True, text=True,
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        return [float(v) for v in out.stdout.split()]

    full = run("full")
    resumed = run("resume")
    assert len(full) == len(resumed) == 20
    assert full == resumed  # bit-identical: same floats, not merely close


def test_flops_share_is_one_rounding_of_the_exact_fraction():
    """16 sites of 18 FLOPs per token in FP8 and one of 12 in BF16: summing the sites' shares
    (0.06 each) gives 0.9600000000000004; the share is 288/300, rounded once."""
    model = nn.Sequential(*[nn.Linear(3, 1, bias=False) for _ in range(16)], nn.Linear(2, 1, bias=False))
    plan = {"backend": "emulated", "default": "bf16",
            "rules": [{"name": "fp8", "select": {"regex": r"^([0-9]|1[0-5])$"}, "format": "fp8_tensorwise"}]}
    state = prepare(model, PrecisionPlan.from_dict(plan))
    assert sum([18 / 300] * 16) == 0.9600000000000004
    share = state.flops_share()
    assert share == {"fp8_tensorwise": 288 / 300, "bf16": 12 / 300} and str(share["fp8_tensorwise"]) == "0.96"
