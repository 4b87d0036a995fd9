"""Other libraries' start-up chatter that is not the user's business, silenced while they load.

Importing torchao (lowprec's torchao backend, or transformers, which imports it while loading
its quantizers) logs one "Failed to load .../torchao/_C_*.so" line per optional C extension
the wheel ships for other GPUs or Python versions (the CPU build cannot load them, and nothing
lowprec uses needs them; pytorch/ao issue 2919), and torch's pytree logs a deprecation for
each Enum torchao registers as a constant (torch/utils/_pytree.py, `register_constant`).
`quiet_imports()` drops exactly those records, and only while the block runs: any other
message of those loggers, every warning and every other logger go through as before.
"""

from __future__ import annotations

import contextlib
import logging
import re

__all__ = ["quiet_imports", "NOISE"]

# (logger, message pattern) of the records dropped: nothing else is
NOISE = (("torchao", re.compile(r"^Failed to load .*torchao[/\\]_C\w*\.[\w.-]*so\b")),
         ("torch.utils._pytree", re.compile(r"is an Enum subclass and is now natively supported by torch\.compile"
                                            r".*register_constant\(\) on Enum subclasses is deprecated")))


class _Drop(logging.Filter):
    def __init__(self, pattern: re.Pattern):
        super().__init__()
        self.pattern = pattern

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


@contextlib.contextmanager
def quiet_imports():
    """While the block runs (an import), drop the `NOISE` records; the loggers are as they were after."""
    installed = [(logging.getLogger(name), _Drop(pattern)) for name, pattern in NOISE]
    for logger, f in installed:
        logger.addFilter(f)
    try:
        yield
    finally:
        for logger, f in installed:
            logger.removeFilter(f)
