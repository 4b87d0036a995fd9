"""The FP8 fast path's casts as PyTorch custom ops (`torch.ops.lowprec.*`).

Two ops, each one fused cast(+transpose) of one GEMM operand, so that `torch.compile`
traces a `PrecisionLinear` on the fast path in one graph (fake implementations give the
shapes) and dispatch modes see one op per operand:

* `lowprec::fp8_cast(x, elem, rowwise, transpose, stats) -> (q, scale_inv, q_t,
  scale_inv_t, stats)`: tensor-wise current scaling (`rowwise=False`; `scale_inv_t` is
  empty: the transpose shares the scale) or row-wise scaling (`q_t` is the row-wise cast
  of x^T, one scale per column of x).
* `lowprec::fp8_cast_delayed(x, elem, history, count, scratch, ticket, overflow,
  overflow_index, margin, most_recent, transpose, stats, count_overflow) -> (q, scale_inv,
  q_t, stats)`: delayed scaling; reads the scale from the amax history and appends this
  operand's amax to it (and counts an overflow step in `overflow[overflow_index]` when
  `count_overflow`), mutating those tensors in place.

`x` is 2-D (M, K), K the reduction dimension; `elem` is 0 for E4M3 and 1 for E5M2; empty
outputs are 0-element tensors (`transpose=False`, `stats=False`). `stats` is the packed
`QuantStats` vector (8 FP64) of the row-major cast.

Under `torch.compile` on CUDA, AOTAutograd's functionalization sees each op as the Triton
kernels it launches (`torch.library.wrap_triton`, as `torch.library.triton_op` does): Inductor
launches them from its own wrapper code, and `mode="reduce-overhead"` can capture them in a
CUDA graph. On CPU, under torch.export and inside `opaque_in_graphs()`, an op stays one
node. In eager code the layer calls `cast` / `cast_delayed`, which skip the dispatcher (host
time per call) where nothing traces and no dispatch mode is on, and go through the ops
otherwise.

Implementations: on CUDA, and on CPU when Triton's interpreter is on (`TRITON_INTERPRET=1`
set before Triton is imported, how the CPU tests run the kernels), the Triton kernels of
`lowprec.numerics.kernels.cast_transpose`; otherwise the reference quantizer
(`lowprec.numerics.quantize.quantize`), which the kernels equal bit for bit (bytes, scales, counts;
the error sums to rounding).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import os

import torch
from torch import Tensor
from torch._subclasses.functional_tensor import FunctionalTensorMode

from lowprec.numerics.delayed import history_record, history_scale
from lowprec.numerics.formats import E4M3, E5M2, QuantSpec, Scaling
from lowprec.numerics.grid import saturates
from lowprec.numerics.quant_stats import QuantStats
from lowprec.numerics.quantize import quantize

__all__ = ["fp8_cast", "fp8_cast_delayed", "cast", "cast_delayed", "opaque_in_graphs", "ELEMENTS", "element_code",
           "uses_kernels"]

ELEMENTS = (E4M3, E5M2)
_N_STATS = len(QuantStats.FIELDS)


def element_code(elem) -> int:
    """The `elem` argument of the ops for an ElementFormat."""
    return ELEMENTS.index(elem)


@functools.lru_cache(maxsize=None)
def _cast_transpose():
    """The kernels' module (`lowprec.numerics.kernels.cast_transpose`), imported at the first
    cast that runs them (an import statement per call costs host time)."""
    from lowprec.numerics.kernels import cast_transpose
    return cast_transpose


@functools.lru_cache(maxsize=None)
def _interpreted_kernels() -> bool:
    """Whether Triton is installed and runs interpreted (its own switch, read once)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        import lowprec.numerics.kernels  # noqa: F401
    except ImportError:
        return False
    return True


def uses_kernels(x: Tensor) -> bool:
    """Whether the ops run the Triton kernels on `x` (else the reference quantizer)."""
    return x.is_cuda or (x.device.type == "cpu" and _interpreted_kernels())


def _transposed(q: Tensor) -> Tensor:
    """q^T in a new contiguous tensor (`.contiguous()` would return a (1, K) tensor's view)."""
    return torch.empty((q.shape[1], q.shape[0]), dtype=q.dtype, device=q.device).copy_(q.t())


def _empty(x: Tensor, *shape, dtype=torch.float32) -> Tensor:
    return torch.empty(shape, dtype=dtype, device=x.device)


# ----------------------------------------------------------------------------- fp8_cast


_KERNEL_DTYPES = (torch.bfloat16, torch.float32, torch.float16)


def _plain(x: Tensor) -> bool:
    """Whether `x` is what the kernels' unchecked entry points take: contiguous, 2-D, of a
    dtype they read (else the public functions, which check and reshape)."""
    return x.dim() == 2 and x.dtype in _KERNEL_DTYPES and x.is_contiguous()


def _kernel_cast(x: Tensor, elem: int, rowwise: bool, transpose: bool, stats: bool, *, launch, stats_out=None):
    """fp8_cast by the Triton kernels, launched by `launch` (eager, or traced into a graph)."""
    ct = _cast_transpose()
    element = ELEMENTS[elem]
    if not _plain(x):
        if rowwise:
            return ct.cast_transpose_rowwise(x, element, transpose=transpose, stats=stats, launch=launch,
                                             stats_out=stats_out)
        q, si, qt, st = ct.cast_transpose(x, element, transpose=transpose, stats=stats, launch=launch,
                                          stats_out=stats_out)
        return q, si, qt, None, st
    if rowwise:
        return ct.rowwise(x, element, transpose, stats, launch, stats_out)
    q, si, qt, st = ct.tensorwise(x, element, transpose, stats, launch, stats_out)
    return q, si, qt, None, st


def _reference_cast(x: Tensor, elem: int, rowwise: bool, transpose: bool, stats: bool):
    """fp8_cast by the reference quantizer (CPU without Triton's interpreter)."""
    element = ELEMENTS[elem]
    scaling = Scaling.ROW if rowwise else Scaling.TENSOR
    ref = quantize(x, QuantSpec(element, scaling), stats=stats, validate=False)
    q = ref.to_storage().contiguous()
    st = ref.stats.packed if stats else None
    if not rowwise:
        qt = _transposed(q) if transpose else _empty(x, 0, 0, dtype=q.dtype)
        return q, ref.scale_inv.reshape(()).clone(), qt, None, st
    si = ref.scale_inv.reshape(-1, 1).clone()
    if not transpose:
        return q, si, _empty(x, 0, 0, dtype=q.dtype), _empty(x, 0, 1), st
    ref_t = quantize(x.t(), QuantSpec(element, Scaling.ROW), validate=False)
    return q, si, ref_t.to_storage().contiguous(), ref_t.scale_inv.reshape(-1, 1).clone(), st


def _eager(kernel_impl, reference_impl, x: Tensor, *args, stats_out: Tensor | None = None):
    """An op's implementation: its Triton kernels launched eagerly where they run on `x`,
    else the reference quantizer. Outputs the step does not have (a tensor-wise cast's
    `scale_inv_t`, the statistics off a check step) are None here: `_complete` makes them
    the op's empty tensors, and direct calls skip those allocations. `stats_out` (direct
    calls): where the statistics go, written by the kernels themselves."""
    if uses_kernels(x):
        return kernel_impl(x, *args, launch=_cast_transpose().eager_launch, stats_out=stats_out)
    return _into(reference_impl(x, *args), stats_out)


def _into(out: tuple, stats_out: Tensor | None) -> tuple:
    """`out` with its statistics (the last output) copied into `stats_out` when one is given."""
    if stats_out is None or out[-1] is None:
        return out
    return (*out[:-1], stats_out.copy_(out[-1]))


def _complete(x: Tensor, out: tuple) -> tuple:
    """The op's outputs from an implementation's: None (an absent output) becomes the empty
    tensor the op's schema returns (the statistics last, FP64; `scale_inv_t` FP32)."""
    if all(t is not None for t in out):   # not `None in out`: that compares tensors with ==
        return out
    last = len(out) - 1
    return tuple(_empty(x, 0, dtype=torch.float64 if i == last else torch.float32) if t is None else t
                 for i, t in enumerate(out))


@torch.library.custom_op("lowprec::fp8_cast", mutates_args=())
def fp8_cast(x: Tensor, elem: int, rowwise: bool, transpose: bool, stats: bool
             ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    return _complete(x, _eager(_kernel_cast, _reference_cast, x, elem, rowwise, transpose, stats))


@fp8_cast.register_fake
def _(x, elem, rowwise, transpose, stats):
    m, n = x.shape
    dt = ELEMENTS[elem].torch_dtype
    q = x.new_empty((m, n), dtype=dt)
    qt = x.new_empty((n, m) if transpose else (0, 0), dtype=dt)
    si = x.new_empty((m, 1) if rowwise else (), dtype=torch.float32)
    sit = x.new_empty((n, 1) if rowwise and transpose else (0, 1) if rowwise else (0,), dtype=torch.float32)
    return q, si, qt, sit, x.new_empty((_N_STATS if stats else 0,), dtype=torch.float64)


# ----------------------------------------------------------------------------- fp8_cast_delayed


def _kernel_cast_delayed(x: Tensor, elem: int, history: Tensor, count: Tensor, scratch: Tensor,
                         ticket: Tensor, overflow: Tensor, overflow_index: int, margin: int,
                         most_recent: bool, transpose: bool, stats: bool, count_overflow: bool, *, launch,
                         stats_out=None):
    """fp8_cast_delayed by the Triton kernel, launched by `launch`."""
    ct = _cast_transpose()
    over = overflow if count_overflow else None
    if not _plain(x):
        return ct.cast_transpose_delayed(x, ELEMENTS[elem], ct.DelayedState(history, count, scratch, ticket),
                                         margin=margin, most_recent=most_recent, overflow=over,
                                         overflow_index=overflow_index, transpose=transpose, stats=stats,
                                         launch=launch, stats_out=stats_out)
    return ct.delayed(x, ELEMENTS[elem], (history, count, scratch, ticket), margin, most_recent, over,
                      overflow_index, transpose, stats, launch, stats_out)


def _reference_cast_delayed(x, elem, history, count, scratch, ticket, overflow, overflow_index, margin,
                            most_recent, transpose, stats, count_overflow):
    """fp8_cast_delayed by the reference quantizer (`AmaxHistory`'s arithmetic)."""
    element = ELEMENTS[elem]
    scale = history_scale(history, count, element, margin, most_recent)
    ref = quantize(x, QuantSpec(element, Scaling.DELAYED), scale=scale, stats=stats, validate=False)
    if count_overflow:
        overflow[overflow_index] += saturates(ref.amax * scale * 0.5, element).to(overflow.dtype)
    history_record(history, count, ref.amax)
    q = ref.to_storage().contiguous()
    qt = _transposed(q) if transpose else _empty(x, 0, 0, dtype=q.dtype)
    st = ref.stats.packed if stats else None
    return q, ref.scale_inv.reshape(()).clone(), qt, st


@torch.library.custom_op("lowprec::fp8_cast_delayed",
                         mutates_args=("history", "count", "scratch", "ticket", "overflow"))
def fp8_cast_delayed(x: Tensor, elem: int, history: Tensor, count: Tensor, scratch: Tensor,
                     ticket: Tensor, overflow: Tensor, overflow_index: int, margin: int,
                     most_recent: bool, transpose: bool, stats: bool, count_overflow: bool
                     ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    return _complete(x, _eager(_kernel_cast_delayed, _reference_cast_delayed, x, elem, history, count, scratch,
                               ticket, overflow, overflow_index, margin, most_recent, transpose, stats,
                               count_overflow))


@fp8_cast_delayed.register_fake
def _(x, elem, history, count, scratch, ticket, overflow, overflow_index, margin, most_recent,
      transpose, stats, count_overflow):
    m, n = x.shape
    dt = ELEMENTS[elem].torch_dtype
    return (x.new_empty((m, n), dtype=dt), x.new_empty((), dtype=torch.float32),
            x.new_empty((n, m) if transpose else (0, 0), dtype=dt),
            x.new_empty((_N_STATS if stats else 0,), dtype=torch.float64))


# ----------------------------------------------------------------------------- graphs and eager calls


def _kernels_in_graph(mode, op, types, args, kwargs, kernel_impl):
    """How AOTAutograd's functionalization sees the ops: on CUDA, as the Triton kernels they
    launch (through `torch.library.wrap_triton`, as `torch.library.triton_op` does), so that
    Inductor launches them from its own wrapper code with the rest of the graph (and CUDA
    graphs can capture them) instead of calling back into Python; on other devices, and for
    torch.export (which keeps custom ops whole), as the one opaque op."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    plain = all(t in (torch.Tensor, FunctionalTensor) or issubclass(t, FakeTensor) for t in types)
    if not (args[0].is_cuda and plain) or _OPAQUE.get() or _exporting():
        return mode.__torch_dispatch__(op, types, args, kwargs)
    from lowprec.numerics.kernels.cast_transpose import traced_launch
    with mode:
        return _complete(args[0], kernel_impl(*args, **kwargs, launch=traced_launch))


_OPAQUE = contextvars.ContextVar("lowprec_fp8_ops_opaque", default=False)


@contextlib.contextmanager
def opaque_in_graphs():
    """Within this block, graphs traced (torch.compile's first call, a recompilation) keep
    each cast op one opaque node, as they did before the kernels were put in graphs: for a
    benchmark's comparison, or as a fallback should Inductor refuse the kernels."""
    token = _OPAQUE.set(True)
    try:
        yield
    finally:
        _OPAQUE.reset(token)


def _exporting() -> bool:
    """Whether torch.export is tracing (it keeps custom ops whole, as for triton_op's)."""
    try:
        from torch.export._trace import custom_triton_ops_decomposition_disabled
    except ImportError:   # a PyTorch without the switch: no export-time exception to make
        return False
    return custom_triton_ops_decomposition_disabled()


@fp8_cast.register_torch_dispatch(FunctionalTensorMode)
def _(mode, op, types, args, kwargs):
    return _kernels_in_graph(mode, op, types, args, kwargs, _kernel_cast)


@fp8_cast_delayed.register_torch_dispatch(FunctionalTensorMode)
def _(mode, op, types, args, kwargs):
    return _kernels_in_graph(mode, op, types, args, kwargs, _kernel_cast_delayed)


def _direct(x: Tensor) -> bool:
    """Whether a call may skip the dispatcher: a plain tensor, nothing tracing (torch.compile,
    make_fx) and no dispatch mode (FakeTensorMode, a traffic counter) that should see the op.
    The dispatcher costs a custom op about as much host time as a kernel launch."""
    return (type(x) is Tensor and not torch.compiler.is_compiling()
            and torch._C._len_torch_dispatch_stack() == 0)


def cast(x: Tensor, elem: int, rowwise: bool, transpose: bool, stats: bool, stats_out: Tensor | None = None):
    """`torch.ops.lowprec.fp8_cast`, its implementation called directly where `_direct`
    (where absent outputs are None, not the op's empty tensors). `stats_out`: an (8,) FP64
    tensor the statistics are written to (and returned as), by the kernel itself where it
    runs directly."""
    if _direct(x):
        if uses_kernels(x):
            return _kernel_cast(x, elem, rowwise, transpose, stats, launch=_cast_transpose().eager_launch,
                                stats_out=stats_out)
        return _into(_reference_cast(x, elem, rowwise, transpose, stats), stats_out)
    return _into(torch.ops.lowprec.fp8_cast(x, elem, rowwise, transpose, stats), stats_out)


def cast_delayed(x: Tensor, elem: int, history: Tensor, count: Tensor, scratch: Tensor, ticket: Tensor,
                 overflow: Tensor, overflow_index: int, margin: int, most_recent: bool, transpose: bool,
                 stats: bool, count_overflow: bool, stats_out: Tensor | None = None):
    """`torch.ops.lowprec.fp8_cast_delayed`, called directly where `_direct` (absent outputs
    None); `stats_out` as `cast`'s."""
    args = (elem, history, count, scratch, ticket, overflow, overflow_index, margin, most_recent, transpose,
            stats, count_overflow)
    if _direct(x):
        return _eager(_kernel_cast_delayed, _reference_cast_delayed, x, *args, stats_out=stats_out)
    return _into(torch.ops.lowprec.fp8_cast_delayed(x, *args), stats_out)


# ----------------------------------------------------------------------------- traffic model


def kernel_traffic(op, args, kwargs, out) -> tuple[int, int, int, int] | None:
    """What one call of these ops costs on a GPU: (Triton kernels, other small launches,
    bytes read, bytes written), from the kernels' structure (`lowprec.numerics.kernels.cast_transpose`):

    * tensor-wise: the partial-maxima pass reads x, the cast reads it again and writes q
      (and q_t): 2 kernels, 2 reads, 1-2 writes;
    * row-wise: zeroing the row/column maxima, the maxima pass (one read), the cast of both
      layouts (a second read): 3 launches;
    * delayed: one kernel, one read (the scale comes from the history, the amax goes into it);
    * statistics (check steps): each tile's amax, counts and sums written from the same pass
      to its row of a (tiles, 8) buffer, which the last tile to finish sums (no launch more).

    For `count_traffic(custom_cost=...)` in experiments/traffic.py; None for other ops."""
    name = str(op).split(".")[1] if "." in str(op) else str(op)
    if name not in ("fp8_cast", "fp8_cast_delayed"):
        return None
    x = args[0]
    xb = x.numel() * x.element_size()
    q, qt = out[0], out[2]
    written = q.numel() + qt.numel() + sum(t.numel() * t.element_size() for t in (out[1], out[-1]))
    if name == "fp8_cast_delayed":
        hist = args[2]
        return 1, 0, xb + hist.numel() * 4, written
    rowwise = bool(args[2])
    if not rowwise:
        return 2, 0, 2 * xb, written
    m, n = x.shape
    maxima = 4 * (m + n + 1)
    return 2, 1, 2 * xb + maxima, written + out[3].numel() * 4 + maxima


def traffic_cost(op, args, kwargs, out) -> tuple[int, int, int] | None:
    """`kernel_traffic` as experiments.traffic's `custom_cost`: (launches, read, written)."""
    t = kernel_traffic(op, args, kwargs, out)
    return None if t is None else (t[0] + t[1], t[2], t[3])
