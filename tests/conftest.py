"""Fixtures shared by the test folders.

Plain helpers that tests import as functions or classes live in helper modules beside
the tests that use them (e.g. tests/lowprec/small_gpt.py, tracking_helpers.py); a
folder's own fixtures live in its conftest.py (tests/lowprec/conftest.py: MLflow).
"""

from __future__ import annotations

import shutil
import socket
from pathlib import Path

import pytest


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def free_port():
    """`free_port()`: a TCP port on 127.0.0.1 that nothing listens on right now."""
    return _free_port


@pytest.fixture(scope="session")
def gloo():
    """torch.distributed; skips the test where this torch build has no gloo backend."""
    import torch.distributed as dist
    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available in this build")
    return dist


@pytest.fixture(scope="session")
def tiny_lm():
    """`tiny_lm(folder, name="tinylm")`: copies tests/tiny_lm.py, a user's own model and data
    module, into `folder` as `<name>.py`; returns `name` (for `model.factory: <name>:build`)."""
    def write(folder: Path, name: str = "tinylm") -> str:
        shutil.copy(Path(__file__).with_name("tiny_lm.py"), Path(folder) / f"{name}.py")
        return name
    return write
