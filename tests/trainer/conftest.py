"""Fixtures of tests/trainer."""

import pytest
import torch.distributed as dist


@pytest.fixture
def world_of_one(tmp_path):
    """A one-rank gloo process group for the test (the one already initialised, if any)."""
    if dist.is_initialized():
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/pg", rank=0, world_size=1)
    yield
    dist.destroy_process_group()
