"""What `QuantizedLinearFn` is given to quantize a site's operands, in place of the layer.

The autograd function (lowprec.sites.quantized_gemms) takes tensors, the format (the
recipe) and an `OperandQuantizer`: the layer's settings for one call and the holders its
quantizations update. The layer (`PrecisionLinear.operand_quantizer`) builds one per call
from its own objects; the function writes nothing onto the layer. What a quantization
produces reaches the layer through those holders, the same objects the layer owns:

* `stats`: each operand's statistics on a check step (the output gradient's are written
  during the backward), read by the monitors as `layer.stats`;
* `histories` and `overflow_steps`: delayed scaling's amaxes, recorded in place (the
  output gradient's during the backward), and the between-check overflow counters;
* `weight_cache`: the weight's quantizations, reused until the weight changes.

The process groups an amax is reduced over are the function's to say for each call
(`shard_groups`: the mesh dimensions a DTensor operand is sharded on, from its
placements); the data-parallel `amax_group` is the layer's. Transformer Engine's delayed
scaling keeps the same per-operand state in its module and hands it to its autograd
function as tensors; torchao's `matmul_with_hp_or_float8_args` takes tensors and configs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from lowprec.numerics.delayed import AmaxHistory
from lowprec.numerics.formats import Format, QuantSpec, ScaleEncoding, Scaling
from lowprec.numerics.grid import saturates
from lowprec.numerics.hadamard import RandomHadamard
from lowprec.numerics.quant_stats import QuantStats
from lowprec.numerics.quantize import Quantized, quantize
from lowprec.sites.amax_scope import AmaxScope
from lowprec.sites.weight_cache import WeightCache, cacheable

__all__ = ["OperandQuantizer", "OPERAND_OF", "OPERANDS", "bf16_round"]

# the operand each GEMM role quantizes: its amax history and its statistics are the operand's
OPERAND_OF = {"input": "input", "input_wgrad": "input", "weight": "weight",
              "grad_output": "grad_output", "grad_output_wgrad": "grad_output"}
ACTIVATION_ROLES = ("input", "input_wgrad", "grad_output", "grad_output_wgrad")
OPERANDS = ("input", "weight", "grad_output")  # the operands, in overflow_steps' order


def bf16_round(t: torch.Tensor) -> torch.Tensor:
    """`t` rounded to BF16, in its own dtype (BF16 arithmetic emulated in FP32)."""
    return t.to(torch.bfloat16).to(t.dtype)


def _needs_global_amax(spec: QuantSpec) -> bool:
    """Whether the scale depends on the amax of the whole tensor."""
    return spec.scaling is Scaling.TENSOR or spec.scale_encoding is ScaleEncoding.E4M3_FP32


@dataclass(frozen=True, slots=True, eq=False)
class OperandQuantizer:
    """One site's operand quantization for one call (see the module docstring).

    fqn, backend: the site's name (for errors) and its GEMM backend.
    stats, histories, overflow_steps, weight_cache: the layer's holders, updated in place.
    generator, hadamard: stochastic rounding's generator and the random Hadamard transform.
    amax_group: the data-parallel group activations' amaxes are reduced over (None: none);
    amax_scope: `local` reduces nothing. collect_stats: this is a check step.
    emulate_bf16: round high-precision FP32 operands to BF16. fused: the fused quantizer.
    """

    fqn: str
    backend: Any
    stats: dict[str, QuantStats]
    histories: dict[str, AmaxHistory]
    overflow_steps: torch.Tensor
    weight_cache: WeightCache
    generator: torch.Generator
    hadamard: RandomHadamard
    amax_group: Any = None
    amax_scope: AmaxScope = AmaxScope.GROUP
    collect_stats: bool = True
    emulate_bf16: bool = True
    fused: bool = False

    def quantize(self, t: torch.Tensor, fmt: Format, role: str, *, shard_groups: tuple | list = (),
                 record: bool = True, scale: torch.Tensor | None = None):
        """Quantize one 2-D operand (local tensor) for GEMM `role`; high precision if no spec.

        shard_groups: the groups the whole operand is split over (a DTensor's sharded mesh
            dimensions); its amax is reduced over them (and over `amax_group` for activations).
        record: this is the step's first quantization of the operand (`OPERAND_OF[role]`): its
            amax goes into the delayed-scaling history and its statistics are kept. False
            when the backward quantizes again an operand that a GEMM before it already
            quantized (weight^T for dgrad, the input or grad_output for wgrad), where the
            first one could not be reused transposed: that step's statistics and history
            are the first quantization's.
        scale: the delayed scale the first quantization used. Transformer Engine's backward
            uses the forward's FP8 tensors, so an operand has one scale per step; the
            history's own scale has moved since, by the amax the first one recorded.
        """
        spec: QuantSpec | None = getattr(fmt, role)
        if spec is None:
            return bf16_round(t) if self.emulate_bf16 and t.dtype == torch.float32 else t
        operand = OPERAND_OF[role]
        groups = self.amax_groups(role, shard_groups)
        slot, key, q = self.cached(t, spec, role, groups, record)
        if q is not None:
            return q
        amax = None
        hist = self.histories.get(operand) if spec.scaling is Scaling.DELAYED else None
        if hist is not None:
            scale = hist.scale() if scale is None else scale
        elif _needs_global_amax(spec) and groups:
            amax = _reduce_max(torch.where(torch.isfinite(t), t.abs(), 0.0).amax().float(), groups)
        q = quantize(t, spec, amax=amax, scale=scale if hist is not None else None,
                     generator=self.generator, hadamard=self.hadamard, stats=record and self.collect_stats,
                     fused=self.fused, validate=False)
        self.keep(q, role, scale, groups, record)
        if key is not None:
            self.weight_cache.put(slot, key, q, storage=getattr(self.backend, "fp8_storage", False))
        return q

    def cached(self, t: torch.Tensor, spec: QuantSpec, role: str, groups: list, record: bool = True):
        """(slot, key, the weight cache's quantization of `t` or None): key None where `role`'s
        quantization is not cached (not a weight, not `cacheable`, reduced over groups, compiling)."""
        if not (role == "weight" and self.weight_cache.enabled and cacheable(spec) and not groups
                and not torch.compiler.is_compiling()
                and not (t.is_cuda and torch.cuda.is_current_stream_capturing())):
            return None, None, None
        key = self.weight_cache.key(t, spec, self.fused)
        slot = f"{tuple(t.shape)}{t.stride()}"   # the forward's and the backward's layout
        keep_stats = record and self.collect_stats
        q = self.weight_cache.get(slot, key, need_stats=keep_stats)
        if q is not None and keep_stats:
            self.stats[OPERAND_OF[role]] = q.stats
        return slot, key, q

    def delayed_scale(self, spec: QuantSpec, role: str) -> torch.Tensor | None:
        """Delayed scaling's scale for `role` from the operand's history (None: no history)."""
        hist = self.histories.get(OPERAND_OF[role]) if spec.scaling is Scaling.DELAYED else None
        return None if hist is None else hist.scale()

    def keep(self, q: Quantized, role: str, scale, groups: list, record: bool) -> None:
        """What a first quantization (`record`) of `role` leaves in the holders: its amax in the
        delayed-scaling history (reduced over `groups`; past twice the format's max between
        checks, an overflow step) and, on a check step, its statistics."""
        if not record:
            return
        operand = OPERAND_OF[role]
        hist = self.histories.get(operand) if q.spec.scaling is Scaling.DELAYED else None
        if hist is not None:
            amax = _reduce_max(q.amax, groups)
            if not self.collect_stats:
                # past twice the format's max: the largest values lose more than half their size
                self.overflow_steps[OPERANDS.index(operand)] += saturates(
                    amax * scale * 0.5, q.spec.element).to(torch.float64)
            hist.record(amax)
        if self.collect_stats:
            self.stats[operand] = q.stats

    def amax_groups(self, role: str, shard_groups: tuple | list = ()) -> list:
        """The groups `role`'s amax is reduced over: none under `local`; else the operand's
        shard groups, and for activations the data-parallel group."""
        if self.amax_scope is AmaxScope.LOCAL:
            return []
        groups = list(shard_groups)
        if self.amax_group is not None and role in ACTIVATION_ROLES:
            groups.append(self.amax_group)
        return groups

    def gemm(self, a: Quantized | torch.Tensor, b: Quantized | torch.Tensor, out_dtype: torch.dtype) -> torch.Tensor:
        """a @ b^T on the site's backend; in `out_dtype` where the backend produces it natively
        (the `torch` backend's BF16 output on CUDA), else in FP32 (the caller casts)."""
        if getattr(self.backend, "native_out_dtype", False):
            return self.backend.gemm(a, b, out_dtype=out_dtype)
        return self.backend.gemm(a, b)


def _reduce_max(amax: torch.Tensor, groups: list) -> torch.Tensor:
    for g in groups:
        amax = amax.clone()
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=g)
    return amax
