"""The grouped experts' GEMMs (lowprec.sites.grouped_gemms) equal a per-expert loop of lowprec's
own linear sites (`PrecisionLinear` on the emulated backend) bit for bit: forward, input
gradient, weight gradient and the statistics, several formats in one layer, uneven token
counts, an expert without tokens."""

import importlib

import pytest
import torch
from torch import nn

from lowprec.numerics.formats import get_format
from lowprec.sites.backends import get_backend
from lowprec.sites.experts import ExpertSite
from lowprec.sites.grouped_gemms import GroupedQuantizedFn, format_groups
from lowprec.sites.layers import PrecisionLinear

# every kind of recipe: tensor-wise, delayed, row-wise, 1x128 / 128x128 blocks, MX, NVFP4, high precision
MIXES = [("fp8_tensorwise", "bf16", "fp8_rowwise", "fp8_tensorwise", "mxfp8"),
         ("fp8_delayed", "fp8_blockwise", "nvfp4", "mxfp4", "fp8_delayed"),
         ("fp8_rowwise", "mxfp8", "fp8_rowwise", "bf16", "mxfp8")]   # row-local formats: one quantization per group


@pytest.mark.parametrize("one_call", [True, False], ids=["one_call", "expert_by_expert"])
@pytest.mark.parametrize("stats", [True, False], ids=["statistics", "no_statistics"])
@pytest.mark.parametrize("names", MIXES)
def test_grouped_equals_a_loop_of_linear_sites(names, stats, one_call):
    """Each operand of a format group quantized in one call for all its experts (one_call, the
    default off a CPU) or expert by expert (what the experts module does on a CPU), on check steps
    (statistics) and between them: the same numbers as a loop of linear sites."""
    torch.manual_seed(0)
    counts = (37, 0, 128, 5, 64)             # uneven, one expert without tokens
    n_out, k_in = 256, 128
    x = torch.randn(sum(counts), k_in) * 3
    w = nn.Parameter(torch.randn(len(counts), n_out, k_in) * 0.05)
    gy = torch.randn(sum(counts), n_out)
    backend = get_backend("emulated")
    fmts = [get_format(n) for n in names]
    sites = [ExpertSite(e, {"p": (n_out, k_in)}, fmts[e], backend, fqn=f"experts.{e}", seed=e)
             for e in range(len(counts))]
    for s in sites:
        s.collect_stats = stats
    xg = x.clone().requires_grad_(True)
    for _ in range(2):   # the second step: delayed scaling from the first one's history
        xg.grad = w.grad = None
        for s in sites:
            s.stats.clear()   # as the monitor does after each step (statistics merge within a step)
        y = GroupedQuantizedFn.apply(xg, w, counts, tuple(fmts), tuple(s.operand_quantizer("p") for s in sites),
                                     one_call)
        y.backward(gy)
    refs = [PrecisionLinear(nn.Parameter(w.detach()[e].clone()), None, fmts[e], backend, fqn=f"r{e}", seed=e * 8)
            for e in range(len(counts))]
    for lin in refs:
        lin.collect_stats = stats
    starts = [sum(counts[:e]) for e in range(len(counts))]
    for _ in range(2):
        xr = x.clone().requires_grad_(True)
        outs = []
        for e, lin in enumerate(refs):
            lin.weight.grad = None
            if counts[e]:
                outs.append(lin(xr[starts[e]:starts[e] + counts[e]]))
        y_ref = torch.cat(outs)
        y_ref.backward(torch.cat([gy[starts[e]:starts[e] + counts[e]] for e in range(len(counts)) if counts[e]]))
    assert torch.equal(y, y_ref)
    assert torch.equal(xg.grad, xr.grad)
    for e, lin in enumerate(refs):
        want = lin.weight.grad if counts[e] else torch.zeros_like(w[e])
        assert torch.equal(w.grad[e], want), (names[e], e)
        assert set(sites[e].stats) == (set(lin.stats) if counts[e] else set())
        for role, st in lin.stats.items():
            assert torch.equal(sites[e].stats[role].packed, st.packed), (names[e], role)
    assert len(format_groups(tuple(fmts), counts)) == len({f for f, c in zip(fmts, counts) if c})


@pytest.mark.parametrize("stats", [True, False], ids=["statistics", "no_statistics"])
def test_a_format_group_is_quantized_in_one_call(stats, monkeypatch):
    """Each operand of a format group is quantized in one call for all its experts, however many
    there are (on 6d8701c: tensor-wise and delayed scaling quantized expert by expert, and MX and
    row-wise weights and wgrad operands). Tensor-wise and delayed reuse the forward's
    quantizations transposed in the backward: three calls per group (input, weights, output
    gradient); row-wise and MXFP8 quantize again the weight for dgrad and both wgrad operands
    along the tokens: six."""
    quantize_module = importlib.import_module("lowprec.numerics.quantize")   # the package exports a function of its name
    calls, real = [], quantize_module.block_scales   # every quantization computes its scales once
    monkeypatch.setattr(quantize_module, "block_scales", lambda *a, **k: calls.append(1) or real(*a, **k))
    counts = (9, 0, 16, 4, 12, 7, 3, 20)
    names = ("fp8_tensorwise", "fp8_delayed", "mxfp8", "fp8_rowwise") * 2
    w = nn.Parameter(torch.randn(len(counts), 32, 32) * 0.1)
    x = torch.randn(sum(counts), 32, requires_grad=True)
    backend = get_backend("emulated")
    sites = [ExpertSite(e, {"p": (32, 32)}, get_format(n), backend, fqn=f"experts.{e}", seed=e)
             for e, n in enumerate(names)]
    for s in sites:
        s.collect_stats = stats
    y = GroupedQuantizedFn.apply(x, w, counts, tuple(s.format for s in sites), tuple(s.operand_quantizer("p") for s in sites))
    assert len(calls) == 2 * 4   # four format groups: input and weights
    y.backward(torch.randn_like(y))
    assert len(calls) == 3 + 3 + 6 + 6
    assert all(("grad_output" in s.stats) == (stats and counts[e] > 0) for e, s in enumerate(sites))
