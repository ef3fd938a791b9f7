"""A mark for tests that launch Triton kernels on CPU tensors: they need the interpreter
(TRITON_INTERPRET=1, which tests/conftest.py sets on hosts without a GPU); on a GPU host the CUDA tests of
the same kernels run instead."""

import os

import pytest

interpreted = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="Triton kernels on CPU tensors need TRITON_INTERPRET=1"
)
