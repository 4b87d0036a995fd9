"""Fixtures of the runtime tests: `one_rank`, a gloo process group of one rank (FSDP2 and meshes in-process)."""

import pytest


@pytest.fixture
def one_rank(gloo, tmp_path):
    gloo.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    yield
    gloo.destroy_process_group()
