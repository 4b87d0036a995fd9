"""lowprec.sites.quantized_gemms under delayed scaling: one scale per operand and step, as
Transformer Engine's backward uses the forward's FP8 tensors.

An amax history's scale moves as soon as the forward records the step's amax. The backward
must not quantize the weight or the input again with the moved scale: an overflow that
starts on a check step would then vanish from that check's statistics (the backward's
quantization replaced the forward's), and the history would count the weight twice per
step. Expected GEMM results are built here from `quantize` with the scales read off the
histories before the step, and saturation from the E4M3 grid itself.
"""

import dataclasses

import pytest
import torch
from torch import nn

from lowprec.sites.backends import get_backend
from lowprec.sites.backends.emulated import dequantize_for_gemm
from lowprec.numerics.formats import get_format
from lowprec.sites.layers import PrecisionLinear
from lowprec.numerics.quantize import quantize

IN, OUT, TOKENS = 64, 48, 32
# E4M3's largest value is 448 = 1.75 * 2**8; the next step of its grid would be 480, so
# round-to-nearest-even takes a magnitude past 448 from the midpoint 464 on (464 itself
# ties to 448, whose mantissa is even)
E4M3_SATURATES_ABOVE = 464.0


def _delayed(hadamard: bool):
    """fp8_delayed, or the same with a Hadamard transform on every operand: a quantization
    that cannot be reused transposed, so the backward quantizes again."""
    fmt = get_format("fp8_delayed")
    if not hadamard:
        return fmt
    specs = {role: dataclasses.replace(spec, hadamard=True) for role, spec in fmt.specs().items()}
    return dataclasses.replace(fmt, name="fp8_delayed_hadamard", **specs)


def _layer(fmt) -> PrecisionLinear:
    torch.manual_seed(0)
    return PrecisionLinear.from_module(nn.Linear(IN, OUT), fmt, get_backend("emulated"))


def _step(layer, x, g, *, input_grad: bool = True):
    layer.weight.grad = layer.bias.grad = None
    x = x.detach().clone().requires_grad_(input_grad)
    layer(x).backward(g)
    return x.grad, layer.weight.grad.clone()


def _domain(t, layer, hadamard: bool) -> torch.Tensor:
    """The operand as the quantizer sees it: Hadamard-transformed along its last dim."""
    return layer.hadamard.apply(t.float()) if hadamard else t.float()


def _deq(t, spec, scale, layer):
    hadamard = layer.hadamard if spec.hadamard else None
    return dequantize_for_gemm(quantize(t, spec, scale=scale, hadamard=hadamard))


@pytest.mark.parametrize("hadamard", [False, True], ids=["reused-transposed", "quantized-again"])
def test_an_overflow_starting_on_a_check_step_keeps_one_scale_per_operand(hadamard):
    """Three steps fill the histories; on the fourth, a statistics (check) step, the weight
    is 100x larger. Its statistics show the saturation that the forward's scale causes, the
    dgrad and wgrad GEMMs use the scales the forward used, and every history holds one
    amax per step."""
    fmt = _delayed(hadamard)
    layer = _layer(fmt)
    gen = torch.Generator().manual_seed(1)
    x, g = torch.randn(TOKENS, IN, generator=gen), torch.randn(TOKENS, OUT, generator=gen)
    for _ in range(3):
        _step(layer, x, g)
    scales = {op: h.scale().clone() for op, h in layer.histories.items()}
    with torch.no_grad():
        layer.weight.mul_(100.0)
    layer.collect_stats = True
    dx, dw = _step(layer, x, g)

    w = layer.weight.detach()
    sx, sw, sg = scales["input"], scales["weight"], scales["grad_output"]
    want_dx = _deq(g, fmt.grad_output, sg, layer) @ _deq(w.t(), fmt.weight, sw, layer).t()
    want_dw = _deq(g.t(), fmt.grad_output_wgrad, sg, layer) @ _deq(x.t(), fmt.input_wgrad, sx, layer).t()
    for got, want in ((dx, want_dx), (dw, want_dw)):
        assert (got - want).abs().max() <= 1e-6 * want.abs().max()

    scaled = _domain(w, layer, hadamard).abs() * sw
    want_sat = (scaled > E4M3_SATURATES_ABOVE).sum().item() / scaled.numel()
    got = layer.stats["weight"].to_dict()
    assert want_sat > 0.5       # the jump saturates most of the weight under the old scale
    assert got["saturated_frac"] == pytest.approx(want_sat, abs=1e-9)
    assert got["amax"] == pytest.approx(_domain(w, layer, hadamard).abs().max().item(), rel=1e-6)
    for op in ("input", "weight", "grad_output"):
        assert layer.histories[op].count.item() == 4, op
    # the step's amax is in the history now: the next step's scale has moved
    assert layer.histories["weight"].scale().item() < sw.item() / 50


@pytest.mark.parametrize("hadamard", [False, True], ids=["reused-transposed", "quantized-again"])
def test_without_dgrad_the_wgrad_quantization_records_grad_output(hadamard):
    """A layer whose input needs no gradient runs no dgrad: grad_output is quantized once,
    for wgrad, and that quantization feeds its history and its statistics (otherwise its
    scale would stay 1.0 for the whole run)."""
    fmt = _delayed(hadamard)
    layer = _layer(fmt)
    gen = torch.Generator().manual_seed(2)
    x, g = torch.randn(TOKENS, IN, generator=gen), 1e-3 * torch.randn(TOKENS, OUT, generator=gen)
    for _ in range(2):
        _step(layer, x, g, input_grad=False)
    hist = layer.histories["grad_output"]
    amax = _domain(g.t(), layer, hadamard).abs().max().item()   # wgrad's layout: g^T
    assert hist.count.item() == 2
    assert hist.history.max().item() == pytest.approx(amax, rel=1e-6)
    stats = layer.stats["grad_output"].to_dict()
    assert stats["amax"] == pytest.approx(amax, rel=1e-6)
    assert stats["numel"] == g.numel()
