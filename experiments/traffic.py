"""Count the kernels and the bytes a PyTorch program moves, outside its GEMMs (issue 28).

A GPU step that is bound by memory costs about (bytes moved) / (memory bandwidth) plus a
few microseconds per kernel launch. Both can be counted on a CPU, from the operators the
program dispatches, without timing anything: `count_traffic(fn)` runs `fn()` under a
`TorchDispatchMode` and charges every operator it sees by the rules below. Backward
operators are seen too when `fn` calls `.backward()` (the mode is active in the autograd
engine; on CUDA its worker threads inherit it).

Rules (what one operator costs):

* View and metadata operators cost nothing: every aten operator whose schema returns an
  alias of an input without writing it (view, reshape-as-view, t, transpose, permute,
  expand, as_strided, alias, detach, slice, select, unsqueeze, squeeze, unfold, ...), plus
  `_unsafe_view`, `_reshape_alias`, `lift_fresh` and the allocations `empty`,
  `empty_strided`, `empty_like`, `new_empty`, `new_empty_strided`, `resize_` (no kernel
  touches the memory). A reshape that needs a copy shows up as `clone` (charged) plus
  `_unsafe_view` (free).
* Every other aten / prim operator is 1 launch. It reads the bytes of its tensor inputs
  and writes the bytes of its outputs. A tensor's bytes are the elements its view
  covers times the element size: `numel * element_size`, except that a broadcast
  dimension (stride 0, e.g. an `expand`ed scalar scale) counts once. Each distinct input
  is read once (`x * x` reads x once). Outputs are the returned tensors plus any argument
  the schema marks as written (`out=`, in-place `self`), each once. `out=` arguments are
  not read; an in-place operator reads its `self` (`mul_`) except where it only
  overwrites it (`copy_`, `fill_`, `zero_`, random fills); `zeros_like`, `ones_like`,
  `full_like`, `new_zeros`, ... read nothing (only the shape). Scalar-sized operators
  (`full(())`, `where` on two scalars, an amax-history update) still cost their launch:
  on a GPU the launch, not the bytes, is their price.
* GEMMs (`mm`, `addmm`, `bmm`, `baddbmm`, `addmv`, `mv`, `dot`, `_scaled_mm`, and the
  `mm`/`addmm` that `linear` and `matmul` decompose into) are counted apart, under
  `gemm_*`, and are not in the totals "outside the GEMMs".
* Custom operators (any `OpOverload` whose namespace is not `aten` or `prim`, e.g.
  `torch.ops.lowprec.cast_tensorwise`) are charged by `custom_cost(op, args, kwargs, out)`
  when it returns `(launches, bytes_read, bytes_written)`; otherwise (no `custom_cost`, or
  it returns None) they read their tensor inputs once and write their outputs once, and
  their launches are the Triton kernels launched while they ran (counted by wrapping
  Triton's `kernel[grid](...)` when Triton is imported), or 1 when none was seen.
  Operators the custom op runs inside itself (its CPU reference implementation) are not
  seen: the mode is off while an operator it intercepted runs.
* Triton kernels launched outside any custom operator are invisible to the dispatcher;
  they are recorded as `triton_outside_ops` (their names) and counted as launches with
  unknown bytes (0), so a test can assert there are none.
* Host reads (a device value read on the host: a synchronisation on a GPU) are recorded
  in `host_syncs` with the operator and a short stack: `_local_scalar_dense` (what
  `.item()`, `float(t)`, `bool(t)`, `if t:` become), `item`, `is_nonzero`, `equal`,
  `allclose`, the operators whose output shape depends on the data (`nonzero`,
  `argwhere`, `masked_select`, `unique*`, `repeat_interleave` without `output_size`,
  `index`/`index_put_` with a boolean mask), a copy from a GPU to the CPU (`.cpu()`,
  `.tolist()` of a CUDA tensor), and `Tensor.tolist()` / `.numpy()` (seen by a
  `TorchFunctionMode`: on a CPU tensor they read memory without dispatching). They are
  charged as ordinary operators too.

`no_host_sync(allowed=0)` is the same detection as a guard: it raises `HostSyncError`,
naming the operator and where it was called, at the first host read beyond `allowed`.

Example (one FP8 layer step; E is one byte per element of the layer input):

    from experiments.traffic import count_traffic
    report = count_traffic(lambda: layer(x).backward(g))
    print(report.table(unit=x.numel()))
    report.launches, report.in_units_of(x.numel())["bytes"]

As a script it measures lowprec's `PrecisionLinear` step today (the "before" row of the
issue's table in docs/performance.md) and prints the counted comparison rows:

    PYTHONPATH=. python experiments/traffic.py --n 256
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["OpCost", "HostSync", "HostSyncError", "TrafficReport", "count_traffic", "no_host_sync",
           "uncounted", "charge", "tensor_bytes", "GEMM_OPS", "FREE_OPS"]

CustomCost = Callable[[Any, tuple, dict, Any], "tuple[int, int, int] | None"]

# aten packets (overload-independent names) that launch no kernel
FREE_OPS = frozenset({
    "empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "resize_",
    "_unsafe_view", "_reshape_alias", "lift_fresh", "alias", "detach", "view", "t",
    "transpose", "permute", "expand", "as_strided", "slice", "select", "unsqueeze", "squeeze",
    "set_", "sym_size", "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size",
    "_has_compatible_shallow_copy_type",
})
GEMM_OPS = frozenset({"mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "dot",
                      "_scaled_mm", "_scaled_mm_v2", "_scaled_grouped_mm", "_addmm_activation",
                      "_int_mm", "_weight_int8pack_mm"})
# in-place operators that overwrite `self` without reading it
_OVERWRITE_OPS = frozenset({"copy_", "fill_", "zero_", "uniform_", "normal_", "random_",
                            "bernoulli_", "exponential_", "geometric_", "cauchy_", "log_normal_"})
# operators that read a device value on the host (or whose output shape depends on one)
_HOST_READ_OPS = frozenset({"_local_scalar_dense", "item", "is_nonzero", "equal", "allclose",
                            "nonzero", "argwhere", "masked_select", "unique", "_unique",
                            "_unique2", "unique_consecutive", "unique_dim",
                            "unique_dim_consecutive"})
_HOST_READ_METHODS = ("tolist", "numpy", "__array__")
# operators that take a tensor for its shape, dtype and device only
_NO_READ_OPS = frozenset({"zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
                          "randint_like", "new_zeros", "new_ones", "new_full", "scalar_tensor"})


def tensor_bytes(t: torch.Tensor) -> int:
    """Bytes of the elements `t`'s view covers (a broadcast, stride-0 dimension counts once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    if t.numel() == 0:
        n = 0
    return n * t.element_size()


def _key(t: torch.Tensor) -> tuple:
    try:
        base = t.untyped_storage()._cdata
    except Exception:          # tensors without storage (some subclasses)
        base = id(t)
    return (base, t.storage_offset(), tuple(t.shape), t.stride(), t.dtype)


def _tensors(tree) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


def _distinct(ts, skip=()) -> list[torch.Tensor]:
    seen, out = set(skip), []
    for t in ts:
        k = _key(t)
        if k not in seen:
            seen.add(k)
            out.append(t)
    return out


def _is_view(op) -> bool:
    """Whether the schema returns an alias of an input without writing it (a view)."""
    rets = op._schema.returns
    return bool(rets) and all(r.alias_info is not None and not r.alias_info.is_write for r in rets)


def _written_args(op, args, kwargs) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(arguments the schema marks as written, of which the `out=` ones)."""
    written, outs = [], []
    for i, a in enumerate(op._schema.arguments):
        if a.alias_info is None or not a.alias_info.is_write:
            continue
        v = kwargs.get(a.name) if a.kwarg_only or i >= len(args) else args[i]
        ts = _tensors(v)
        written += ts
        if a.is_out:
            outs += ts
    return written, outs


def _namespace(op) -> str:
    return getattr(op, "namespace", "") or ""


def _packet(op) -> str:
    return op._schema.name.split("::")[-1]


def _is_boolean_index(op, args) -> bool:
    if _packet(op) not in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return False
    indices = args[1] if len(args) > 1 else ()
    return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
               for i in (indices or ()))


def _host_read(op, args, kwargs) -> bool:
    if not isinstance(op, torch._ops.OpOverload) or _namespace(op) not in ("aten", "prim"):
        return False
    name = _packet(op)
    if name in _HOST_READ_OPS or _is_boolean_index(op, args):
        return True
    if name == "repeat_interleave" and kwargs.get("output_size") is None and isinstance(
            args[0] if args else None, torch.Tensor) and len(args) < 3:
        return op._overloadname.startswith("Tensor") or op._overloadname.startswith("self_Tensor")
    if name in ("_to_copy", "copy_"):   # device -> host copy (.cpu(), .tolist() of a CUDA tensor)
        src = args[1] if name == "copy_" else args[0]
        dst_dev = (args[0].device if name == "copy_"
                   else kwargs.get("device"))
        return (isinstance(src, torch.Tensor) and src.device.type not in ("cpu", "meta")
                and dst_dev is not None and torch.device(dst_dev).type == "cpu")
    return False


def _short_stack(skip_internal: bool = True, depth: int = 4) -> str:
    frames = [f for f in traceback.extract_stack()[:-1]
              if not (skip_internal and ("/torch/" in f.filename or f.filename == __file__))]
    return " <- ".join(f"{f.filename.rsplit('/', 2)[-1] if '/' in f.filename else f.filename}:"
                       f"{f.lineno} {f.name}" for f in reversed(frames[-depth:]))


# ----------------------------------------------------------------------------- the report


@dataclass
class OpCost:
    """What one operator (by overload name) cost over the whole run."""

    op: str
    kind: str          # "op", "gemm", "custom", "view" or "triton"
    calls: int = 0
    launches: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written


@dataclass
class HostSync:
    """One host read: the operator and a short stack of where it was called from."""

    op: str
    stack: str


class HostSyncError(RuntimeError):
    """A device value was read on the host where `no_host_sync` forbids it."""


@dataclass
class TrafficReport:
    """Totals outside the GEMMs, the GEMMs apart, per-operator costs and host reads."""

    ops: dict[str, OpCost] = field(default_factory=dict)
    host_syncs: list[HostSync] = field(default_factory=list)
    triton_outside_ops: list[str] = field(default_factory=list)
    events: list[tuple[str, str, int, int, int]] = field(default_factory=list)  # (op, kind, l, r, w)

    def _sum(self, attr: str, gemm: bool) -> int:
        return sum(getattr(c, attr) for c in self.ops.values()
                   if (c.kind == "gemm") == gemm and c.kind != "view")

    @property
    def launches(self) -> int:
        """Kernel launches outside the GEMMs."""
        return self._sum("launches", False)

    @property
    def bytes_read(self) -> int:
        return self._sum("bytes_read", False)

    @property
    def bytes_written(self) -> int:
        return self._sum("bytes_written", False)

    @property
    def bytes(self) -> int:
        """Bytes read plus written outside the GEMMs."""
        return self.bytes_read + self.bytes_written

    @property
    def gemm_launches(self) -> int:
        return self._sum("launches", True)

    @property
    def gemm_bytes_read(self) -> int:
        return self._sum("bytes_read", True)

    @property
    def gemm_bytes_written(self) -> int:
        return self._sum("bytes_written", True)

    def in_units_of(self, e: int) -> dict[str, float]:
        """The byte totals divided by `e` bytes (the issue's E: the layer input's numel, one
        byte per element), with the launch counts as they are."""
        return {"launches": self.launches, "read": self.bytes_read / e,
                "written": self.bytes_written / e, "bytes": self.bytes / e,
                "gemm_launches": self.gemm_launches,
                "gemm_bytes": (self.gemm_bytes_read + self.gemm_bytes_written) / e,
                "host_syncs": len(self.host_syncs)}

    def table(self, unit: int = 1, include_views: bool = False) -> str:
        """A markdown table of the operators, most bytes first; bytes in units of `unit`."""
        u = "E" if unit != 1 else "bytes"
        lines = [f"| op | kind | calls | launches | read ({u}) | written ({u}) |",
                 "|---|---|---:|---:|---:|---:|"]
        rows = sorted((c for c in self.ops.values() if include_views or c.kind != "view"),
                      key=lambda c: (c.kind == "gemm", -c.bytes, c.op))
        for c in rows:
            lines.append(f"| {c.op} | {c.kind} | {c.calls} | {c.launches} | "
                         f"{_fmt(c.bytes_read, unit)} | {_fmt(c.bytes_written, unit)} |")
        lines.append(f"| **outside the GEMMs** | | | **{self.launches}** | "
                     f"**{_fmt(self.bytes_read, unit)}** | **{_fmt(self.bytes_written, unit)}** |")
        return "\n".join(lines)


def _fmt(b: int, unit: int) -> str:
    if unit == 1:
        return str(b)
    v = b / unit
    return f"{v:.3f}" if v < 10 else f"{v:.1f}"


# ----------------------------------------------------------------------------- the modes


class _TritonLaunches:
    """Counts `kernel[grid](...)` launches while installed (only if Triton is imported)."""

    def __init__(self):
        self.names: list[str] = []
        self._orig = None

    def __enter__(self):
        jit = sys.modules.get("triton.runtime.jit")
        if jit is None:
            return self
        cls = jit.KernelInterface
        orig = cls.__getitem__
        names = self.names

        def getitem(kernel, grid):
            launch = orig(kernel, grid)

            def counted(*args, **kwargs):
                fn = getattr(kernel, "fn", kernel)
                names.append(getattr(fn, "__name__", type(kernel).__name__))
                return launch(*args, **kwargs)
            return counted

        self._orig = (cls, orig)
        cls.__getitem__ = getitem
        return self

    def __exit__(self, *exc):
        if self._orig is not None:
            cls, orig = self._orig
            cls.__getitem__ = orig
        return False


class _HostReadMethods(TorchFunctionMode):
    """`Tensor.tolist()` / `.numpy()`: host reads that do not dispatch on a CPU tensor."""

    def __init__(self, on_read: Callable[[str], None]):
        super().__init__()
        self.on_read = on_read

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in _HOST_READ_METHODS:
            self.on_read(f"Tensor.{name}")
        return func(*args, **(kwargs or {}))


class _Counter(TorchDispatchMode):
    def __init__(self, report: TrafficReport, custom_cost: CustomCost | None,
                 triton: _TritonLaunches):
        super().__init__()
        self.report = report
        self.custom_cost = custom_cost
        self.triton = triton

    def host_read(self, name: str) -> None:
        self.report.host_syncs.append(HostSync(name, _short_stack()))

    def _charge(self, name: str, kind: str, launches: int, read: int, written: int) -> None:
        c = self.report.ops.get(name)
        if c is None:
            c = self.report.ops[name] = OpCost(name, kind)
        c.calls += 1
        c.launches += launches
        c.bytes_read += read
        c.bytes_written += written
        if kind != "view":
            self.report.events.append((name, kind, launches, read, written))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func)
        aten = _namespace(func) in ("aten", "prim")
        if aten and _host_read(func, args, kwargs):
            self.host_read(name)
        n_triton = len(self.triton.names)
        out = func(*args, **kwargs)
        inner = self.triton.names[n_triton:]
        del self.triton.names[n_triton:]           # launched inside this operator
        if aten:
            packet = _packet(func)
            if packet in FREE_OPS or (_is_view(func) and packet not in GEMM_OPS):
                self._charge(name, "view", 0, 0, 0)
                return out
            kind = "gemm" if packet in GEMM_OPS else "op"
            launches = 1
        else:
            kind = "custom"
            cost = self.custom_cost(func, args, kwargs, out) if self.custom_cost else None
            if cost is not None:
                self._charge(name, kind, *map(int, cost))
                return out
            launches = max(len(inner), 1)
        written, outs = _written_args(func, args, kwargs)
        written_ts = _distinct(written + _tensors(out))
        skip = {_key(t) for t in outs}
        if aten and _packet(func) in _OVERWRITE_OPS and args:
            skip.add(_key(args[0]))
        read_ts = [] if aten and _packet(func) in _NO_READ_OPS else _distinct(
            _tensors((args, kwargs)), skip)
        self._charge(name, kind, launches, sum(map(tensor_bytes, read_ts)),
                     sum(map(tensor_bytes, written_ts)))
        return out


_ACTIVE: list[_Counter] = []     # the counters of the count_traffic calls in progress


@contextlib.contextmanager
def uncounted():
    """Run the block with the dispatch modes off (nothing in it is charged, and code under
    `torch.compile` really compiles: Dynamo runs eagerly under a dispatch mode); pair it
    with `charge` to count an opaque region (a compiled graph) by a model of its cost."""
    from torch.utils._python_dispatch import _disable_current_modes
    with _disable_current_modes():
        yield


def charge(name: str, launches: int, bytes_read: int, bytes_written: int, kind: str = "op") -> None:
    """Charge a cost to the innermost `count_traffic` in progress (no-op outside one)."""
    if _ACTIVE:
        _ACTIVE[-1]._charge(name, kind, launches, bytes_read, bytes_written)


def count_traffic(fn: Callable[[], Any], *, custom_cost: CustomCost | None = None) -> TrafficReport:
    """Run `fn()` and count its kernels and bytes by the module's rules (see its docstring).

    custom_cost(op, args, kwargs, out) -> (launches, bytes_read, bytes_written) or None:
        the cost of a custom operator (namespace other than aten/prim); None: the default.
    """
    report = TrafficReport()
    triton = _TritonLaunches()
    counter = _Counter(report, custom_cost, triton)
    _ACTIVE.append(counter)
    try:
        with triton, _HostReadMethods(counter.host_read), counter:
            fn()
    finally:
        _ACTIVE.pop()
    for kname in triton.names:                      # launched outside any operator
        report.triton_outside_ops.append(kname)
        c = report.ops.setdefault(f"triton:{kname}", OpCost(f"triton:{kname}", "triton"))
        c.calls += 1
        c.launches += 1
    return report


class _Guard(TorchDispatchMode):
    def __init__(self, check: Callable[[str], None]):
        super().__init__()
        self.check = check

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _host_read(func, args, kwargs):
            self.check(str(func))
        return func(*args, **kwargs)


@contextlib.contextmanager
def no_host_sync(allowed: int = 0):
    """Raise `HostSyncError` at the first host read beyond `allowed` inside the block.

    Yields the list of the host reads seen so far (`HostSync`), for a test that allows one
    read on a check step and wants to see which it was.
    """
    seen: list[HostSync] = []

    def check(name: str) -> None:
        seen.append(HostSync(name, _short_stack()))
        if len(seen) > allowed:
            raise HostSyncError(
                f"host read #{len(seen)} ({allowed} allowed): {name} reads a device value on "
                f"the host (a GPU synchronisation), called from {seen[-1].stack or '?'}. "
                f"Keep the value on the device (torch.where, a device tensor instead of a "
                f"Python number), or move the read to a check step.")

    with _HostReadMethods(check), _Guard(check):
        yield seen


# ----------------------------------------------------------------------------- the script

FORMATS = ("fp8_tensorwise", "fp8_delayed", "fp8_rowwise")
BACKENDS = ("emulated", "torch")
# (input dtype, weight dtype): BF16 activations with an FP32 master weight is the usual GPU
# setup; BF16 weights as in bench_linear.py's GPU table; FP32 throughout as on a CPU run
DTYPES = {"bf16/fp32": (torch.bfloat16, torch.float32), "bf16/bf16": (torch.bfloat16, torch.bfloat16),
          "fp32/fp32": (torch.float32, torch.float32)}


_INDUCTOR_KERNELS: dict[tuple, int] = {}


@contextlib.contextmanager
def compiled_quantizer_as_opaque():
    """`fused=True` layers: run lowprec's compiled quantizer (`quantize._compiled_core`) for
    real, uncounted, and charge each call by a model, since Inductor's kernels do not
    dispatch: launches = the kernels Inductor generated for that graph on this machine
    (`torch._inductor.metrics.generated_kernel_count` at its compilation; a CPU count, a GPU
    one may differ), bytes = its tensor inputs read twice (the amax pass, then the cast
    pass) and its outputs written once. Tensor-wise and delayed only (what `fused` fuses)."""
    import importlib

    from torch._inductor import metrics

    q = importlib.import_module("lowprec.numerics.quantize")   # `lowprec.numerics.quantize` is also a function

    orig = q._compiled_core

    def patched(spec):
        run = orig(spec)

        def counted(*args):
            ts = [a for a in args if isinstance(a, torch.Tensor)]
            key = (spec, args[-1], *((tuple(t.shape), t.dtype, t.stride()) for t in ts))
            with uncounted():
                fresh = key not in _INDUCTOR_KERNELS
                if fresh:
                    metrics.reset()
                out = run(*args)
                if fresh:
                    _INDUCTOR_KERNELS[key] = metrics.generated_kernel_count
            outs = _distinct(_tensors(out))
            charge(f"inductor:quantize_core({spec.scaling.value}, stats={args[-1]})",
                   _INDUCTOR_KERNELS[key], 2 * sum(map(tensor_bytes, _distinct(ts))),
                   sum(map(tensor_bytes, outs)), kind="compiled")
            return out
        return counted

    q._compiled_core = patched
    try:
        yield
    finally:
        q._compiled_core = orig


def layer_step(backend: str, fmt: str, n: int, x_dtype: torch.dtype, w_dtype: torch.dtype, *,
               check: bool, micro_batch: int = 0, seed: int = 0,
               fused: bool = False) -> tuple[TrafficReport, int]:
    """Count one forward+backward of `PrecisionLinear(Linear(n, n))` on n tokens: the input
    needs its gradient (a layer inside a model), the bias too, grad_output is given.

    check: `collect_stats` on (a check step) or off. micro_batch 0: the first micro-batch
    after an optimizer step (the weight cache misses: its version is bumped first, as an
    optimizer step bumps it); 1: a later micro-batch of gradient accumulation (it hits).
    A warm-up step runs first (uncounted), so delayed scaling has a history and lazy state
    exists. fused: `PrecisionLinear(fused=True)`, the compiled quantizer charged by
    `compiled_quantizer_as_opaque`'s model. Returns (report, E), E = n * n (one byte per
    input element)."""
    from torch import nn
    from torch.autograd.graph import increment_version

    from lowprec.sites.backends import get_backend
    from lowprec.numerics.formats import get_format
    from lowprec.sites.layers import PrecisionLinear

    torch.manual_seed(seed)
    base = nn.Linear(n, n).to(w_dtype)
    layer = PrecisionLinear.from_module(base, get_format(fmt), get_backend(backend), fused=fused)
    layer.collect_stats = check
    x = torch.randn(n, n, dtype=x_dtype, requires_grad=True)
    g = torch.randn(n, n, dtype=x_dtype)

    def step():
        layer(x).backward(g)

    with compiled_quantizer_as_opaque() if fused else contextlib.nullcontext():
        step()                                        # warm-up: history, lazy state, compiling
        for p in (*layer.parameters(), x):
            p.grad = None                             # zero_grad(set_to_none=True)
        if micro_batch == 0:
            increment_version(layer.weight)           # what an optimizer step does
        from lowprec.numerics.fp8_ops import traffic_cost   # the fast path's cast ops, by their kernels
        return count_traffic(step, custom_cost=traffic_cost), n * n


def measure(n: int, dtypes=("bf16/fp32", "bf16/bf16", "fp32/fp32"), backends=BACKENDS,
            formats=FORMATS, quantizers=("eager",), micro_batches=(0,)) -> list[dict]:
    """One row per (dtypes, backend, format, quantizer, micro-batch, step kind): launches
    and E outside the GEMMs. The fused quantizer fuses tensor-wise and delayed only."""
    rows = []
    for dt in dtypes:
        x_dtype, w_dtype = DTYPES[dt]
        for be in backends:
            for fmt in formats:
                for quant in quantizers:
                    if quant == "fused" and fmt == "fp8_rowwise":
                        continue
                    for mb in micro_batches:
                        for check in (False, True):
                            rep, e = layer_step(be, fmt, n, x_dtype, w_dtype, check=check,
                                                micro_batch=mb, fused=quant == "fused")
                            rows.append({"dtypes": dt, "backend": be, "format": fmt,
                                         "quantizer": quant, "micro_batch": mb,
                                         "step": "check" if check else "non-check", "report": rep,
                                         **rep.in_units_of(e)})
    return rows


def implied_ms(e_units: float, d: int, tokens: int, bw_tb_s: float = 3.0) -> float:
    """Milliseconds to move `e_units` E (E = tokens * d bytes) at `bw_tb_s` TB/s."""
    return e_units * tokens * d / (bw_tb_s * 1e12) * 1e3


def gemm_ms(d: int, tokens: int, tflops: float = 1000.0) -> float:
    """Three GEMMs of 2 * tokens * d * d FLOP each at `tflops` TFLOP/s (dense FP8)."""
    return 3 * 2 * tokens * d * d / (tflops * 1e12) * 1e3


def main(argv=None) -> str:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=256, help="d_in = d_out = tokens (default 256)")
    p.add_argument("--dtypes", nargs="+", default=list(DTYPES), choices=list(DTYPES),
                   help="input/weight dtypes")
    p.add_argument("--backends", nargs="+", default=list(BACKENDS), choices=list(BACKENDS))
    p.add_argument("--formats", nargs="+", default=list(FORMATS), choices=list(FORMATS))
    p.add_argument("--quantizers", nargs="+", default=["eager"], choices=["eager", "fused"],
                   help="fused: PrecisionLinear(fused=True), the compiled quantizer charged by a "
                        "model (see compiled_quantizer_as_opaque); compiles, slow on CPU")
    p.add_argument("--micro-batches", nargs="+", type=int, default=[0], choices=[0, 1],
                   help="0: first micro-batch after an optimizer step (weight cache misses); "
                        "1: a later one of gradient accumulation (the weight's cast is cached)")
    p.add_argument("--ops", action="store_true", help="also print each row's per-operator table")
    args = p.parse_args(argv)
    cmd = "python experiments/traffic.py " + " ".join(shlex.quote(a) for a in (argv or sys.argv[1:]))
    lines = [f"# command: {cmd.strip()}",
             f"# torch {torch.__version__}, d_in = d_out = tokens = {args.n}, E = {args.n}^2 bytes; "
             f"one forward+backward, input and bias need grads; micro-batch 0: the weight changed "
             f"since the last step (cache miss), 1: gradient accumulation (cache hit)",
             "| input/weight | backend | format | quantizer | micro-batch | step | launches | "
             "read (E) | written (E) | total (E) | ms at 3 TB/s, d = tokens = 8192 | GEMMs | "
             "host reads |",
             "|---|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    rows = measure(args.n, args.dtypes, args.backends, args.formats, args.quantizers,
                   args.micro_batches)
    for r in rows:
        lines.append(f"| {r['dtypes']} | {r['backend']} | {r['format']} | {r['quantizer']} | "
                     f"{r['micro_batch']} | {r['step']} | "
                     f"{r['launches']} | {r['read']:.1f} | {r['written']:.1f} | **{r['bytes']:.1f}** | "
                     f"{implied_ms(r['bytes'], 8192, 8192):.2f} | "
                     f"{r['gemm_launches']} | {r['host_syncs']} |")
    if args.ops:
        for r in rows:
            lines += ["", f"## {r['dtypes']} {r['backend']} {r['format']} {r['quantizer']} "
                          f"micro-batch {r['micro_batch']} {r['step']}",
                      r["report"].table(unit=args.n * args.n)]
    lines.append(f"\nthe three FP8 GEMMs at d = tokens = 8192: {gemm_ms(8192, 8192):.2f} ms at 1000 TFLOP/s")
    out = "\n".join(lines)
    print(out)
    return out


if __name__ == "__main__":
    main()
