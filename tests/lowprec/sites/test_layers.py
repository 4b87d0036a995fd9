"""PrecisionLinear: same parameters, backend parity, switching, and the three GEMMs."""

import pytest
import torch
from torch import nn

from lowprec.sites.backends import get_backend
from lowprec.sites.backends.emulated import dequantize_for_gemm
from lowprec.numerics.formats import FORMATS, get_format
from lowprec.sites.layers import PrecisionLinear
from lowprec.numerics.quantize import quantize

LOW = [n for n, f in FORMATS.items() if not f.is_high_precision]


def _run(layer, x, g):
    x = x.detach().clone().requires_grad_(True)
    for p in (layer.weight, layer.bias):
        p.grad = None
    y = layer(x)
    y.backward(g)
    return y.detach(), x.grad, layer.weight.grad.clone(), layer.bias.grad.clone()


@pytest.mark.parametrize("tokens", [1, 3, 48])
@pytest.mark.parametrize("fmt", ["fp8_tensorwise", "fp8_delayed", "fp8_rowwise"])
def test_emulated_and_torch_backends_agree_on_cpu(fmt, tokens):
    """On CPU, torch._scaled_mm and the emulated GEMM multiply the same quantized operands in
    FP32, in different orders and with the scales applied differently: not bit for bit (with
    AVX2 kernels too), at any token count, 1 and 3 included; within the FP32 error bound of
    a dot product (`lowprec.sites.backends.emulated.gemm_bound`, tested GEMM by GEMM in
    backends/test_scaled_mm_bound.py). Here, through the layer's three GEMMs: 1e-6 of the
    output's scale, far below one FP8 grid step (2^-3 relative), which any quantization
    difference would produce (measured: at most 4e-7 at 1 and 3 tokens)."""
    torch.manual_seed(0)
    base = nn.Linear(64, 48)
    x, g = torch.randn(tokens, 64), torch.randn(tokens, 48)
    res = {be: [_run(PrecisionLinear.from_module(base, get_format(fmt), get_backend(be)), x, g)
                for _ in range(2)] for be in ("emulated", "torch")}  # 2 steps: delayed uses history
    for a, b in zip(res["emulated"], res["torch"]):
        for u, v in zip(a, b):
            assert u.shape == v.shape and u.dtype == v.dtype
            assert (u - v).abs().max() <= 1e-6 * u.abs().max()


@pytest.mark.parametrize("fmt", LOW)
def test_gemms_use_operands_quantized_along_their_reduction_dim(fmt):
    """Forward output equals x_q @ w_q^T built from independently quantized operands;
    dgrad and wgrad are close to the FP32 gradients (relative error stated per element width)."""
    torch.manual_seed(1)
    base = nn.Linear(128, 128, bias=False)
    layer = PrecisionLinear.from_module(base, get_format(fmt), get_backend("emulated"))
    x = torch.randn(32, 128, requires_grad=True)
    g = torch.randn(32, 128)
    spec = get_format(fmt)
    if spec.delayed is None:
        y = layer(x)
        want = dequantize_for_gemm(quantize(x.detach(), spec.input)) @ \
            dequantize_for_gemm(quantize(base.weight.detach(), spec.weight)).t()
        assert torch.equal(y.detach(), want)
    else:
        y = layer(x)
    y.backward(g)
    gx, gw = x.grad.clone(), base.weight.grad.clone()
    x.grad = base.weight.grad = None
    (x @ base.weight.t()).backward(g)
    tol = 0.12 if spec.input.element.name == "e4m3" else 0.3
    for got, ref in ((gx, x.grad), (gw, base.weight.grad)):
        assert ((got - ref).norm() / ref.norm()).item() < tol


def test_layer_holds_the_same_parameter_objects():
    base = nn.Linear(32, 16)
    w, b = base.weight, base.bias
    layer = PrecisionLinear.from_module(base, get_format("nvfp4"), get_backend("emulated"))
    assert layer.weight is w and layer.bias is b
    assert isinstance(layer, nn.Linear)
    assert list(layer.parameters()) == [w, b]


def test_set_format_resets_delayed_history_and_keeps_parameters():
    base = nn.Linear(32, 16)
    layer = PrecisionLinear.from_module(base, get_format("fp8_delayed"), get_backend("emulated"))
    layer(torch.randn(4, 32) * 7).sum().backward()
    hist = layer.histories["input"]
    assert hist.count.item() == 1 and hist.history.max().item() > 0
    layer.set_format(get_format("bf16"))
    layer.set_format(get_format("fp8_delayed"))
    assert layer.histories["input"].count.item() == 0
    assert layer.histories["input"].history.abs().sum().item() == 0
    assert layer.weight is base.weight


def test_bf16_format_rounds_operands_and_accumulates_in_fp32():
    base = nn.Linear(64, 32)
    layer = PrecisionLinear.from_module(base, get_format("bf16"), get_backend("emulated"))
    x = torch.randn(8, 64)
    bf = lambda t: t.to(torch.bfloat16).float()  # noqa: E731
    assert torch.equal(layer(x), torch.nn.functional.linear(bf(x), bf(base.weight), bf(base.bias)))


def test_conv1d_layout_weight_is_used_transposed():
    """Hugging Face GPT-2's Conv1D stores its weight (in, out)."""
    class Conv1D(nn.Module):
        def __init__(self, nf, nx):
            super().__init__()
            self.nf = nf
            self.weight = nn.Parameter(torch.randn(nx, nf))
            self.bias = nn.Parameter(torch.zeros(nf))

        def forward(self, x):
            return x @ self.weight + self.bias

    conv = Conv1D(24, 32)
    layer = PrecisionLinear.from_module(conv, get_format("bf16"), get_backend("emulated"))
    layer.emulate_bf16 = False
    x = torch.randn(5, 32)
    assert layer.weight is conv.weight
    assert torch.allclose(layer(x), conv(x), atol=1e-6)


def test_wgrad_pads_token_dimension_to_whole_blocks():
    """9 tokens do not fill a 1x128 (or 1x16 Hadamard) block: zero-padding keeps dw exact."""
    base = nn.Linear(128, 128, bias=False)
    x = torch.randn(9, 128, requires_grad=True)
    for fmt in ("fp8_blockwise", "nvfp4", "mxfp8"):
        layer = PrecisionLinear.from_module(base, get_format(fmt), get_backend("emulated"))
        base.weight.grad = None
        layer(x).sum().backward()
        assert base.weight.grad.shape == (128, 128)
        assert torch.isfinite(base.weight.grad).all()


def test_stats_are_recorded_per_operand_as_device_tensors():
    base = nn.Linear(64, 32)
    layer = PrecisionLinear.from_module(base, get_format("fp8_tensorwise"), get_backend("emulated"))
    layer(torch.randn(16, 64, requires_grad=True)).sum().backward()
    assert set(layer.stats) == {"input", "weight", "grad_output"}
    for st in layer.stats.values():
        assert isinstance(st.packed, torch.Tensor) and st.packed.device.type == "cpu"
        assert st.to_dict()["sqnr_db"] > 20


def test_torch_backend_refuses_block_formats():
    ok, why = get_backend("torch").supports(get_format("mxfp8"))
    assert not ok and "emulated" in why and "mxfp8" in why


def test_layer_built_on_meta_device_materializes_with_to_empty():
    """A model built on the meta device (torchtitan builds its models there and calls
    to_empty + init_weights later) can be prepared before its weights exist: after to_empty
    the layer's device-side state is on the weight's device and it quantizes."""
    with torch.device("meta"):
        lin = nn.Linear(32, 16)
    layer = PrecisionLinear.from_module(lin, get_format("fp8_delayed"), get_backend("emulated"), seed=3)
    assert layer.overflow_steps.is_meta
    layer.to_empty(device="cpu")
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.zero_()
    assert layer.overflow_steps.device.type == "cpu" and layer.generator.device.type == "cpu"
    assert all(h.history.device.type == "cpu" for h in layer.histories.values())
    assert layer.histories, "fp8_delayed keeps amax histories"
    y = layer(torch.randn(4, 32, requires_grad=True))
    y.sum().backward()
    assert torch.isfinite(y).all() and layer.weight.grad is not None
