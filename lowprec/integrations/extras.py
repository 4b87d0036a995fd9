"""The optional extra each integration needs, and the error that names it."""

from __future__ import annotations

import importlib
from types import ModuleType

__all__ = ["MissingExtraError", "require"]


class MissingExtraError(ImportError):
    """An integration was imported without its framework installed."""


def require(module: str, extra: str, framework: str) -> ModuleType:
    """Import `module` (the framework) or raise MissingExtraError saying what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(
            f"lowprec.integrations.{extra} needs {framework} (the Python module {module!r} could not be imported: "
            f"{e}); install it with: pip install 'lowprec[{extra}]'") from None
