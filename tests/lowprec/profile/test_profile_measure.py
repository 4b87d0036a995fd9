"""profile_sites on a small GPT on real text, checked against independent recomputations:
SQNR from PyTorch's own float8 cast, loss change and gradient cosine from plain
forward/backward runs, formats and stats restored, repeatability, sampling by role."""

from __future__ import annotations

import math

import pytest
import torch

from experiments.model import build_gpt
from lowprec import prepare
from lowprec.sites.plan import PrecisionPlan
from lowprec.profile.measure import Profile, SiteCost, profile_sites, sample_sites, site_role
from small_gpt import batches, corpus_bytes

MODEL = dict(vocab_size=256, block_size=32, n_layer=2, n_head=2, d_model=64)
PLAN = {
    "backend": "emulated",
    "keep_high_precision": [{"fqns": ["lm_head"]}],
    "rules": [{"name": "all", "select": {"glob": "blocks.*"}, "format": "bf16",
               "ladder": ["nvfp4", "fp8_tensorwise", "bf16"]}],
}
SITE = "blocks.1.mlp.fc"
E4M3_MAX = 448.0


def _setup(seed=0):
    torch.manual_seed(seed)
    model = build_gpt(**MODEL)
    state = prepare(model, PrecisionPlan.from_dict(PLAN))
    held = list(batches(corpus_bytes(), 2, batch=4, t=32, seed=1))
    return model, state, held


def _loss_and_grads(model, held):
    model.zero_grad(set_to_none=True)
    total = 0.0
    for x, y in held:
        _, loss = model(x, y)
        (loss / len(held)).backward()
        total += float(loss.detach())
    grads = [p.grad.detach().double().flatten() if p.grad is not None
             else torch.zeros(p.numel(), dtype=torch.float64)
             for p in model.parameters() if p.requires_grad]
    model.zero_grad(set_to_none=True)
    return total / len(held), grads


def _cos(a, b):
    return float(a @ b / (a.norm() * b.norm()))


@pytest.fixture(scope="module")
def profiled():
    model, state, held = _setup()
    formats = {f: ["fp8_tensorwise", "nvfp4"] for f in state.sites}
    prof = profile_sites(model, state, held, formats=formats)
    return model, state, held, formats, prof


def _noise_ratio_torch(tensors, dtype, fmax):
    """sum err^2 / sum x^2 over `tensors`, each cast to `dtype` by torch with its own tensor scale."""
    signal = error = 0.0
    for x in tensors:
        scale = fmax / x.abs().amax()
        q = (x.float() * scale).to(dtype).float() / scale
        signal += float(x.double().pow(2).sum())
        error += float((q.double() - x.double()).pow(2).sum())
    return error / signal


def _site_inputs(model, module, held):
    """The inputs `module` sees in an all-BF16 forward over `held`."""
    captured = []
    hook = module.register_forward_hook(lambda m, args, out: captured.append(args[0].detach().clone()))
    try:
        with torch.no_grad():
            for x, y in held:
                model(x, y)
    finally:
        hook.remove()
    return captured


def test_input_sqnr_equals_torch_float8_cast(profiled):
    model, state, held, _, prof = profiled
    captured = _site_inputs(model, state.site(SITE).module, held)
    assert len(captured) == len(held)
    signal = error = 0.0
    for x in captured:   # the fp32 input, quantized as is (no BF16 rounding before the cast)
        x = x.float().reshape(-1, x.shape[-1])
        scale = E4M3_MAX / x.abs().amax()
        q = (x * scale).to(torch.float8_e4m3fn).float() / scale
        signal += float(x.double().pow(2).sum())
        error += float((q.double() - x.double()).pow(2).sum())
    expected = 10 * math.log10(signal / error)
    got = prof.entry(SITE, "fp8_tensorwise").sqnr_db["input"]
    assert got == pytest.approx(expected, abs=0.05)
    assert 20 < got < 40   # E4M3 with a tensor scale: ~30 dB on activations, not a vacuous match
    assert set(prof.entry(SITE, "fp8_tensorwise").sqnr_db) == {"input", "weight", "grad_output"}


@pytest.mark.parametrize("fmt", ["fp8_tensorwise", "nvfp4"])
def test_loss_delta_and_grad_cosine_equal_a_recomputation(profiled, fmt):
    model, state, held, _, prof = profiled
    saved = state.scaling_state()
    ref_loss, ref = _loss_and_grads(model, held)
    state.set_format(SITE, fmt)
    try:
        loss, g = _loss_and_grads(model, held)
    finally:
        state.set_format(SITE, "bf16")
        state.load_scaling_state(saved)
    e = prof.entry(SITE, fmt)
    assert prof.reference_loss == pytest.approx(ref_loss, rel=1e-6)
    assert e.loss_delta == pytest.approx((loss - ref_loss) / ref_loss, rel=1e-3, abs=1e-7)
    assert e.grad_cosine == pytest.approx(_cos(torch.cat(g), torch.cat(ref)), abs=1e-7)
    # per parameter tensor, mean weighted by the tensors' sizes (no tensor here has a zero gradient)
    per_tensor = sum(a.numel() * _cos(a, b) for a, b in zip(g, ref)) / sum(a.numel() for a in g)
    assert e.grad_cosine_tensors == pytest.approx(per_tensor, abs=1e-7)
    assert e.grad_cosine_tensors < e.grad_cosine < 1.0   # the site's own weight turns most
    noise = 10 ** (-e.sqnr_db["input"] / 10) + 10 ** (-e.sqnr_db["weight"] / 10)
    assert e.forward_noise == pytest.approx(noise)
    assert e.sensitivity == pytest.approx(noise + max(e.loss_delta, 0.0) + 1 - e.grad_cosine_tensors)
    bits = 8 if fmt == "fp8_tensorwise" else 4
    assert e.per_flop_saved == pytest.approx(e.sensitivity / (e.flop_share * (1 - bits / 16)))


def test_every_pair_profiled_with_flop_shares(profiled):
    _, state, held, formats, prof = profiled
    assert {(e.fqn, e.format) for e in prof.entries} == {(f, x) for f in state.sites for x in formats[f]}
    assert all(e.estimated_from is None for e in prof.entries)
    shares = {e.fqn: e.flop_share for e in prof.entries}
    total = sum(s.flops_per_token for s in state.sites.values())
    for f, s in state.sites.items():
        assert shares[f] == pytest.approx(s.flops_per_token / total)
    assert prof.passes_per_rank == len(held) * (1 + len(prof.entries))
    assert prof.world == 1 and prof.batches == len(held) and prof.tokens_per_batch == held[0][0].numel()
    # FP4 costs more accuracy than FP8 at the same site (on average over the sites)
    mean = {fmt: sum(e.sensitivity for e in prof.entries if e.format == fmt) / len(state.sites)
            for fmt in ("nvfp4", "fp8_tensorwise")}
    assert mean["nvfp4"] > mean["fp8_tensorwise"] > 0


@pytest.mark.slow   # over 10 s: in make test, not in the fast subset
def test_formats_and_stats_restored_and_profile_repeats():
    model, state, held = _setup()
    state.set_format("blocks.0.attn.qkv", "fp8_tensorwise")
    state.collect_stats(False)
    state.site("blocks.1.mlp.proj").module.collect_stats = True
    before = {f: (s.format.name, s.module.collect_stats) for f, s in state.sites.items()}
    generators = {f: s.module.generator.get_state() for f, s in state.sites.items()}
    formats = {f: ["fp8_tensorwise", "nvfp4"] for f in state.sites}   # the last pair draws random bits
    first = profile_sites(model, state, held, formats=formats)
    assert {f: (s.format.name, s.module.collect_stats) for f, s in state.sites.items()} == before
    for f, s in state.sites.items():   # the stochastic-rounding streams are where they were
        assert torch.equal(s.module.generator.get_state(), generators[f]), f
    second = profile_sites(model, state, held, formats=formats)
    assert [e.to_dict() for e in first.entries] == [e.to_dict() for e in second.entries]
    # the profile starts every site from bf16, whatever format it was in
    assert first.entry("blocks.0.attn.qkv", "fp8_tensorwise").loss_delta != 0


def test_profile_round_trips_through_dict(profiled):
    prof = profiled[-1]
    back = Profile.from_dict(prof.to_dict())
    assert back == prof


def test_sample_sites_roles_spacing_and_nearest():
    fqns = [f"blocks.{i}.{m}" for i in range(7) for m in ("attn.qkv", "mlp.fc")] + ["head"]
    assert site_role("blocks.12.mlp.fc") == "blocks.*.mlp.fc" and site_role("head") == "head"
    with pytest.raises(ValueError, match="--sample 2 is fewer than the 3 roles"):
        sample_sites(fqns, 2)
    stand = sample_sites(fqns, 7)   # 1 for head, 3 each for the two roles of 7 blocks
    assert set(stand) == set(fqns) and stand["head"] == "head"
    for role in ("attn.qkv", "mlp.fc"):
        members = [f"blocks.{i}.{role}" for i in range(7)]
        picks = sorted({stand[f] for f in members}, key=lambda f: int(f.split(".")[1]))
        blocks = [int(p.split(".")[1]) for p in picks]
        assert len(picks) == 3 and blocks[0] == 0 and blocks[-1] == 6
        gaps = [b - a for a, b in zip(blocks, blocks[1:])]
        assert max(gaps) - min(gaps) <= 1
        for p in picks:
            assert stand[p] == p
        for i, f in enumerate(members):
            assert site_role(stand[f]) == site_role(f)
            d = abs(int(stand[f].split(".")[1]) - i)
            assert d == min(abs(b - i) for b in blocks)
    one = sample_sites(fqns, 3)   # one per role: the middle block
    assert one["blocks.0.mlp.fc"] == "blocks.3.mlp.fc" and one["blocks.6.attn.qkv"] == "blocks.3.attn.qkv"
    assert sample_sites(fqns, 100) == {f: f for f in fqns}


@pytest.mark.slow   # over 10 s: in make test, not in the fast subset
def test_sampled_profile_estimates_the_rest(profiled):
    model, state, held, formats, full = profiled
    prof = profile_sites(model, state, held, formats=formats, sample=4)   # 4 roles, one each
    stand = sample_sites(list(state.sites), 4)
    profiled_sites = {f for f in state.sites if stand[f] == f}
    assert prof.sampled == len(profiled_sites) == 4
    assert prof.passes_per_rank == len(held) * (1 + 2 * len(profiled_sites))
    assert {(e.fqn, e.format) for e in prof.entries} == {(e.fqn, e.format) for e in full.entries}
    for e in prof.entries:
        own = full.entry(e.fqn, e.format)
        assert e.flop_share == own.flop_share
        if e.fqn in profiled_sites:
            assert e.estimated_from is None
            assert e.to_dict() == own.to_dict()
        else:
            assert e.estimated_from == stand[e.fqn]
            src = full.entry(stand[e.fqn], e.format)
            assert (e.loss_delta, e.grad_cosine, e.sqnr_db) == (src.loss_delta, src.grad_cosine, src.sqnr_db)


def test_non_finite_loss_is_infinitely_sensitive():
    base = dict(fqn="a", format="fp8_tensorwise", flop_share=0.5)
    assert SiteCost(**base, loss_delta=math.nan, grad_cosine=0.9).sensitivity == math.inf
    assert SiteCost(**base, loss_delta=math.inf, grad_cosine=0.9).sensitivity == math.inf
    assert SiteCost(**base, loss_delta=0.1, grad_cosine=math.nan).per_flop_saved == math.inf
    assert SiteCost(**base, loss_delta=0.1, grad_cosine=0.9, grad_cosine_tensors=math.nan).sensitivity == math.inf
    assert SiteCost(**base, loss_delta=-0.1, grad_cosine=0.99, grad_cosine_tensors=0.9).sensitivity == pytest.approx(0.1)
    # an operand whose SQNR could not be measured (NaN) is no free pass; an exact one (inf dB) adds nothing
    assert SiteCost(**base, loss_delta=0.0, grad_cosine=1.0, sqnr_db={"input": math.nan}).sensitivity == math.inf
    exact = SiteCost(**base, loss_delta=0.0, grad_cosine=1.0, sqnr_db={"input": math.inf, "weight": 20.0,
                                                                         "grad_output": 0.0})
    assert exact.forward_noise == pytest.approx(0.01) and exact.sensitivity == pytest.approx(0.01)


def test_non_finite_loss_from_a_real_site():
    """An infinite weight entry: the losses (the reference's too) are NaN; the profile must
    not turn that into a finite sensitivity (0 - NaN comparisons are all False)."""
    model, state, held = _setup()
    with torch.no_grad():
        state.site(SITE).module.weight[0, 0] = float("inf")
    prof = profile_sites(model, state, held[:1], formats={SITE: ["fp8_tensorwise"]})
    e = prof.entry(SITE, "fp8_tensorwise")
    assert not math.isfinite(prof.reference_loss)
    assert e.sensitivity == math.inf and e.per_flop_saved == math.inf


def _sqnr_torch(tensors, dtype, fmax):
    """10 log10(sum x^2 / sum err^2) over `tensors`, each cast to `dtype` with its own tensor scale."""
    return -10 * math.log10(_noise_ratio_torch(tensors, dtype, fmax))


def test_weight_and_grad_output_sqnr_equal_torch_float8_casts(profiled):
    """The weight in E4M3 and the output gradient in E5M2 (57344), each with one scale."""
    model, state, held, _, prof = profiled
    module = state.site(SITE).module
    grads = []
    hook = module.register_full_backward_hook(lambda m, gin, gout: grads.append(gout[0].detach().clone()))
    try:
        for x, y in held:   # the all-BF16 pass: the site's output gradient is the same when it alone is quantized
            _, loss = model(x, y)
            (loss / len(held)).backward()
    finally:
        hook.remove()
        model.zero_grad(set_to_none=True)
    e = prof.entry(SITE, "fp8_tensorwise")
    weight = [module.weight.detach()] * len(held)
    assert e.sqnr_db["weight"] == pytest.approx(_sqnr_torch(weight, torch.float8_e4m3fn, E4M3_MAX), abs=0.05)
    assert e.sqnr_db["grad_output"] == pytest.approx(_sqnr_torch(grads, torch.float8_e5m2, 57344.0), abs=0.05)
    assert e.sqnr_db["grad_output"] < e.sqnr_db["weight"] - 3   # E5M2 has one mantissa bit less


def test_forward_noise_is_the_input_and_weight_error_energy_of_torch_casts(profiled):
    """forward_noise = the input's and the weight's quantization error energy over their energy,
    each operand cast to E4M3 by torch with its own tensor scale."""
    model, state, held, _, prof = profiled
    module = state.site(SITE).module
    inputs = _site_inputs(model, module, held)
    e = prof.entry(SITE, "fp8_tensorwise")
    expected = (_noise_ratio_torch(inputs, torch.float8_e4m3fn, E4M3_MAX)
                + _noise_ratio_torch([module.weight.detach()], torch.float8_e4m3fn, E4M3_MAX))
    assert e.forward_noise == pytest.approx(expected, rel=0.02)
    assert 1e-4 < e.forward_noise < 1e-2   # E4M3: about 31 dB per operand
