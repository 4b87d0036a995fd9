"""GPU checks of backend `torchao` (real FP8 GEMMs through torchao's Float8Linear).

Skipped without CUDA or torchao. Not yet run on a GPU (written in a session without one):
the tolerances are those of tests/gpu/test_scaled_mm_gpu.py, widened for row-wise, where
torchao returns BF16 and applies the scales of its backward GEMMs after a BF16 GEMM
(docs/config.md, backend numerics).
"""

import pytest
import torch
from torch import nn

pytest.importorskip("torchao", reason="backend 'torchao' needs torchao: pip install 'lowprec[torchao]'")

from lowprec.sites.backends import get_backend  # noqa: E402
from lowprec.sites.backends.torchao_backend import TorchAOBackend  # noqa: E402
from lowprec.numerics.formats import get_format  # noqa: E402
from lowprec.sites.layers import PrecisionLinear  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                                reason="needs a CUDA GPU with FP8 tensor cores (sm_89+)")


def _step(layer, base, x, g):
    x = x.detach().clone().requires_grad_(True)
    base.weight.grad = base.bias.grad = None
    y = layer(x)
    y.backward(g)
    return y.detach().float(), x.grad.float(), base.weight.grad.float(), base.bias.grad.float()


@pytest.mark.parametrize("fmt, tol", [("fp8_tensorwise", 2e-3), ("fp8_rowwise_e4m3_pow2", 2e-2)])
def test_torchao_backend_matches_emulated_on_cuda(fmt, tol):
    torch.manual_seed(0)
    base = nn.Linear(1024, 512, device="cuda")
    x = torch.randn(4, 256, 1024, device="cuda")
    g = torch.randn(4, 256, 512, device="cuda")
    site = get_backend("torchao").make_site(base, fmt)
    assert site.float8_module(emulate=False).config.emulate is False
    got = _step(site, base, x, g)
    want = _step(PrecisionLinear.from_module(base, get_format(fmt), get_backend("emulated")), base, x, g)
    for name, a, b in zip(("y", "dx", "dw", "db"), got, want):
        assert ((a - b).norm() / b.norm()).item() < tol, name
    assert set(site.stats) == {"input", "weight", "grad_output"}


def test_torchao_backend_refuses_shapes_cublas_cannot_run():
    base = nn.Linear(1024, 520, device="cuda")            # 520 % 16 == 8
    site = TorchAOBackend().make_site(base, "fp8_tensorwise", name="odd")
    with pytest.raises(ValueError, match="multiples of 16.*out_features = 520"):
        site(torch.randn(64, 1024, device="cuda"))
    emulated = TorchAOBackend(emulate=True).make_site(base, "fp8_tensorwise")
    emulated(torch.randn(64, 1024, device="cuda")).sum().backward()
