"""What a compiled graph holds for lowprec's FP8 cast ops (`lowprec.numerics.fp8_ops`).

On CUDA, AOTAutograd's functionalization decomposes `lowprec::fp8_cast` and
`lowprec::fp8_cast_delayed` into the Triton kernels they launch (`torch.library.wrap_triton`
nodes), so that Inductor launches them itself; on other devices the op stays one node.
Checked here with no GPU: the CUDA operands are fake tensors (FakeTensorMode makes CUDA
tensors on a CPU build), and Triton's active driver is one that names an H100 (sm_90) as
its target, so PyTorch's analysis of which tensors each kernel writes runs on the kernels'
real Triton IR, as it does on the GPU. The graph is captured and never run (there is no
device to run it on).
"""

from __future__ import annotations

import os

import pytest
import torch

triton = pytest.importorskip("triton")
GPUTarget = pytest.importorskip("triton.backends.compiler").GPUTarget
pytest.importorskip("triton.backends.nvidia")

from torch._functorch.aot_autograd import aot_function  # noqa: E402
from torch._higher_order_ops.triton_kernel_wrap import kernel_side_table  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensorMode  # noqa: E402

from lowprec.numerics import fp8_ops  # noqa: E402


class _Hopper:
    """A Triton driver that only names its target: what PyTorch's kernel analysis asks."""

    def get_current_target(self):
        return GPUTarget("cuda", 90, 32)


class _Captured(Exception):
    """Raised in place of running a captured graph (there is no device to run it on)."""


@pytest.fixture
def hopper_driver():
    if os.environ.get("TRITON_INTERPRET") == "1":   # interpreted kernels launch on CPU tensors only
        pytest.skip("TRITON_INTERPRET=1: the kernels are interpreted, so nothing is traced for a CUDA device")
    config = triton.runtime.driver
    before = config._active
    config.set_active(_Hopper())
    try:
        yield
    finally:
        config._active = before


def _forward_graph(fn, *args) -> torch.fx.GraphModule:
    """AOTAutograd's forward graph of `fn(*args)`, captured before anything runs."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)

        def never_run(*a):
            raise _Captured
        return never_run

    with pytest.raises(_Captured):
        aot_function(fn, fw_compiler=capture)(*args)
    assert len(graphs) == 1
    return graphs[0]


def _kernel_calls(gm) -> list[tuple[str, set[str]]]:
    """(kernel name, the arguments PyTorch found it writes) of each Triton kernel node."""
    out = []
    for node in gm.graph.nodes:
        if node.op == "call_function" and "triton_kernel_wrapper" in str(node.target):
            kernel = kernel_side_table.get_kernel(node.kwargs["kernel_idx"])
            out.append((kernel.fn.__name__, set(node.kwargs["tensors_to_clone"])))
    return out


def _targets(gm) -> set[str]:
    return {str(n.target) for n in gm.graph.nodes if n.op == "call_function"}


def _cuda(*shape, dtype=torch.bfloat16):
    return torch.empty(*shape, device="cuda", dtype=dtype)


@pytest.mark.parametrize("stats", [False, True], ids=["plain", "stats"])
def test_tensorwise_cast_is_its_two_kernels_on_cuda(hopper_driver, stats):
    def f(x):
        q, si, qt, _, st = torch.ops.lowprec.fp8_cast(x, 0, False, True, stats)
        return q.view(torch.uint8), si, qt.view(torch.uint8), st

    with FakeTensorMode():
        gm = _forward_graph(f, _cuda(512, 256))
    calls = _kernel_calls(gm)
    assert [name for name, _ in calls] == ["_amax_partial_kernel", "_ct_kernel"]
    assert calls[0][1] == {"partial_ptr"}
    # the cast writes q, q^T, the scale and (check steps) its statistics partials, their sum
    # and the ticket after the partial maxima (no third launch sums them), never x
    written = calls[1][1]
    assert {"q_ptr", "qt_ptr", "scale_inv_ptr"} <= written and "x_ptr" not in written
    assert ("stats_ptr" in written) == ("stats_out_ptr" in written) == ("partial_ptr" in written) == stats
    assert not any("lowprec" in t for t in _targets(gm))


def test_rowwise_cast_is_its_two_kernels_on_cuda(hopper_driver):
    def f(x):
        q, si, qt, sit, st = torch.ops.lowprec.fp8_cast(x, 1, True, True, True)
        return q.view(torch.uint8), si, qt.view(torch.uint8), sit, st

    with FakeTensorMode():
        gm = _forward_graph(f, _cuda(256, 384))
    calls = _kernel_calls(gm)
    assert [name for name, _ in calls] == ["_amax_rows_cols_kernel", "_ct_row_kernel"]
    assert calls[0][1] == {"maxima_ptr"}
    assert {"q_ptr", "qt_ptr", "si_ptr", "sit_ptr", "stats_ptr", "stats_out_ptr"} <= calls[1][1]
    assert "x_ptr" not in calls[1][1] and "maxima_ptr" in calls[1][1]     # the statistics' ticket


def test_delayed_cast_is_one_kernel_and_its_state_updates_on_cuda(hopper_driver):
    """The delayed op mutates its history, count, scratch, ticket and overflow counters: the
    graph has the one kernel writing them and returns their new values for AOTAutograd to
    copy back into the inputs."""
    def f(x, history, count, scratch, ticket, overflow):
        q, si, qt, st = torch.ops.lowprec.fp8_cast_delayed(x, 0, history, count, scratch, ticket, overflow,
                                                           2, 0, False, True, False, True)
        return q.view(torch.uint8), si

    with FakeTensorMode():
        state = (_cuda(16, dtype=torch.float32), _cuda((), dtype=torch.int64), _cuda((), dtype=torch.float32),
                 _cuda((), dtype=torch.int32), _cuda(3, dtype=torch.float64))
        gm = _forward_graph(f, _cuda(128, 256), *state)
    calls = _kernel_calls(gm)
    assert [name for name, _ in calls] == ["_ct_kernel"]
    written = calls[0][1]
    assert {"hist_ptr", "count_ptr", "scratch_ptr", "ticket_ptr", "overflow_ptr", "q_ptr", "qt_ptr"} <= written
    assert "x_ptr" not in written
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    assert len(outputs) == 5 + 2      # the five updated state tensors, then f's two outputs


def test_the_op_stays_whole_on_cpu():
    """On CPU the op is one node of the graph, and the graph computes what eager does."""
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    def f(x):
        q, si, qt, _, st = torch.ops.lowprec.fp8_cast(x, 0, False, True, True)
        return q.view(torch.uint8), si, qt.view(torch.uint8), st

    x = torch.randn(64, 32, dtype=torch.bfloat16)
    got = aot_function(f, fw_compiler=capture)(x)
    assert "lowprec.fp8_cast.default" in _targets(graphs[0])
    assert not _kernel_calls(graphs[0])
    for a, b in zip(got, f(x)):
        assert torch.equal(a, b)


def test_direct_calls_skip_only_the_dispatcher():
    """`fp8_ops.cast` runs the op's implementation directly in plain eager code (no dispatcher
    on the host path), and through the op wherever a dispatch mode is on, so that modes (the
    traffic counter, FakeTensorMode) still see it; both give the same bytes."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func))
            return func(*args, **(kwargs or {}))

    x = torch.randn(48, 40, dtype=torch.bfloat16)
    for stats in (True, False):
        direct = fp8_ops.cast(x, 0, False, True, stats)
        with Seen() as seen:
            through_op = fp8_ops.cast(x, 0, False, True, stats)
        assert "lowprec.fp8_cast.default" in seen.ops
        # a direct call does not allocate what the step lacks (None); the op returns it empty
        absent = [i for i, a in enumerate(direct) if a is None]
        assert absent == ([3] if stats else [3, 4])
        assert all(through_op[i].numel() == 0 for i in absent)
        for a, b in zip(direct, through_op):
            if a is not None:
                assert torch.equal(a.view(torch.uint8) if a.dtype.itemsize == 1 else a,
                                   b.view(torch.uint8) if b.dtype.itemsize == 1 else b)


def test_opaque_in_graphs_keeps_the_op_whole_on_cuda(hopper_driver):
    """`fp8_ops.opaque_in_graphs()`: a graph traced inside it keeps the op one node (the
    comparison rows of the benchmarks, and a fallback); outside it the kernels come back."""
    def f(x):
        q, si, qt, _, st = torch.ops.lowprec.fp8_cast(x, 0, False, True, False)
        return q.view(torch.uint8), si

    with FakeTensorMode():
        with fp8_ops.opaque_in_graphs():
            opaque = _forward_graph(f, _cuda(128, 64))
        inlined = _forward_graph(f, _cuda(128, 64))
    assert "lowprec.fp8_cast.default" in _targets(opaque) and not _kernel_calls(opaque)
    assert [name for name, _ in _kernel_calls(inlined)] == ["_amax_partial_kernel", "_ct_kernel"]
