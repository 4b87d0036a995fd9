"""The two ways a gate cannot be evaluated, kept apart because a user fixes them in different places.

* `GateSpecError`: the gate file is wrong (unknown key, bad direction, no tolerance, ...).
  It carries `source` (the file), `where` (`gates[1] (eval/x/acc)`) and `key`, and its message
  says what was found, what is allowed and how to fix it. It is the config parser's
  `ConfigError` (`lowprec.base.parse`: `path` is where and key), so one `except ConfigError`
  catches every bad file, config or gate.
* `GateInputError`: the numbers to compare cannot be had (a run id that is not in the store, a
  metric the run never logged, a tracking store that does not answer).

`lowprec gate` exits with status 2 on either, printing the message without a traceback.
"""

from __future__ import annotations

from lowprec.base.parse import ConfigError, cut_message

__all__ = ["GateSpecError", "GateInputError"]


class GateSpecError(ConfigError):
    """A gate file (or a Gate built in code) that cannot be used."""

    def __init__(self, message: str, *, key: str = "", where: str = "", source: str = ""):
        self.message, self.key, self.where, self.source = message, key, where, source
        self.path = ".".join(p for p in (where, key) if p)
        ValueError.__init__(self, self._text())

    def under(self, prefix: str) -> "GateSpecError":
        """This error with `prefix` (a gate file's place) as its `where` when it has none yet."""
        return self.located(where=prefix)

    def _text(self) -> str:
        place = ": ".join(p for p in (self.source, self.where, self.key) if p)
        return cut_message(f"{place}: {self.message}" if place else self.message, 2000)

    def located(self, *, source: str | None = None, where: str | None = None, key: str | None = None) -> "GateSpecError":
        """This error with the file / gate / key it belongs to filled in (those not yet known)."""
        return GateSpecError(self.message, key=self.key or key or "", where=self.where or where or "",
                             source=self.source or source or "")


class GateInputError(ValueError):
    """The baseline or candidate numbers a gate needs are not there (or cannot be reached)."""

