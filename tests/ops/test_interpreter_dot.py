"""The CPU interpreter's dot (`ops.interpreter`): each row of a product has the bits it has alone, whatever
the other rows of the tile hold, and the value of a float64 product within fp32 rounding."""

import os

import numpy as np
import pytest

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the CPU interpreter only")


def test_interpreter_dot_rows_are_independent():
    from triton.runtime import interpreter

    from megatron_gptoss.ops.interpreter import install_row_invariant_dot

    assert install_row_invariant_dot()
    import triton.language as tl

    builder = interpreter.InterpreterBuilder()
    rng = np.random.default_rng(0)
    for m, k, n in [(16, 16, 32), (16, 40, 16), (64, 64, 64)]:
        a = rng.standard_normal((m, k), dtype=np.float32)
        b = rng.standard_normal((k, n), dtype=np.float32)
        acc = interpreter.TensorHandle(np.zeros((m, n), np.float32), tl.float32)

        def dot(x, b=b, acc=acc):
            handles = (interpreter.TensorHandle(x, tl.float32), interpreter.TensorHandle(b, tl.float32))
            return builder.create_dot(*handles, acc, "ieee", 0).data

        full = dot(a)
        ref = a.astype(np.float64) @ b.astype(np.float64)
        assert np.abs(full - ref).max() <= 1e-5 * np.abs(ref).max()
        for i in range(m):
            alone = np.zeros_like(a)
            alone[0] = a[i]
            assert np.array_equal(dot(alone)[0], full[i])
