"""Other libraries' start-up chatter that is not the user's business, silenced while they load.

Importing torchao (lowprec's torchao backend, or transformers, which imports it while loading
its quantizers) logs one "Failed to load .../torchao/_C_*.so" line per optional C extension
the wheel ships for other GPUs or Python versions (the CPU build cannot load them, and nothing
lowprec uses needs them; pytorch/ao issue 2919), and torch's pytree logs a deprecation for
each Enum torchao registers as a constant (torch/utils/_pytree.py, `register_constant`).
`quiet_imports()` drops exactly those records, and only while the block runs: any other
message of those loggers, every warning and every other logger go through as before.

MLflow draws a "Downloading artifacts" progress bar on stderr for every artifact download,
unless its documented switch `MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR` is false
(https://mlflow.org/docs/latest/python_api/mlflow.environment_variables.html); MLflow reads it
at each download. `quiet_artifact_downloads()` turns that one switch off while the block runs
and puts it back after, so that `lowprec report` and `lowprec gate` print only their own lines.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re

__all__ = ["quiet_imports", "quiet_artifact_downloads", "NOISE"]

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


_PROGRESS_BAR = "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"


@contextlib.contextmanager
def quiet_artifact_downloads():
    """While the block runs, MLflow's artifact downloads draw no progress bar (module docstring);
    the switch is as it was after, the user's own setting included."""
    before = os.environ.get(_PROGRESS_BAR)
    os.environ[_PROGRESS_BAR] = "false"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(_PROGRESS_BAR, None)
        else:
            os.environ[_PROGRESS_BAR] = before
