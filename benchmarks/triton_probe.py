"""The trivial kernel of benchmarks/preflight.py: add one to each element. Its own module so that it is
defined (and TRITON_INTERPRET read) only when the preflight launches it, at module level as Triton's
JIT wants its source."""

import triton
import triton.language as tl


@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    tl.store(x_ptr + offsets, tl.load(x_ptr + offsets, mask=mask) + 1.0, mask=mask)
