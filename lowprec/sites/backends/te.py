"""The `te` backend: lowprec sites run as Transformer Engine `te.Linear` modules.

Transformer Engine (TE) needs the NVIDIA driver even to import, so it is imported only
when used: `probe()` says whether it runs here and why not, `require_te()` turns that
into a clear error, and the format -> recipe mapping (`recipe_spec`, in
`lowprec.sites.backends.te_recipes`) is plain Python.

A `TELinearSite` registers an existing `nn.Linear`'s own `weight` and `bias` (state_dict
keys and optimizer state unchanged) and builds, per quantized format, a `te.Linear` on
the meta device whose parameters are re-bound to those same objects: no copy. Each
forward runs it under its own nested `te.autocast(enabled=True, recipe=...)`, so sites
switch independently. `bf16` bypasses TE: `F.linear` on the same parameters, bit for
bit the original `nn.Linear`.

What this relies on, read in NVIDIA/TransformerEngine 2.20.0.dev0 (commit d0067d0; old
names checked at tags v2.6 and v2.9; paths under transformer_engine/):

* common/recipe/__init__.py (pydantic dataclasses): `Format.{E2M1,E4M3,E5M2,HYBRID}`;
  `DelayedScaling(margin=0, fp8_format=HYBRID, amax_history_len=1024,
  amax_compute_algo="max"|"most_recent", reduce_amax=True)`; `Float8CurrentScaling(
  fp8_format=HYBRID)`; `Float8BlockScaling(fp8_format=E4M3, x/w/grad_block_scaling_dim
  =1/2/1)`; `MXFP8BlockScaling(fp8_format=E4M3)`; `NVFP4BlockScaling(disable_rht,
  disable_stochastic_rounding, disable_2d_quantization)` (v2.8+). Several defaults come
  from NVTE_* variables, and the power-of-two scale choice of the current/block recipes
  is a class-level `QParams` fixed at import (pytorch/quantization.py reads
  `recipe.fp8_quant_*.power_2_scale`): `recipe_for` pins the fields it can and refuses
  a recipe the environment has changed.
* pytorch/quantization.py: `te.autocast(enabled, calibrating, recipe, amax_reduction_group)`
  (v2.9+; `fp8_autocast(..., fp8_recipe, fp8_group)` is the deprecated alias) saves and
  restores the global state, so it nests. Delayed-scaling amaxes are reduced at the
  outermost exit (grad enabled) and in backward by each module that saw
  `is_first_fp8_module`, which an inner autocast restores: here once per FP8 site. The
  fused update (common/recipe/delayed_scaling.cu) rolls only histories whose newest amax
  is non-zero (TE PR #825): extra updates cost time, not numbers; `autocast_region()`
  makes the forward one once per step. `te.is_{fp8,fp8_block_scaling,mxfp8,nvfp4}_available(
  return_reason=True) -> (bool, str)` (v2.9+; before, `FP8GlobalStateManager` methods in
  pytorch/fp8.py): FP8 sm_89+, block sm_90+ with CUDA 12.9, MXFP8/NVFP4 sm_100.
* pytorch/module/linear.py: `te.Linear(in_features, out_features, bias=True,
  params_dtype=None, device="cuda", name=None, ...)` has `weight` (out, in) and `bias`
  (out,) as `nn.Linear`; `device="meta"` defers initialisation. pytorch/module/base.py
  overrides `register_parameter` only to stash init metadata and forward reads
  `getattr(self, "weight")`, so `te_linear.weight = existing_parameter` re-binds it.
  Outside `torch.autocast` the input dtype must equal the parameter dtype.
* Fresh amax history (NVIDIA/TransformerEngine issue #982): a module that leaves FP8 keeps its
  `fp8_meta["scaling_fwd"|"scaling_bwd"]` scale and amax history and reuses them when it
  comes back. Changing one module's recipe in place is unsafe: the reduction buffers
  register a module once (`buffer_index_and_autocast_key` in
  `FP8GlobalStateManager.add_fp8_tensors_to_global_buffer`) and would keep the old
  state. So a site keeps one `te.Linear` per format it has used and, on promotion,
  calls TE's `reset_fp8_meta_tensors()`: history zeroed, scales one, in place, which is
  the state of a newly built module.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
from typing import Any

import torch
import torch.nn.functional as F

from lowprec.numerics.formats import Format, Scaling, get_format
from lowprec.sites.amax_scope import DEFAULT_AMAX_SCOPE, AmaxScope
from lowprec.sites.backends.protocol import UnsupportedFormatError
from lowprec.sites.backends.te_recipes import RecipeSpec, recipe_spec, te_format_names

__all__ = ["probe", "require_te", "RecipeSpec", "UnsupportedFormatError", "recipe_spec", "recipe_for",
           "supports", "te_format_names", "TELinearSite", "TEBackend", "autocast_region"]

_HOW_TO_FIX = ("To use backend 'te': pip install 'lowprec[te]' on a machine with an NVIDIA GPU and "
               "driver; FP8 needs compute capability 8.9+ (Ada, Hopper), MXFP8 and NVFP4 need 10.0+ "
               "(Blackwell). Otherwise use backend 'emulated' (any device, every format) or 'torch'.")


def _te():  # imported only when used: it needs the NVIDIA driver
    return importlib.import_module("transformer_engine.pytorch")


def _te_check(te, kind: str) -> tuple[bool, str]:
    """TE's own (available, reason) for `kind` in fp8, fp8_block_scaling, mxfp8, nvfp4."""
    fn = getattr(te, f"is_{kind}_available", None)
    if fn is not None:                       # TE >= 2.9
        ok, why = fn(return_reason=True)
        return bool(ok), why
    from transformer_engine.pytorch.fp8 import FP8GlobalStateManager  # TE 2.6 - 2.8
    fn = getattr(FP8GlobalStateManager, f"is_{kind}_available", None)
    ok, why = fn() if fn else (False, f"this Transformer Engine has no {kind}; upgrade it")
    return bool(ok), why


def _autocast(te, enabled: bool, recipe, group=None):
    if hasattr(te, "autocast"):              # TE >= 2.9
        return te.autocast(enabled=enabled, recipe=recipe, amax_reduction_group=group)
    return te.fp8_autocast(enabled=enabled, fp8_recipe=recipe, fp8_group=group)


@functools.lru_cache(maxsize=1)
def probe() -> tuple[bool, str]:
    """(True, what this GPU can run) or (False, why not and how to fix). Never raises."""
    try:
        return _probe()
    except Exception as exc:  # a probe must answer, whatever the environment does
        return False, f"the Transformer Engine probe failed: {type(exc).__name__}: {exc}. {_HOW_TO_FIX}"


def _probe() -> tuple[bool, str]:
    if not torch.cuda.is_available():
        why = (f"torch {torch.__version__} is a CPU-only build" if torch.version.cuda is None else
               f"torch {torch.__version__} sees no CUDA device (check the driver, CUDA_VISIBLE_DEVICES)")
        te_note = ("transformer_engine is installed but cannot run without a GPU" if
                   importlib.util.find_spec("transformer_engine") else "transformer_engine is not installed")
        return False, f"Transformer Engine needs a CUDA GPU: {why}; {te_note}. {_HOW_TO_FIX}"
    try:
        te = _te()
    except Exception as exc:  # ImportError, OSError (libcuda.so.1, libtransformer_engine.so), ...
        return False, f"transformer_engine.pytorch does not import: {type(exc).__name__}: {exc}. {_HOW_TO_FIX}"
    major, minor = torch.cuda.get_device_capability()
    gpu = f"{torch.cuda.get_device_name()} (sm_{major}{minor})"
    if (major, minor) < (8, 9):
        return False, f"{gpu} has no FP8 tensor cores: FP8 needs compute capability 8.9+. {_HOW_TO_FIX}"
    ok, why = _te_check(te, "fp8")
    if not ok:
        return False, f"Transformer Engine reports no FP8 on {gpu}: {why}. {_HOW_TO_FIX}"
    extra = [f"{k} yes" if ok_k else f"{k} no ({why_k})"
             for k in ("fp8_block_scaling", "mxfp8", "nvfp4") for ok_k, why_k in [_te_check(te, k)]]
    version = getattr(importlib.import_module("transformer_engine"), "__version__", "?")
    return True, f"Transformer Engine {version} on {gpu}: fp8 yes; " + "; ".join(extra)


def require_te() -> None:
    """Raise a RuntimeError with the probe's reason unless Transformer Engine can run here."""
    ok, reason = probe()
    if not ok:
        raise RuntimeError(f"backend 'te' is not available: {reason}")




_POW2_ENV = {"Float8CurrentScaling": "NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES",
             "Float8BlockScaling": "NVTE_FP8_BLOCK_SCALING_FP32_SCALES"}


def recipe_for(fmt: Format | str):
    """A new TE recipe object for `fmt` (None for high precision). Needs Transformer Engine."""
    spec = recipe_spec(fmt)                  # an unsupported format fails here, before any import
    if spec is None:
        return None
    require_te()
    from transformer_engine.common import recipe as te_recipe
    name = get_format(fmt).name
    cls = getattr(te_recipe, spec.cls, None)
    if cls is None:
        raise RuntimeError(f"this Transformer Engine has no {spec.cls} (needed by {name!r}); upgrade it")
    kwargs = {k: te_recipe.Format[v] if k == "fp8_format" else v for k, v in spec.kwargs.items()}
    fields = getattr(cls, "__dataclass_fields__", {})
    recipe = cls(**kwargs, **{k: v for k, v in spec.pins.items() if k in fields})
    for attr in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
        qparams = getattr(recipe, attr, None)
        if spec.pow2_scales is not None and qparams is not None and \
                qparams.power_2_scale != spec.pow2_scales:
            raise RuntimeError(f"{spec.cls}.{attr}.power_2_scale is {qparams.power_2_scale} but {name!r} "
                               f"needs {spec.pow2_scales}: Transformer Engine fixed it at import from "
                               f"{_POW2_ENV[spec.cls]}; unset that variable.")
    return recipe


def supports(fmt: Format | str) -> tuple[bool, str]:
    """(True, "") if backend 'te' can run `fmt` here, else (False, why and what to do)."""
    try:
        fmt = get_format(fmt)
        spec = recipe_spec(fmt)
    except ValueError as exc:                # unknown name or UnsupportedFormatError
        return False, str(exc)
    ok, reason = probe()
    if not ok:
        return False, reason
    if spec is None:
        return True, ""
    ok, why = _te_check(_te(), spec.capability)
    return (True, "") if ok else (False, f"format {fmt.name!r} needs {spec.cls}, which this GPU "
                                         f"cannot run: {why}")


@contextlib.contextmanager
def autocast_region(amax_reduction_group=None):
    """Wrap one step's forward: delayed-scaling amaxes are then reduced once, at its exit,
    instead of at every site's own (then outermost) autocast. Sites keep their recipes."""
    from transformer_engine.common import recipe as te_recipe
    with _autocast(_te(), True, te_recipe.Float8CurrentScaling(), amax_reduction_group):
        yield


class TELinearSite(torch.nn.Module):
    """An `nn.Linear`'s own parameters, run through `te.Linear` in the site's current format.

    `set_format` switches without touching the parameters; promoting a site back into a
    delayed-scaling format starts it with a fresh amax history. `bf16` runs `F.linear`.
    """

    def __init__(self, linear: torch.nn.Linear, fmt: Format | str = "bf16", *,
                 name: str | None = None, amax_reduction_group=None):
        super().__init__()
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"TELinearSite wraps an nn.Linear, got {type(linear).__name__}")
        require_te()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight                      # the same Parameter objects: no copy
        self.register_parameter("bias", linear.bias)
        self.site_name, self.amax_reduction_group = name, amax_reduction_group
        self._te_modules: dict[Format, Any] = {}        # plain dict: no submodules, no TE extra state
        self._recipes: dict[Format, Any] = {}
        self.collect_stats = True     # TE computes its own scales; lowprec reads no statistics from it
        self.stats: dict = {}
        self.histories: dict = {}     # TE's delayed-scaling histories live in its modules
        self.format = get_format("bf16")
        self.set_format(fmt)

    def set_format(self, fmt: Format | str) -> None:
        """Switch to `fmt`; the parameters stay, a re-promoted delayed site starts afresh."""
        new = get_format(fmt)
        if new == self.format:
            return
        if not new.is_high_precision:
            recipe_spec(new)                             # UnsupportedFormatError names the way out
            ok, reason = supports(new)
            if not ok:
                raise RuntimeError(f"{self._where()}{reason}")
            self._check_shape(new)
            module = self._te_modules.get(new)
            if module is None:
                self._recipes[new] = recipe_for(new)
                self._te_modules[new] = self._build()
            elif new.input.scaling is Scaling.DELAYED:
                module.reset_fp8_meta_tensors()         # fresh history: zeros, scales 1 (TE #982)
        self.format = new

    def te_module(self, fmt: Format | str | None = None):
        """The te.Linear used for `fmt` (default: the current format), or None."""
        return self._te_modules.get(self.format if fmt is None else get_format(fmt))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.format.is_high_precision:
            return F.linear(x, self.weight, self.bias)
        module = self._te_modules[self.format]
        if module.weight is not self.weight:            # re-bind after a parameter swap
            module.weight = self.weight
        if self.bias is not None and module.bias is not self.bias:
            module.bias = self.bias
        if module.training != self.training:
            module.train(self.training)
        with _autocast(_te(), True, self._recipes[self.format], self.amax_reduction_group):
            return module(x)

    def _build(self):
        module = _te().Linear(self.in_features, self.out_features, bias=self.bias is not None,
                              params_dtype=self.weight.dtype, device="meta", name=self.site_name)
        module.weight = self.weight                     # replaces the meta placeholders
        if self.bias is not None:
            module.bias = self.bias
        return module

    def _check_shape(self, fmt: Format) -> None:
        out_f, in_f = self.out_features, self.in_features
        for rows, cols in [(16, 16), fmt.block_constraints().get("weight", (1, 1))]:
            if out_f % rows or in_f % cols:             # (16, 16): TE's FP8 GEMM alignment
                raise ValueError(
                    f"{self._where()}weight {out_f}x{in_f} does not fit {fmt.name!r} on "
                    f"backend 'te', which needs out_features % {rows} == 0 and in_features % {cols} "
                    "== 0; keep this layer in another format.")

    def _where(self) -> str:
        return f"site {self.site_name!r}: " if self.site_name else ""

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.bias is not None}, format={self.format.name}")


class TEBackend:
    """`lowprec.sites.backends.get_backend("te")`: sites are whole te.Linear modules, not GEMMs."""

    name = "te"
    fast_path = False     # sites are TE modules, not PrecisionLinear
    fp8_storage = False

    def supports(self, fmt: Format | str) -> tuple[bool, str]:
        return supports(fmt)

    def make_site(self, linear: torch.nn.Linear, fmt: Format | str = "bf16", *, name: str | None = None,
                  seed: int = 0, amax_group=None, amax_scope: AmaxScope = DEFAULT_AMAX_SCOPE, fused: bool = False, gemm=None,
                  layer_cls: type | None = None, shared_amax=None) -> TELinearSite:
        """A TELinearSite; `amax_group` is TE's `amax_reduction_group`. TE has its own cast kernels and
        random state, so `fused` and `seed` do not apply; a `layer_cls` is refused (TE makes the layer)."""
        if amax_scope is AmaxScope.LOCAL:   # every rank its own amaxes
            amax_group = None
        if layer_cls is not None:
            raise ValueError(f"the te backend makes its own layers; layer_cls={layer_cls.__name__} needs the "
                             f"emulated or torch backend")
        return TELinearSite(linear, fmt, name=name, amax_reduction_group=amax_group)
