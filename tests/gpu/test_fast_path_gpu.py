"""GPU checks of the `torch` backend's fast path (skipped without CUDA): BF16 output from
torch._scaled_mm for BF16 inputs, and the weight cache on CUDA."""

import pytest
import torch
from torch import nn

from lowprec.sites.backends import get_backend
from lowprec.numerics.formats import get_format
from lowprec.sites.gemm_config import LinearGemmConfig
from lowprec.sites.layers import PrecisionLinear

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _run(layer, x, g):
    x = x.detach().clone().requires_grad_(True)
    layer.weight.grad = layer.bias.grad = None
    y = layer(x)
    y.backward(g)
    return y, x.grad, layer.weight.grad


@pytest.mark.parametrize("fmt", ["fp8_tensorwise", "fp8_delayed", "fp8_rowwise"])
def test_bf16_in_bf16_out_matches_emulated(fmt):
    """BF16 model, BF16 input: the torch backend's GEMMs return BF16 straight from
    _scaled_mm (no FP32 tensor), the layer's output and gradients are BF16, and they match
    the emulated backend (FP32 GEMM of the same quantized operands, then one cast) within
    2e-2 relative (Frobenius): one BF16 rounding of the output (2^-9 relative per element)
    plus the FP8 tensor cores' reduced-precision accumulation (about 1e-4 measured) plus
    row-wise cuBLAS's BF16 output, far below one FP8 grid step (2^-4 E4M3, 2^-3 E5M2)."""
    torch.manual_seed(0)
    base = nn.Linear(1024, 512, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(4, 256, 1024, device="cuda", dtype=torch.bfloat16)
    g = torch.randn(4, 256, 512, device="cuda", dtype=torch.bfloat16)
    res = {}
    for be in ("emulated", "torch"):
        layer = PrecisionLinear.from_module(base, get_format(fmt), get_backend(be))
        res[be] = [t.detach().clone() for t in _run(layer, x, g)]
    for a, b in zip(res["emulated"], res["torch"]):
        assert b.dtype == torch.bfloat16 and a.dtype == torch.bfloat16
        assert ((a.float() - b.float()).norm() / a.float().norm()).item() < 2e-2


def test_scaled_mm_returns_bf16_without_fp32_pass():
    """The backend's gemm itself hands back BF16 when asked, on CUDA."""
    from lowprec.numerics.quantize import quantize
    spec = get_format("fp8_tensorwise").input
    a = quantize(torch.randn(256, 512, device="cuda"), spec)
    b = quantize(torch.randn(128, 512, device="cuda"), spec)
    out = get_backend("torch").gemm(a, b, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and out.shape == (256, 128)
    ref = get_backend("emulated").gemm(a, b)
    assert ((out.float() - ref).norm() / ref.norm()).item() < 1e-2


@pytest.mark.parametrize("fmt", ["fp8_tensorwise", "fp8_rowwise"])
def test_weight_cache_bit_identical_on_cuda(fmt):
    """With and without the weight cache: the same bits over 2 steps x 3 micro-batches."""
    out = {}
    for cache in (True, False):
        torch.manual_seed(0)
        base = nn.Linear(512, 256, device="cuda", dtype=torch.bfloat16)
        layer = PrecisionLinear.from_module(base, get_format(fmt), get_backend("torch"),
                                            cache_weights=cache)
        opt = torch.optim.AdamW(layer.parameters(), lr=1e-3, fused=True)
        gen = torch.Generator(device="cuda").manual_seed(1)
        vals = []
        for _ in range(2):
            for _ in range(3):
                x = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16, generator=gen)
                loss = layer(x).float().square().mean()
                loss.backward()
                vals.append(loss.detach())
            vals.append(layer.weight.grad.clone())
            opt.step()
            opt.zero_grad()
        out[cache] = vals
    for a, b in zip(out[True], out[False]):
        assert torch.equal(a, b)


@pytest.mark.parametrize("fmt", ["fp8_tensorwise", "fp8_rowwise"])
def test_odd_token_counts_are_padded(fmt):
    """An eval window of 37 tokens (not a multiple of 16) runs on the torch backend and
    matches the emulated one: tensor-wise without padding (tokens are M in fprop, which
    `_scaled_mm` takes as they are), row-wise with `pad_inner_dim` on."""
    torch.manual_seed(0)
    base = nn.Linear(256, 128, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(1, 37, 256, device="cuda", dtype=torch.bfloat16)
    gemm = LinearGemmConfig(pad_inner_dim=fmt == "fp8_rowwise")
    with torch.no_grad():
        ys = [PrecisionLinear.from_module(base, get_format(fmt), get_backend(be), gemm=gemm)(x).float()
              for be in ("emulated", "torch")]
    assert ys[1].shape == (1, 37, 128)
    assert ((ys[0] - ys[1]).norm() / ys[0].norm()).item() < 2e-2


def test_training_on_odd_token_counts_needs_padding():
    """37 tokens are K of the wgrad GEMM: without `pad_inner_dim` the step is refused with a
    one-line error naming the key; with it, the gradients match the emulated backend's."""
    torch.manual_seed(0)
    base = nn.Linear(256, 128, bias=False, device="cuda", dtype=torch.bfloat16)
    x = torch.randn(37, 256, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(37, 128, device="cuda", dtype=torch.bfloat16)
    layer = PrecisionLinear.from_module(base, get_format("fp8_tensorwise"), get_backend("torch"))
    with pytest.raises(ValueError, match="pad_inner_dim: true"):
        layer(x).backward(g)
    grads = []
    for be in ("emulated", "torch"):
        layer = PrecisionLinear.from_module(base, get_format("fp8_tensorwise"), get_backend(be),
                                            gemm=LinearGemmConfig(pad_inner_dim=True))
        base.weight.grad = None
        layer(x).backward(g)
        grads.append(base.weight.grad.float())
    assert ((grads[0] - grads[1]).norm() / grads[0].norm()).item() < 2e-2


def test_autocast_fp32_model_gets_bf16_output():
    """An FP32 model under CUDA BF16 autocast: the FP8 layer returns BF16, as F.linear does."""
    base = nn.Linear(256, 128, device="cuda")
    layer = PrecisionLinear.from_module(base, get_format("fp8_tensorwise"), get_backend("torch"))
    x = torch.randn(64, 256, device="cuda", requires_grad=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and base.weight.grad.dtype == torch.float32


# ----------------------------------------------------------------------------- the fast path's ops


ALL_BF16 = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("elem", [0, 1], ids=["e4m3", "e5m2"])
def test_compiled_cast_ops_equal_quantize_on_every_bf16_value(rowwise, elem):
    """The compiled Triton kernels behind torch.ops.lowprec.fp8_cast, on the GPU, against the
    reference quantizer run on the CPU: bytes and scales bit for bit, both layouts."""
    from lowprec.numerics import fp8_ops
    from lowprec.numerics.formats import QuantSpec, Scaling
    from lowprec.numerics.quantize import quantize
    x = ALL_BF16.reshape(256, 256)
    q, si, qt, sit, st = torch.ops.lowprec.fp8_cast(x.cuda(), elem, rowwise, True, True)
    spec = QuantSpec(fp8_ops.ELEMENTS[elem], Scaling.ROW if rowwise else Scaling.TENSOR)
    ref = quantize(x, spec)
    assert torch.equal(q.cpu().view(torch.uint8), ref.to_storage().view(torch.uint8))
    ref_t = quantize(x.t(), spec) if rowwise else None
    want_t = ref_t.to_storage() if rowwise else ref.to_storage().t()
    assert torch.equal(qt.cpu().view(torch.uint8), want_t.contiguous().view(torch.uint8))
    assert torch.equal(si.cpu().reshape(-1), ref.scale_inv.reshape(-1))


def test_no_sync_on_the_fast_path_cuda():
    """CUDA's own sync detector: a fast-path step with statistics off synchronises nothing."""
    layer = PrecisionLinear.from_module(nn.Linear(1024, 1024, device="cuda", dtype=torch.bfloat16),
                                        get_format("fp8_delayed"), get_backend("torch"))
    layer.collect_stats = False
    x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    layer(x).sum().backward()          # warm-up (Triton compiles)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            layer(x).float().sum().backward()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_fast_path_compiles_on_cuda():
    model = nn.Sequential(nn.Linear(512, 1024), nn.GELU(), nn.Linear(1024, 512)).cuda().to(torch.bfloat16)
    model[0] = PrecisionLinear.from_module(model[0], get_format("fp8_tensorwise"), get_backend("torch"))
    model[2] = PrecisionLinear.from_module(model[2], get_format("fp8_rowwise"), get_backend("torch"))
    x = torch.randn(4096, 512, device="cuda", dtype=torch.bfloat16)
    eager = model(x)
    compiled = torch.compile(model)(x)
    assert ((compiled.float() - eager.float()).norm() / eager.float().norm()).item() < 1e-2


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
def test_compiled_cast_is_the_kernels_in_inductors_code(rowwise):
    """Compiled, the cast op is its Triton kernels launched from Inductor's own code (no call
    back into the Python op: lowprec.numerics.fp8_ops), with the same bytes, scales and statistics."""
    from torch._inductor.utils import run_and_get_code

    def cast(x):
        return torch.ops.lowprec.fp8_cast(x, 0, rowwise, True, True)

    x = torch.randn(1024, 768, device="cuda", dtype=torch.bfloat16)
    eager = cast(x)
    compiled, codes = run_and_get_code(torch.compile(cast), x)
    code = "\n".join(codes)
    assert ("_ct_row_kernel" if rowwise else "_ct_kernel") in code and "lowprec.fp8_cast" not in code
    for a, b in zip(eager, compiled):
        if a.dtype.itemsize == 1:
            a, b = a.view(torch.uint8), b.view(torch.uint8)
        assert torch.equal(a, b)


def _twin_layers(fmt: str) -> list:
    """Two fast-path layers (d 1024, BF16) with the same weights and no statistics."""
    torch.manual_seed(0)
    base = nn.Linear(1024, 1024, bias=False, device="cuda", dtype=torch.bfloat16)
    layers = [PrecisionLinear.from_module(nn.Linear(1024, 1024, bias=False, device="cuda", dtype=torch.bfloat16),
                                          get_format(fmt), get_backend("torch")) for _ in range(2)]
    for layer in layers:
        with torch.no_grad():
            layer.weight.copy_(base.weight)
        layer.collect_stats = False
    return layers


@pytest.mark.parametrize("fmt", ["fp8_tensorwise", "fp8_delayed"])
def test_fast_path_under_cuda_graphs_trains_as_eager(fmt, monkeypatch):
    """torch.compile(mode="reduce-overhead") replays a fast-path layer's steps as CUDA graphs
    (the casts are in the graph; a graph cudagraph trees would skip, as for a written input
    that is not static, is an error here): three SGD steps give eager's weights, and the
    delayed history advances as in eager (its in-place updates are replayed too)."""
    import torch._inductor.config as inductor_config
    monkeypatch.setattr(inductor_config.triton, "cudagraph_or_error", True)
    layers = _twin_layers(fmt)
    runs = [layers[0], torch.compile(layers[1], mode="reduce-overhead")]
    opts = [torch.optim.SGD(layer.parameters(), lr=1e-2) for layer in layers]
    g = torch.Generator(device="cuda").manual_seed(1)
    for _ in range(3):
        x = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
        dy = torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, generator=g)
        for run, opt in zip(runs, opts):
            torch.compiler.cudagraph_mark_step_begin()
            run(x).backward(dy)
            opt.step()
            opt.zero_grad(set_to_none=True)
    a, b = (layer.weight.float() for layer in layers)
    assert ((a - b).norm() / a.norm()).item() < 1e-3
    for key, h in layers[0].histories.items():
        assert torch.equal(h.count, layers[1].histories[key].count)
        assert torch.equal(h.history, layers[1].histories[key].history)


@pytest.mark.parametrize("fmt", ["fp8_tensorwise", "fp8_delayed"])
def test_fast_path_under_a_manual_cuda_graph_trains_as_eager(fmt):
    """A whole training step (forward, backward, SGD) captured with `torch.cuda.graph`, as in
    PyTorch's CUDA-graph docs, and replayed on new data: the weight's casts are redone in every
    replay (the weight cache is bypassed while capturing: a hit then would replay the casts of
    the captured weight), and the delayed state is updated in place, as eager's."""
    layers = _twin_layers(fmt)
    opts = [torch.optim.SGD(layer.parameters(), lr=1e-2) for layer in layers]
    g = torch.Generator(device="cuda").manual_seed(1)
    data = [(torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, generator=g),
             torch.randn(2048, 1024, device="cuda", dtype=torch.bfloat16, generator=g)) for _ in range(4)]
    eager, graphed = layers
    # warm-up on a side stream (one eager step on both, so that both start alike), then capture
    static_x, static_dy = data[0][0].clone(), data[0][1].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for layer, opt in zip(layers, opts):
            layer(static_x).backward(static_dy)
            opt.step()
            opt.zero_grad(set_to_none=True)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed(static_x).backward(static_dy)
        opts[1].step()
    for x, dy in data[1:]:
        static_x.copy_(x)
        static_dy.copy_(dy)
        graph.replay()
        eager(x).backward(dy)
        opts[0].step()
        opts[0].zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    a, b = eager.weight.float(), graphed.weight.float()
    assert ((a - b).norm() / a.norm()).item() < 1e-3
    for key, h in eager.histories.items():
        assert torch.equal(h.count, graphed.histories[key].count)
        assert torch.equal(h.history, graphed.histories[key].history)
