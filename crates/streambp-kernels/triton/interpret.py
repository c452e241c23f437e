"""Triton's interpreter on numpy arrays, without torch (which would weigh gigabytes in CI).

The interpreter reads a kernel's memory through raw pointers; it only needs each pointer argument's
address and element type, and copies torch tensors to and from "the host" around a launch. Here the
arrays are already in host memory, so those copies are skipped, and `pointer` gives an array's address
and Triton type. Import this before launching a kernel with `TRITON_INTERPRET=1` set.
"""

import numpy as np
import triton.runtime.interpreter as interpreter
import triton.runtime.jit as jit


class Pointer:
    """An array's first element as a kernel's pointer argument of Triton type `*dtype`."""

    def __init__(self, array, dtype):
        self.array = array
        self.dtype = dtype

    def data_ptr(self):
        return self.array.__array_interface__["data"][0]


def pointer(array, dtype):
    assert isinstance(array, np.ndarray)
    return Pointer(array, dtype)


def _mangle(arg, specialize=False):
    """Triton's type of a launch argument, as `jit.mangle_type` gives it for torch tensors."""
    if isinstance(arg, Pointer):
        return "*" + arg.dtype
    if isinstance(arg, bool):
        return "i1"
    if isinstance(arg, (int, np.integer)):
        return "i32" if -2**31 <= arg < 2**31 else "i64"
    if isinstance(arg, (float, np.floating)):
        return "fp32"
    raise TypeError(f"no Triton type for {type(arg).__name__}")


jit.mangle_type = _mangle
interpreter.GridExecutor._init_args_hst = lambda self, args, kwargs: (args, kwargs)
interpreter.GridExecutor._restore_args_dev = lambda self, *args: None
