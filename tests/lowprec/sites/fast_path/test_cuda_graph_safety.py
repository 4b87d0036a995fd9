"""What CUDA graphs need of a compiled fast-path step, checked without a GPU.

`torch.compile(mode="reduce-overhead")` replays each graph with cudagraph trees, which skip
(run without CUDA graphs) any graph that writes an input whose address is not static
(`check_for_mutation`, torch/_inductor/cudagraph_utils.py). A fast-path step writes its
delayed-scaling state (amax histories, counts, the kernel's scratch scalars, the overflow
counters) in place, in the forward and in the backward. Here Inductor compiles a layer's
training step on CPU with a spy in place of its inner compiler: each graph's written inputs
must be among the static inputs it is handed (what the cudagraph check reads), and the state
must advance as in eager. On the GPU, tests/gpu/test_fast_path_gpu.py runs the same step
under CUDA graphs with skipping made an error, and a manual `torch.cuda.graph` capture.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowprec.numerics.delayed import static_address
from lowprec.numerics.formats import get_format
from lowprec.sites.backends import get_backend
from lowprec.sites.layers import PrecisionLinear


def _layer(fmt: str) -> PrecisionLinear:
    torch.manual_seed(0)
    layer = PrecisionLinear.from_module(nn.Linear(32, 48, bias=False, dtype=torch.bfloat16), get_format(fmt),
                                        get_backend("torch"))
    layer.collect_stats = False
    return layer


def _graphs_of_a_step(layer, steps: int = 2) -> list[tuple[bool, set[int], set[int]]]:
    """(backward?, inputs the graph writes, static inputs) of each graph Inductor compiles."""
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner
    seen = []

    def spy(gm, example_inputs, **kw):
        inputs = [n for n in gm.graph.nodes if n.op == "placeholder"]
        written = {inputs.index(n.args[0]) for n in gm.graph.nodes
                   if n.op == "call_function" and n.target is torch.ops.aten.copy_.default
                   and n.args[0].op == "placeholder"}
        seen.append((bool(kw.get("is_backward")), written, set(kw.get("static_input_idxs") or ())))
        return compile_fx_inner(gm, example_inputs, **kw)

    run = torch.compile(layer, backend=lambda gm, ex: compile_fx(gm, ex, inner_compile=spy))
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=g).to(torch.bfloat16).requires_grad_(True)
        run(x).backward(torch.randn(16, 48, generator=g).to(torch.bfloat16))
        layer.weight.grad = None
    return seen


def test_static_address_is_dynamos_mark():
    marked, ours = torch.zeros(2), static_address(torch.zeros(2))
    torch._dynamo.mark_static_address(marked)
    assert ours._dynamo_static_input_type == marked._dynamo_static_input_type


def test_the_layers_state_is_static():
    layer = _layer("fp8_delayed")
    state = [layer.overflow_steps] + [getattr(h, a) for h in layer.histories.values()
                                      for a in ("history", "count", "scratch", "ticket")]
    assert len(state) == 1 + 4 * 3
    assert all(getattr(t, "_dynamo_static_input_type", None) == "unguarded" for t in state)


@pytest.mark.parametrize("fmt", ["fp8_delayed", "fp8_tensorwise", "fp8_rowwise"])
def test_every_input_a_graph_writes_is_static(fmt):
    graphs = _graphs_of_a_step(_layer(fmt))
    assert [bw for bw, _, _ in graphs] == [False, True]
    for bw, written, static in graphs:
        assert written <= static, (fmt, "backward" if bw else "forward", written - static)
    if fmt == "fp8_delayed":   # the input's state in the forward, the output gradient's in the backward
        assert all(written for _, written, _ in graphs)
    else:
        assert not any(written for _, written, _ in graphs)


def test_compiled_delayed_state_advances_as_eager():
    eager, compiled = _layer("fp8_delayed"), _layer("fp8_delayed")
    _graphs_of_a_step(compiled, steps=3)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(16, 32, generator=g).to(torch.bfloat16).requires_grad_(True)
        eager(x).backward(torch.randn(16, 48, generator=g).to(torch.bfloat16))
        eager.weight.grad = None
    for key, h in eager.histories.items():
        assert torch.equal(h.count, compiled.histories[key].count), key
        assert torch.equal(h.history, compiled.histories[key].history), key
    assert torch.equal(eager.overflow_steps, compiled.overflow_steps)
