"""What a gate file says a gate may tolerate, typed and checked at load time: the largest
regression that still passes (`Tolerance`), the calibrated run-to-run noise (`Noise`), and
the field readers every gate key goes through (a finite number, a whole number in range, one
of the allowed words), each failing with the one parser's `ConfigError` that names the key."""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass

from lowprec.base.parse import ConfigError, check_keys, suggest
from lowprec.gates.errors import spec_error

__all__ = ["Tolerance", "Noise", "TOLERANCE_KINDS"]

TOLERANCE_KINDS = ("relative", "absolute")


def _number(x, key: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
        raise spec_error(f"must be a finite number, got {x!r}", key=key)
    return float(x)


def _integer(x, key: str, lo: int, hi: int) -> int:
    if isinstance(x, bool) or not isinstance(x, int) or not lo <= x <= hi:
        raise spec_error(f"must be a whole number from {lo} to {hi}, got {x!r}", key=key)
    return x


def _choice(x, key: str, allowed: tuple[str, ...]) -> str:
    if x not in allowed:
        raise spec_error(f"{x!r} is not allowed.{suggest(str(x), allowed)} Allowed: {', '.join(allowed)}.",
                            key=key)
    return x


@dataclass(frozen=True)
class Tolerance:
    """The largest regression that still passes: `absolute` (metric units) or `relative`
    (a fraction of |baseline value|: 0.02 is 2%)."""

    kind: str
    value: float

    # a gate file writes one as `{relative: 0.02}` or `{absolute: 0.01}` (`lowprec.base.parse`'s value types)
    config_description: typing.ClassVar[str] = "a mapping with one key, relative or absolute"

    @classmethod
    def from_config_value(cls, x) -> "Tolerance":
        how = "write `max_regression: {relative: 0.02}` (2% of the baseline value) or `{absolute: 0.01}`"
        check_keys(x, list(TOLERANCE_KINDS), "")
        if len(x) != 1:
            raise ConfigError("", f"needs exactly one of relative, absolute; found {len(x)} "
                                  f"({', '.join(map(str, x)) or 'none'}); {how}")
        (kind, value), = x.items()
        if value is None:
            raise ConfigError(kind, f"has no value; {how}")
        return cls(kind, value)

    def __post_init__(self):
        _choice(self.kind, "max_regression", TOLERANCE_KINDS)
        v = _number(self.value, f"max_regression.{self.kind}")
        if v < 0:
            raise spec_error(f"must be >= 0 (it is how much worse the candidate may be), got {v}; "
                                f"0 allows no regression at all", key=f"max_regression.{self.kind}")
        if self.kind == "relative" and v > 1:
            raise spec_error(f"is a fraction of the baseline value (0.02 = 2%), got {v}; write "
                                f"{v / 100:g} for {v:g}% or use `absolute:`", key="max_regression.relative")
        object.__setattr__(self, "value", v)

    def allowed(self, baseline_value: float) -> float:
        """The allowed regression in metric units, for this baseline value."""
        return self.value if self.kind == "absolute" else self.value * abs(baseline_value)

    def describe(self, baseline_value: float | None = None) -> str:
        if self.kind == "absolute":
            return f"{self.value:.4g} absolute"
        pct = f"{self.value * 100:.4g}% of baseline"
        return pct if baseline_value is None else f"{pct} = {self.allowed(baseline_value):.4g}"


@dataclass(frozen=True)
class Noise:
    """The calibrated noise of a gate's regression between two runs whose numerics are harmless,
    beyond the eval's own sampling error: `sd` (and `mean`), in the tolerance's units (a
    fraction of |baseline value| for a relative tolerance, metric units for an absolute one).
    experiments/gate_calibration.py measures it; `lowprec gate --power` uses it."""

    sd: float
    mean: float = 0.0

    def __post_init__(self):
        sd = _number(self.sd, "noise.sd")
        if sd < 0:
            raise spec_error(f"must be >= 0 (a standard deviation), got {sd}", key="noise.sd")
        object.__setattr__(self, "sd", sd)
        object.__setattr__(self, "mean", _number(self.mean, "noise.mean"))
