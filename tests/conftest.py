import os

import pytest
import torch

# Without CUDA, Triton kernels run under its interpreter; the flag must be set before any module
# defines a kernel, so it is set here, before the tests (and what they import) are collected.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
