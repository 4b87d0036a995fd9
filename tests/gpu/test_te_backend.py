"""Backend 'te' on a GPU with Transformer Engine: shared parameters, numerics, fresh histories.

Skipped, with the probe's reason, wherever Transformer Engine cannot run.

Tolerances are normwise relative errors against an FP32 computation on the same BF16
values. Round-to-nearest with p mantissa bits has an RMS relative error of about
2**-p / sqrt(12) * ln 2 per element: 2.6% for E4M3 (p=3), 5.2% for E5M2 (p=2), 10% for
E2M1 (p=1). A forward output carries two E4M3 operands (about 3.7%) and a gradient one
E5M2 and one E4M3 operand (about 5.8%); the bounds below leave a factor of two.
"""

import pytest
import torch
import torch.nn.functional as F

from lowprec.sites.backends import te as te_backend
from lowprec.sites.backends.te import TELinearSite, autocast_region

OK, REASON = te_backend.probe()
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not OK, reason=REASON)]

M, K, N = 128, 256, 512          # multiples of 128: every TE recipe's alignment and blocks fit
FWD_TOL = {"fp8_tensorwise": 0.08, "fp8_delayed": 0.08, "fp8_blockwise": 0.08, "mxfp8": 0.08,
           "nvfp4": 0.30}        # NVFP4: two E2M1 operands with E4M3 block scales
GRAD_TOL = 0.12


def make_linear(seed=0, in_features=K, out_features=N):
    torch.manual_seed(seed)
    return torch.nn.Linear(in_features, out_features, device="cuda", dtype=torch.bfloat16)


def make_input(seed=1, requires_grad=False):
    torch.manual_seed(seed)
    return torch.randn(M, K, device="cuda", dtype=torch.bfloat16, requires_grad=requires_grad)


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def fp32_linear(x, lin):
    return F.linear(x.float(), lin.weight.float(), lin.bias.float())


def calibrate(site, x, steps=3):
    """A few training steps, so that delayed scaling has an amax history to scale from."""
    for _ in range(steps):
        site(x).float().square().mean().backward()
    for p in site.parameters():
        p.grad = None


@pytest.mark.parametrize("fmt", ["bf16", "fp8_tensorwise", "fp8_delayed"])
def test_site_holds_the_linears_own_parameters(fmt):
    lin = make_linear()
    opt = torch.optim.SGD(lin.parameters(), lr=0.1)      # created before the site
    site = TELinearSite(lin, fmt)
    assert site.weight is lin.weight and site.bias is lin.bias
    assert [id(p) for p in site.parameters()] == [id(lin.weight), id(lin.bias)]
    assert list(site.state_dict()) == ["weight", "bias"]
    if fmt != "bf16":
        te_lin = site.te_module()
        assert te_lin.weight is lin.weight and te_lin.bias is lin.bias
        assert tuple(te_lin.weight.shape) == (N, K) and tuple(te_lin.bias.shape) == (N,)
    before = lin.weight.detach().clone()
    site(make_input()).float().square().mean().backward()
    opt.step()
    assert not torch.equal(lin.weight, before)            # the old optimizer moved the shared tensor


@pytest.mark.parametrize("fmt", ["fp8_tensorwise", "fp8_delayed", "fp8_blockwise", "mxfp8", "nvfp4"])
def test_quantized_forward_is_close_to_the_linear(fmt):
    ok, why = te_backend.supports(fmt)
    if not ok:
        pytest.skip(why)
    lin, x = make_linear(), make_input()
    site = TELinearSite(lin, fmt)
    calibrate(site, x)
    ref = fp32_linear(x, lin)
    err = rel_err(site(x), ref)
    assert err < FWD_TOL[fmt]
    assert err > 2 * rel_err(lin(x), ref)                 # it did quantize: BF16 alone is far closer


def test_bf16_equals_the_plain_linear_exactly():
    lin, x = make_linear(), make_input()
    expected = lin(x)
    site = TELinearSite(lin, "bf16")
    assert torch.equal(site(x), expected)
    site.set_format("fp8_tensorwise")
    assert not torch.equal(site(x), expected)
    site.set_format("bf16")
    assert torch.equal(site(x), expected)


def test_sites_switch_independently_inside_one_region():
    lin_a, lin_b = make_linear(0), make_linear(2, in_features=N, out_features=K)
    a, b = TELinearSite(lin_a, "fp8_tensorwise"), TELinearSite(lin_b, "bf16")
    x = make_input()
    with autocast_region():
        h = a(x)
        y = b(h)
    assert torch.equal(y, lin_b(h))                       # the BF16 site ignores the FP8 region
    assert rel_err(h, fp32_linear(x, lin_a)) < FWD_TOL["fp8_tensorwise"]


def test_repromotion_starts_with_a_fresh_amax_history():
    lin, x = make_linear(), make_input()
    site = TELinearSite(lin, "fp8_delayed")
    calibrate(site, x)
    te_lin = site.te_module()
    fwd = te_lin.fp8_meta["scaling_fwd"]
    assert fwd.amax_history.abs().sum() > 0 and not torch.all(fwd.scale == 1)
    site.set_format("bf16")
    site(x)
    site.set_format("fp8_tensorwise")
    site(x)
    site.set_format("fp8_delayed")
    assert site.te_module() is te_lin                     # same module, its state reset in place
    for key in ("scaling_fwd", "scaling_bwd"):
        state = te_lin.fp8_meta[key]
        assert torch.all(state.amax_history == 0) and torch.all(state.scale == 1)
    fresh = TELinearSite(lin, "fp8_delayed")              # a site that never ran
    assert torch.equal(site(x), fresh(x))


@pytest.mark.parametrize("fmt", ["bf16", "fp8_tensorwise", "fp8_delayed"])
def test_backward_reaches_the_shared_parameters(fmt):
    lin = make_linear()
    site = TELinearSite(lin, fmt)
    x = make_input(requires_grad=True)
    calibrate(site, x)
    x.grad = None
    out = site(x)
    torch.manual_seed(3)
    grad_out = torch.randn_like(out)
    out.backward(grad_out)

    x32 = x.detach().float().requires_grad_()
    w32 = lin.weight.detach().float().requires_grad_()
    b32 = lin.bias.detach().float().requires_grad_()
    F.linear(x32, w32, b32).backward(grad_out.float())
    tol = 0.01 if fmt == "bf16" else GRAD_TOL
    for got, want in ((lin.weight.grad, w32.grad), (lin.bias.grad, b32.grad), (x.grad, x32.grad)):
        assert got is not None and got.dtype == torch.bfloat16 and torch.isfinite(got).all()
        assert rel_err(got, want) < tol


def test_recipes_are_transformer_engines_own():
    from transformer_engine.common import recipe as R
    r = te_backend.recipe_for("fp8_delayed")
    assert isinstance(r, R.DelayedScaling) and r.fp8_format == R.Format.HYBRID
    assert (r.amax_history_len, r.amax_compute_algo, r.margin) == (1024, "max", 0)
    assert isinstance(te_backend.recipe_for("fp8_tensorwise"), R.Float8CurrentScaling)
    b = te_backend.recipe_for("fp8_blockwise")
    assert isinstance(b, R.Float8BlockScaling) and b.fp8_quant_fwd_weight.power_2_scale
    assert (b.x_block_scaling_dim, b.w_block_scaling_dim, b.grad_block_scaling_dim) == (1, 2, 1)
    assert isinstance(te_backend.recipe_for("mxfp8"), R.MXFP8BlockScaling)
    assert te_backend.recipe_for("bf16") is None
    if hasattr(R, "NVFP4BlockScaling"):
        n = te_backend.recipe_for("nvfp4")
        assert n.fp4_quant_bwd_grad.stochastic_rounding and n.fp4_quant_bwd_grad.random_hadamard_transform
        assert n.fp4_quant_fwd_weight.fp4_2d_quantization and not n.fp4_quant_fwd_weight.stochastic_rounding


def test_site_refuses_what_te_cannot_run():
    with pytest.raises(te_backend.UnsupportedFormatError, match="fp8_rowwise"):
        TELinearSite(make_linear(), "fp8_rowwise")
    with pytest.raises(ValueError, match="% 16"):
        TELinearSite(make_linear(in_features=24, out_features=40), "fp8_tensorwise")
