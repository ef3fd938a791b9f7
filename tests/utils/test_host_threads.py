"""set_host_threads: a GPU process's intra-op pool is one thread unless OMP_NUM_THREADS or the run names a
number; the CPU keeps torch's default. (No CUDA call is made: a device object is enough.)"""

import pytest
import torch

from megatron_gptoss.utils.host import GPU_HOST_THREADS, set_host_threads


@pytest.fixture
def threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


@pytest.mark.usefixtures("threads")
def test_gpu_default_unless_the_environment_or_the_run_says(monkeypatch):
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    torch.set_num_threads(2)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert set_host_threads(cpu) == 0 and torch.get_num_threads() == 2
    assert set_host_threads(cuda) == GPU_HOST_THREADS and torch.get_num_threads() == GPU_HOST_THREADS
    torch.set_num_threads(2)
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    assert set_host_threads(cuda) == 0 and torch.get_num_threads() == 2
    assert set_host_threads(cuda, requested=1) == 1 and torch.get_num_threads() == 1
    assert set_host_threads(cpu, requested=2) == 2 and torch.get_num_threads() == 2
