"""The two ways a gate cannot be evaluated, kept apart because a user fixes them in different places.

* `GateSpecError`: the gate file is wrong (unknown key, bad direction, no tolerance, ...).
  It is the config parser's one `ConfigError` (`lowprec.base.parse`): `source` is the file,
  `path` the gate and the key (`gates[1] (eval/x/acc).confidence`), and its message says what
  was found, what is allowed and how to fix it, so one `except ConfigError` catches every bad
  file, config or gate.
* `GateInputError`: the numbers to compare cannot be had (a run id that is not in the store, a
  metric the run never logged, a tracking store that does not answer).

`lowprec gate` exits with status 2 on either, printing the message without a traceback.
"""

from __future__ import annotations

from lowprec.base.parse import ConfigError

__all__ = ["GateSpecError", "GateInputError", "spec_error"]


# A gate file's errors are the one parser's `ConfigError` (kept under this name for callers that
# catch it): its path is the gate and the key (`gates[1] (eval/x/acc).confidence`), its source the file.
GateSpecError = ConfigError


def spec_error(message: str, *, key: str = "", where: str = "", source: str = "") -> ConfigError:
    """The ConfigError of a gate file's `key` in the gate `where` (`gates[1] (eval/x/acc)`) of `source`."""
    return ConfigError(".".join(p for p in (where, key) if p), message, source=source)


class GateInputError(ValueError):
    """The baseline or candidate numbers a gate needs are not there (or cannot be reached)."""

