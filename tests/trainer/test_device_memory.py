"""run.device_memory_gib: the capacity the memory check compares with, the cap on a GPU's allocations, and
its validation."""

import pytest
import torch

from megatron_gptoss.config import load_config
from megatron_gptoss.errors import ConfigError
from megatron_gptoss.trainer.session import limit_device_memory, memory_capacity

GIB = 2**30


def test_capacity_is_the_cap_where_set():
    cuda = torch.device("cuda", 0)  # no CUDA call is made when a cap is given
    assert memory_capacity(cuda, 22.0) == (22.0 * GIB, "run.device_memory_gib of cuda:0")
    assert memory_capacity(torch.device("cpu"), 22.0)[0] != 22.0 * GIB  # the host is not capped


def test_negative_cap_is_refused():
    with pytest.raises(ConfigError, match="run.device_memory_gib"):
        load_config(None, ["model.preset=gpt_oss_tiny", "run.device_memory_gib=-1"])


@pytest.mark.gpu
def test_cap_fails_an_allocation_beyond_it():
    device = torch.device("cuda", 0)
    torch.cuda.empty_cache()
    held = torch.cuda.memory_reserved(device) / GIB  # what earlier tests of this process still hold
    try:
        limit_device_memory(device, held + 1.0)
        small = torch.empty(GIB // 2, dtype=torch.uint8, device=device)
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(2 * GIB, dtype=torch.uint8, device=device)
        del small
        with pytest.raises(ConfigError, match="exceeds the device"):
            limit_device_memory(device, 1e6)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
