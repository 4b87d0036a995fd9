"""lowprec: staged low-precision (FP8/FP4) rollout for PyTorch training.

The names a user starts from, imported when first used (module `__getattr__`), so that
`import lowprec` stays light: torch is imported, never MLflow, lm-eval or CUDA initialisation
(tests/test_lean_import.py holds it to that).

    prepare, PrecisionState          swap a model's planned Linear layers for switchable sites
    PrecisionPlan, LowprecConfig     the `precision:` section; the whole config file, typed
    ConfigError                      what a bad config raises (the key's path, what to do)
    Session, HostedRollout           your own loop; a framework's (HF, Lightning, torchtitan)
    Format, get_format, format_names the formats, named by strings at the edges

Quantizers, grids and element formats are in `lowprec.numerics`.
"""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

# name -> the module that defines it
_EXPORTS = {
    "prepare": "lowprec.sites.precision_state",
    "PrecisionState": "lowprec.sites.precision_state",
    "PrecisionPlan": "lowprec.sites.plan",
    "LowprecConfig": "lowprec.config",
    "ConfigError": "lowprec.base.parse",
    "Session": "lowprec.runtime.session.session",
    "HostedRollout": "lowprec.integrations.core",
    "Format": "lowprec.numerics.formats",
    "get_format": "lowprec.numerics.formats",
    "format_names": "lowprec.numerics.formats",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        from lowprec.base.parse import suggest
        raise AttributeError(f"module 'lowprec' has no attribute {name!r}.{suggest(name, list(_EXPORTS))} "
                             f"Numerics (quantize, E4M3, ...) are in lowprec.numerics")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value   # the next lookup finds it without __getattr__
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])
