"""Triton's CPU interpreter (TRITON_INTERPRET=1) with a `tl.dot` whose rows do not depend on each other.

The interpreter computes `tl.dot` with `numpy.matmul`, that is with the BLAS library numpy was built with,
and some of its CPU kernels (OpenBLAS 0.3.30 on AMD Zen with AVX-512, for one) give a row of a product
bits that depend on the other rows of the tile. The batch-invariant kernels (`ops.batch_invariant`) then
stop being batch-invariant on the CPU although their tiling is. `install_row_invariant_dot` replaces the
interpreter's dot by `numpy.einsum` in the accumulator's dtype: each output element a sum over K in one
order, from its own row and column only, whatever the machine. GPUs are not affected.
"""

from __future__ import annotations

import os

import numpy as np


def install_row_invariant_dot() -> bool:
    """Patch the interpreter's dot (module doc) once, where TRITON_INTERPRET=1 and Triton is installed;
    returns whether the patched dot is in place."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return False
    try:
        from triton.runtime import interpreter
    except ImportError:
        return False
    builder = interpreter.InterpreterBuilder
    if getattr(builder.create_dot, "_row_invariant", False):
        return True
    library_dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        acc = d.data.dtype
        if a.dtype.primitive_bitwidth == 8 and a.dtype.is_floating():  # fp8: the interpreter's own path
            return library_dot(self, a, b, d, input_precision, max_num_imprecise_acc)
        product = np.einsum("...mk,...kn->...mn", a.data.astype(acc), b.data.astype(acc))
        return interpreter.TensorHandle(product + d.data, d.dtype.scalar)

    create_dot._row_invariant = True  # type: ignore[attr-defined]
    builder.create_dot = create_dot
    return True


install_row_invariant_dot()
