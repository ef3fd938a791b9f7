"""Marks for tests of Triton kernels. `needs_triton`: a GPU or the interpreter (TRITON_INTERPRET=1, which
tests/conftest.py sets on hosts without a GPU). `interpreted`: the test launches the kernels on CPU tensors,
so it needs the interpreter itself; on a GPU host the CUDA tests of the same kernels run instead."""

import os

import pytest
import torch

needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="Triton kernels need a GPU or TRITON_INTERPRET=1",
)
interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1"
)
