"""Why a layer runs the format it runs: which part of the precision plan decided it.

`lowprec.sites.resolution.resolve` gives every layer a `SiteReason`; `prepare` keeps the layers whose
reason is `keep_high_precision` out of the swap and `lowprec plan` prints the reason in its
"why" column. A small module of its own so that `PrecisionState` can type its sites with it
without importing the plan's parser.
"""

from __future__ import annotations

from dataclasses import dataclass

from lowprec.base.enums import StrEnum

__all__ = ["ReasonKind", "SiteReason"]


class ReasonKind(StrEnum):
    """Which part of the plan decided a layer's format."""

    KEEP_HIGH_PRECISION = "keep_high_precision"   # a precision.keep_high_precision selector: not swapped
    RULE = "rule"                                 # a precision.rules entry
    DEFAULT = "default"                           # precision.default


@dataclass(frozen=True)
class SiteReason:
    """Why a layer runs what it runs: the kind, and the rule or selector behind it (str() is what
    `lowprec plan` prints in its "why" column)."""
    kind: ReasonKind
    detail: str = ""   # the rule's name and selector, or the keep selector

    @property
    def kept_high_precision(self) -> bool:
        return self.kind is ReasonKind.KEEP_HIGH_PRECISION

    def __str__(self) -> str:
        return f"{self.kind.value} {self.detail}" if self.detail else self.kind.value
