"""`StrEnum`: an enum of names whose members are their string values everywhere.

`Verdict.PASS == "pass"`, and `str()`, f-strings and JSON give the plain value, which is
what configs, events, MLflow tags and reports keep. Python 3.11's `enum.StrEnum` does this;
lowprec supports 3.10, so the few enums that are names at the edges derive from this one.
"""

from __future__ import annotations

import enum

__all__ = ["StrEnum"]


class StrEnum(str, enum.Enum):
    """A str-valued enum whose str() and format() are the value, not `Class.MEMBER`."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)
