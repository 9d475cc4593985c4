"""A ``@triton.jit`` helper whose module imports ``triton.language.core`` itself, as some of SGLang's do.

Triton's interpreter patches the language modules a kernel's globals hold for each launch and
puts them back after; a helper called from a kernel of another module patches ``triton.language.core``
again, and nothing puts that back. ``tests/core/test_kernel_ir.py`` launches a kernel calling it
and checks that readfence's IR builder still sees the language as triton defines it.
"""

from __future__ import annotations

import triton
import triton.language as tl
from triton.language import core


@triton.jit
def store_row(ptr, x, W: core.constexpr):
    tl.store(ptr + tl.arange(0, W), x)
