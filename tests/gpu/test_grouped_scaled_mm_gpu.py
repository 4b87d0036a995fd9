"""The grouped experts' FP8 fast path on a GPU (lowprec.sites.grouped_scaled_mm): the real
`torch._scaled_grouped_mm` against the emulated grouped GEMM of the same quantized operands,
and the experts module counting its forwards on that path (skipped without CUDA)."""

import pytest
import torch
from torch import nn

from lowprec.numerics.formats import get_format
from lowprec.sites.backends import get_backend
from lowprec.sites.experts import ExpertSite
from lowprec.sites.grouped_gemms import GroupedQuantizedFn
from lowprec.sites.grouped_scaled_mm import kernel_for

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _run(fmts, counts, x, w, gy, kernel):
    backend = get_backend("torch")
    sites = [ExpertSite(e, {"p": tuple(w.shape[1:])}, fmts[e], backend, fqn=f"experts.{e}", seed=e, device="cuda")
             for e in range(len(counts))]
    xg, wg = x.clone().requires_grad_(True), nn.Parameter(w.clone())
    y = GroupedQuantizedFn.apply(xg, wg, counts, tuple(fmts), tuple(s.operand_quantizer("p") for s in sites),
                                 True, kernel, (False, False, False))
    y.backward(gy)
    return y.detach().float(), xg.grad.float(), wg.grad.float()


@pytest.mark.parametrize("names", [("fp8_rowwise_e4m3_pow2",) * 4,
                                   ("fp8_tensorwise", "bf16", "fp8_rowwise_e4m3_pow2", "fp8_delayed")])
def test_grouped_kernel_matches_the_emulated_grouped_gemm(names):
    """The same quantized operands; what differs is the tensor cores' accumulation (without fast
    accumulation here) and the kernel's BF16 output: relative differences of a few BF16 ulps."""
    kernel = kernel_for(get_backend("torch"), torch.device("cuda"))
    if kernel is None:
        pytest.skip("no torch._scaled_grouped_mm on this GPU (sm90 and later)")
    torch.manual_seed(0)
    counts = (37, 0, 129, 256)
    n_out, k_in = 512, 256
    x = torch.randn(sum(counts), k_in, device="cuda", dtype=torch.bfloat16) * 3
    w = torch.randn(len(counts), n_out, k_in, device="cuda", dtype=torch.bfloat16) * 0.05
    gy = torch.randn(sum(counts), n_out, device="cuda", dtype=torch.bfloat16)
    fmts = [get_format(n) for n in names]
    got, want = _run(fmts, counts, x, w, gy, kernel), _run(fmts, counts, x, w, gy, None)
    for name, g, r in zip(("y", "dx", "dw"), got, want):
        rel = (g - r).norm() / r.norm()
        assert rel < 1e-2, (name, float(rel))


def test_the_experts_module_counts_its_fast_forwards():
    """A Qwen3-MoE's experts in E4M3 row-wise FP8 on the `torch` backend: every projection's
    forward of an expert with tokens takes the grouped kernel."""
    from lowprec.sites.plan import PrecisionPlan
    from lowprec.sites.precision_state import prepare
    from tests.lowprec.moe_models import tiny_qwen3_moe
    model = tiny_qwen3_moe().cuda().to(torch.bfloat16)   # hidden 32, expert width 32: multiples of 16
    plan = PrecisionPlan.from_dict({"backend": "torch", "rules": [
        {"select": {"kind": "experts"}, "format": "fp8_rowwise_e4m3_pow2"}]})
    state = prepare(model, plan)
    ids = torch.randint(0, 64, (2, 32), device="cuda")
    model(ids, labels=ids).loss.backward()
    sites = [s.module for f, s in state.sites.items() if ".experts." in f]
    assert sum(s.fast_calls for s in sites) > 0 and all(s.slow_calls == 0 for s in sites)
