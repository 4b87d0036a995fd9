"""The `torchao` backend: lowprec sites run torchao's float8 training layers (`torchao.float8`).

torchao is PyTorch's own FP8 training library (torchtitan's float8 converter uses it). This
backend lets lowprec's plan, monitors and rollout drive torchao's layers one site at a time:
a site can run torchao's FP8 recipe in one step and BF16 in the next, with the same
Parameter objects throughout (an optimizer built before `prepare` keeps its state).

Design: as the `te` backend does with Transformer Engine, a `TorchAOLinearSite` registers an
`nn.Linear`'s own `weight` and `bias` and runs, per format, a torchao `Float8Linear` built
by torchao's public entry point `convert_to_float8_training` from a meta-device
`nn.Linear` whose parameters are re-bound to those same objects: no copy, state_dict keys
unchanged. torchao's own casts, GEMMs and backward run (`matmul_with_hp_or_float8_args`);
lowprec does not re-implement them. `bf16` bypasses torchao: `F.linear` on the same
parameters, with BF16-rounded operands on an FP32 model as `PrecisionLinear` does.

Formats (one name means the same numerics on every backend, see docs/config.md):

* `fp8_tensorwise` = torchao's `tensorwise` recipe: E4M3 input and weight, E5M2
  grad_output, one FP32 scale per tensor, max / max(amax, 1e-12) computed in FP64.
* `fp8_rowwise_e4m3_pow2` = torchao's `rowwise` recipe: E4M3 for all three operands
  (gradients too), one scale per row along each GEMM's reduction dimension, rounded down
  to a power of two. lowprec's `fp8_rowwise` (E5M2 gradients, FP32 scales) is not a
  torchao recipe and is refused with that pointer.
* Refused by `supports`, each with what to use instead: `fp8_delayed` (torchao.float8
  scales dynamically only), MX and NVFP4 (torchao.prototype, not wired in), 1x128 blocks,
  FP4. torchao's `rowwise_with_gw_hp` has no lowprec format (its dgrad weight is
  tensor-wise while its forward weight is row-wise).

Emulation: `emulate=None` runs torchao's emulation mode (`Float8LinearConfig(emulate=True)`)
on CPU and real FP8 GEMMs (`torch._scaled_mm`, sm_89+) on CUDA; True or False forces it.

Numerics against the `emulated` backend: the quantized operands are the same bits (same
scale formula, same saturating round-to-nearest-even cast). torchao's emulated GEMM
divides the FP8 values by the scale where lowprec multiplies by `scale_inv` (as cuBLAS
does): the same products when scales are powers of two (the `rowwise` recipe always;
`tensorwise` when an amax is the format's max times a power of two), otherwise last-bit
differences. On CUDA torchao calls `torch._scaled_mm` with the reciprocal scales
(`float8_ops.addmm_float8_unwrapped`), i.e. multiplies by `scale_inv` like lowprec's
`torch` backend; for row-wise scaling it returns BF16 for an FP32 model and its backward
GEMMs run a unit-scale GEMM and multiply by the scales afterwards. torchao rounds scales
to powers of two as exp2(floor(log2(s))), which rounds up a scale within about one ulp
below 2**k (|k| >= 3); lowprec truncates the exponent. tests/lowprec/sites/backends/
test_torchao_backend.py checks each of these statements.

Statistics: on check steps (`collect_stats`), lowprec's own quantizer computes the
`QuantStats` of input, weight and grad_output (the latter in a hook on the output's
gradient) with the format's specs, as `PrecisionLinear` does, so the monitors read the
same `layer.stats[operand]` on every backend. Off check steps nothing extra runs.

Not covered: `amax_group` (torchao scales each rank's tensors locally: refused), Hugging
Face Conv1D layers, DTensor/FSDP2 float8 all-gather, torch.compile around the site.
torchao is imported when the first FP8 site is built, never by `import lowprec`; its
import logs harmless messages about CUDA extensions it cannot load on a CPU machine.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import importlib.metadata
import importlib.util

import torch
import torch.nn.functional as F
from torch import nn

from lowprec.numerics.formats import E2M1, FORMATS, Format, ScaleEncoding, Scaling, get_format
from lowprec.numerics.quantize import quantize
from lowprec.sites.amax_scope import DEFAULT_AMAX_SCOPE, AmaxScope
from lowprec.sites.backends.protocol import UnsupportedFormatError

__all__ = ["MIN_VERSION", "RECIPES", "UnsupportedFormatError", "probe", "require_torchao", "recipe_name",
           "float8_config", "TorchAOLinearSite", "TorchAOBackend"]

MIN_VERSION = (0, 12)
# lowprec format -> torchao recipe (`Float8LinearConfig.from_recipe_name`) with the same numerics
RECIPES = {"fp8_tensorwise": "tensorwise", "fp8_rowwise_e4m3_pow2": "rowwise"}
_HOW_TO_INSTALL = "pip install 'lowprec[torchao]' (torchao>=0.12), or use backend 'emulated' or 'torch'"


@functools.lru_cache(maxsize=1)
def probe() -> tuple[bool, str]:
    """(True, torchao's version) or (False, why not and how to fix); imports nothing."""
    if importlib.util.find_spec("torchao") is None:
        return False, f"torchao is not installed: {_HOW_TO_INSTALL}"
    version = importlib.metadata.version("torchao")
    try:
        major_minor = tuple(int(p) for p in version.split("+")[0].split(".")[:2])
    except ValueError:
        return True, f"torchao {version}"   # a source build with an unusual version string
    if major_minor < MIN_VERSION:
        return False, f"torchao {version} is older than 0.12: {_HOW_TO_INSTALL}"
    return True, f"torchao {version}"


def require_torchao() -> None:
    """Raise a RuntimeError with the probe's reason unless torchao can be imported here."""
    ok, why = probe()
    if not ok:
        raise RuntimeError(f"backend 'torchao' is not available: {why}")


def _float8():
    from lowprec.base.quiet import quiet_imports
    require_torchao()
    with quiet_imports():   # torchao's unloadable optional extensions and pytree's deprecations: not the user's
        return importlib.import_module("torchao.float8")


def _why_not(fmt: Format) -> str:
    specs = list(fmt.specs().values())
    if any(s.scaling is Scaling.DELAYED for s in specs):
        return ("torchao.float8 computes scales from the current tensor only (its ScalingType has "
                "DYNAMIC and DISABLED; delayed scaling was removed). Use fp8_tensorwise on backend "
                "'torchao', or run fp8_delayed on backend 'emulated', 'torch' or 'te'")
    if any(s.element is E2M1 or s.scale_encoding in (ScaleEncoding.E8M0, ScaleEncoding.E4M3_FP32)
           for s in specs):
        return ("torchao trains MX and NVFP4 formats in torchao.prototype.mx_formats, which this "
                "backend does not run. Use backend 'te' (Blackwell GPUs) or 'emulated'")
    if any(s.scaling is Scaling.BLOCK for s in specs):
        return ("torchao.float8 has no 1x128/128x128 block-scaled recipe (torchao.prototype."
                "blockwise_fp8_training is not wired in). Use backend 'te' (Float8BlockScaling) or 'emulated'")
    if any(s.scaling is Scaling.ROW for s in specs):
        return ("torchao's row-wise recipe (`rowwise`) quantizes gradients to E4M3 too and rounds "
                "scales down to powers of two: that is format fp8_rowwise_e4m3_pow2. Use it on backend "
                f"'torchao', or run {fmt.name} on backend 'emulated' or 'torch'")
    return (f"its specs match no torchao recipe (tensorwise = fp8_tensorwise, rowwise = "
            f"fp8_rowwise_e4m3_pow2). Run {fmt.name} on backend 'emulated'")


def recipe_name(fmt: Format | str) -> str | None:
    """torchao's recipe name for `fmt` (None for high precision); UnsupportedFormatError if none.
    Decided by the format's specs, so a format is what it computes, whatever it is called."""
    fmt = get_format(fmt)
    if fmt.is_high_precision:
        return None
    for name, recipe in RECIPES.items():
        if fmt.specs() == FORMATS[name].specs() and fmt.delayed is None:
            return recipe
    raise UnsupportedFormatError(f"format {fmt.name!r} cannot run on backend 'torchao': {_why_not(fmt)}")


def float8_config(fmt: Format | str, emulate: bool):
    """The `torchao.float8.Float8LinearConfig` that runs `fmt` (torchao's recipe, `emulate` set)."""
    recipe = recipe_name(fmt)
    if recipe is None:
        raise ValueError(f"format {get_format(fmt).name!r} is high precision: it runs F.linear, not torchao")
    config = _float8().Float8LinearConfig.from_recipe_name(recipe)
    return dataclasses.replace(config, emulate=emulate)


def _bf16(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.to(torch.bfloat16).to(t.dtype)


class TorchAOLinearSite(nn.Module):
    """An `nn.Linear`'s own parameters, run through torchao's Float8Linear in the site's format.

    `set_format` switches without touching the parameters; `bf16` runs `F.linear`. The
    statistics of a check step are in `stats` (`QuantStats` by operand), as on every backend.
    """

    def __init__(self, linear: nn.Linear, fmt: Format | str = "bf16", *, name: str | None = None,
                 emulate: bool | None = None, fused: bool = False):
        super().__init__()
        if not isinstance(linear, nn.Linear):
            raise TypeError(
                f"backend 'torchao' runs nn.Linear layers (torchao's Float8Linear); "
                f"{name or 'this layer'} is a {type(linear).__name__}. Keep it in high precision "
                f"(keep_high_precision: [{{module_type: {type(linear).__name__}}}]) or use backend "
                f"'emulated' or 'torch', which also run Hugging Face Conv1D layers")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight                       # the same Parameter objects: no copy
        self.register_parameter("bias", linear.bias)
        self.fqn = name or ""
        self.emulate, self.fused = emulate, fused
        self.emulate_bf16 = True      # bf16 on an FP32 model: BF16-rounded operands, as PrecisionLinear
        self.collect_stats = True
        self.stats: dict = {}
        self.histories: dict = {}     # no delayed scaling here; PrecisionState reads this attribute
        self._float8: dict[tuple[str, bool], nn.Module] = {}   # plain dict: no submodules, no extra keys
        self.format = get_format("bf16")
        self.set_format(fmt)

    def set_format(self, fmt: Format | str) -> None:
        """Switch to `fmt` (parameters untouched); an unsupported format raises, naming the fix."""
        new = get_format(fmt)
        if new == self.format:
            return
        try:
            recipe_name(new)
        except UnsupportedFormatError as e:
            raise UnsupportedFormatError(f"{self._where()}{e}. Backend 'torchao' runs: bf16, "
                                         f"{', '.join(RECIPES)}.") from None
        if not new.is_high_precision:
            require_torchao()
        self.format = new
        self.stats = {}

    def float8_module(self, emulate: bool | None = None) -> nn.Module:
        """The torchao Float8Linear that runs the current format (built once per format and mode);
        `emulate` defaults to the site's, and then to emulation unless the weight is on CUDA."""
        if self.format.is_high_precision:
            raise ValueError(f"{self._where()}format bf16 runs F.linear, not a torchao module")
        emulate = self.emulate if emulate is None else emulate
        emulate = (self.weight.device.type != "cuda") if emulate is None else emulate
        key = (self.format.name, emulate)
        module = self._float8.get(key)
        if module is None:
            shell = nn.Linear(self.in_features, self.out_features, bias=self.bias is not None, device="meta")
            shell.weight = self.weight                    # replaces the meta placeholders
            if self.bias is not None:
                shell.bias = self.bias
            module = _float8().convert_to_float8_training(shell, config=float8_config(self.format, emulate))
            self._float8[key] = module
        if module.weight is not self.weight:              # re-bind after a parameter swap
            module.weight = self.weight
        if module.bias is not self.bias:
            module.bias = self.bias
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.format.is_high_precision:
            if self.emulate_bf16 and x.dtype == torch.float32:
                return F.linear(_bf16(x), _bf16(self.weight), _bf16(self.bias))
            return F.linear(x, self.weight, self.bias)
        emulate = self._emulate_for(x)
        module = self.float8_module(emulate)
        if self.collect_stats:
            self._operand_stats(x)
        y = module(x)
        if y.requires_grad and (x.requires_grad or self.weight.requires_grad):
            y.register_hook(functools.partial(self._grad_output_stats, dgrad=x.requires_grad))
        return y

    # ------------------------------------------------------------------ statistics
    def _operand_stats(self, x: torch.Tensor) -> None:
        """input and weight statistics, as PrecisionLinear's first quantization of each."""
        fmt = self.format
        x2 = x.detach().reshape(-1, x.shape[-1])
        self.stats["input"] = self._quant_stats(x2, fmt.input)
        self.stats["weight"] = self._quant_stats(self.weight.detach(), fmt.weight)

    def _grad_output_stats(self, grad: torch.Tensor, *, dgrad: bool) -> None:
        """grad_output's statistics: along the output features when the input gets a gradient
        (the dgrad GEMM quantizes it first), else along the tokens (only wgrad runs), as
        PrecisionLinear's backward keeps them. Returns None: the gradient is unchanged."""
        if not self.collect_stats:
            return
        g2 = grad.detach().reshape(-1, grad.shape[-1])
        if dgrad:
            self.stats["grad_output"] = self._quant_stats(g2, self.format.grad_output)
        else:
            self.stats["grad_output"] = self._quant_stats(g2.t(), self.format.grad_output_wgrad)

    def _quant_stats(self, t: torch.Tensor, spec):
        """Statistics of this rank's part (a tensor-parallel DTensor's local shard: the monitor
        combines every rank's, as it does PrecisionLinear's)."""
        t = t.to_local() if hasattr(t, "to_local") else t
        return quantize(t, spec, stats=True, fused=self.fused, validate=False).stats

    # ------------------------------------------------------------------ checks
    def _emulate_for(self, x: torch.Tensor) -> bool:
        """The site's `emulate`, or torchao's emulation off CUDA; on CUDA the real FP8 GEMMs'
        requirements are checked here, with the way out."""
        emulate = (x.device.type != "cuda") if self.emulate is None else self.emulate
        if emulate or x.device.type != "cuda":
            return emulate
        major, minor = torch.cuda.get_device_capability(x.device)
        if (major, minor) < (8, 9):
            raise RuntimeError(
                f"{self._where()}torchao's FP8 GEMMs need compute capability 8.9+ (Ada, Hopper, "
                f"Blackwell); {torch.cuda.get_device_name(x.device)} is sm_{major}{minor}. Use "
                f"TorchAOBackend(emulate=True) or backend 'emulated'")
        tokens = x.numel() // x.shape[-1]
        dims = {"in_features": self.in_features, "out_features": self.out_features}
        if torch.is_grad_enabled() and self.weight.requires_grad:
            dims["tokens (the weight gradient's reduction dimension)"] = tokens
        bad = {k: v for k, v in dims.items() if v % 16}
        if bad:
            raise ValueError(
                f"{self._where()}torch._scaled_mm, which torchao calls on CUDA, needs multiples of 16; "
                f"got {', '.join(f'{k} = {v}' for k, v in bad.items())}. Keep this layer in bf16, "
                f"pad the batch to a multiple of 16 tokens, or use TorchAOBackend(emulate=True)")
        return False

    def _where(self) -> str:
        return f"site {self.fqn!r}: " if self.fqn else ""

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={self.format.name}, backend=torchao, "
                f"emulate={'auto' if self.emulate is None else self.emulate}")


class TorchAOBackend:
    """`lowprec.sites.backends.get_backend("torchao")`: sites are torchao Float8Linear modules, not GEMMs.

    emulate: None runs torchao's emulation on CPU and real FP8 GEMMs on CUDA; True/False force it.
    """

    name = "torchao"
    fast_path = False     # sites are torchao Float8Linear modules, not PrecisionLinear
    fp8_storage = False

    def __init__(self, emulate: bool | None = None):
        self.emulate = emulate

    def supports(self, fmt: Format | str) -> tuple[bool, str]:
        """(True, "") if this backend can run `fmt` here, else (False, why and what to do).
        Cheap: it never imports torchao (a plan asks it about every format)."""
        try:
            fmt = get_format(fmt)
            recipe_name(fmt)
        except ValueError as exc:                 # an unknown name or UnsupportedFormatError
            return False, str(exc)
        if fmt.is_high_precision:
            return True, ""
        ok, why = probe()
        return (True, "") if ok else (False, why)

    def make_site(self, linear: nn.Linear, fmt: Format | str = "bf16", *, name: str | None = None,
                  seed: int = 0, amax_group=None, amax_scope: AmaxScope = DEFAULT_AMAX_SCOPE, fused: bool = False, gemm=None,
                  layer_cls: type | None = None, shared_amax=None) -> TorchAOLinearSite:
        """A TorchAOLinearSite (`seed` does not apply: no stochastic rounding or Hadamard here); an
        `amax_group` and a `layer_cls` are refused."""
        if amax_scope is AmaxScope.LOCAL:   # every rank its own amaxes
            amax_group = None
        if layer_cls is not None:
            raise ValueError(f"the torchao backend makes its own layers; layer_cls={layer_cls.__name__} needs "
                             f"the emulated or torch backend")
        if amax_group is not None:
            raise ValueError(
                "backend 'torchao' computes each rank's scales from its local tensors (torchao reduces "
                "amaxes only in its FSDP2 float8 all-gather), so it cannot make the numerics equal one "
                "process's as amax_group asks. Call prepare without amax_group, or use backend "
                "'emulated' or 'torch'")
        return TorchAOLinearSite(linear, fmt, name=name, emulate=self.emulate, fused=fused)

    def __repr__(self) -> str:
        return f"TorchAOBackend(emulate={self.emulate})"
