"""GPU checks of the quantizers and the `torch` backend (skipped without CUDA)."""

import pytest
import torch
from torch import nn

from lowprec.sites.backends import get_backend
from lowprec.numerics.formats import FORMATS, Scaling, get_format
from lowprec.sites.layers import PrecisionLinear
from lowprec.numerics.quantize import quantize

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("name", [n for n, f in FORMATS.items() if not f.is_high_precision])
def test_quantize_cuda_equals_cpu(name):
    """The same grid values and scales on CUDA as on CPU, for every format's input spec."""
    spec = get_format(name).input
    x = torch.randn(256, 512, generator=torch.Generator().manual_seed(0)) * 3
    kw = {"scale": torch.tensor(40.0)} if spec.scaling is Scaling.DELAYED else {}
    if spec.rounding.value == "stochastic":
        pytest.skip("stochastic rounding draws differ between CPU and CUDA generators")
    cpu = quantize(x, spec, **kw)
    gpu = quantize(x.cuda(), spec, **{k: v.cuda() for k, v in kw.items()})
    assert torch.equal(cpu.values, gpu.values.cpu())
    assert torch.equal(cpu.scale, gpu.scale.cpu())


@pytest.mark.parametrize("fmt", ["fp8_tensorwise", "fp8_delayed", "fp8_rowwise"])
def test_torch_backend_matches_emulated_on_cuda(fmt):
    """Same quantized operands; only the GEMM's accumulation differs. Hopper's FP8 tensor
    cores accumulate with fewer bits than FP32 (DeepSeek-V3, arXiv 2412.19437, measured
    about 14), which gave relative differences of about 1e-4 on an H100 here; row-wise
    GEMMs on cuBLAS also return BF16."""
    torch.manual_seed(0)
    base = nn.Linear(1024, 512, device="cuda")
    x = torch.randn(4, 256, 1024, device="cuda", requires_grad=True)
    g = torch.randn(4, 256, 512, device="cuda")
    res = {}
    for be in ("emulated", "torch"):
        layer = PrecisionLinear.from_module(base, get_format(fmt), get_backend(be))
        x.grad = base.weight.grad = base.bias.grad = None
        y = layer(x)
        y.backward(g)
        res[be] = (y.detach(), x.grad.clone(), base.weight.grad.clone())
    tol = 1e-2 if fmt == "fp8_rowwise" else 1e-3
    for a, b in zip(res["emulated"], res["torch"]):
        assert ((a - b).norm() / b.norm()).item() < tol


def test_fused_equals_eager_on_cuda():
    spec = get_format("fp8_tensorwise").input
    x = torch.randn(2048, 2048, device="cuda")
    a = quantize(x, spec, stats=True)
    b = quantize(x, spec, stats=True, fused=True)
    assert torch.equal(a.values, b.values)
    assert torch.allclose(a.stats.packed, b.stats.packed, rtol=1e-6)
