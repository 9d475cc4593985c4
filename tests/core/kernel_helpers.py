"""A ``@triton.jit`` helper whose module imports ``triton.language.core`` itself, as some of SGLang's do.

Triton's interpreter patches the language modules a kernel's globals hold for each launch and
puts them back after; a helper called from a kernel of another module patches ``triton.language.core``
again, and nothing puts that back. ``tests/core/test_kernel_ir.py`` launches a kernel calling it
and checks that readfence's IR builder still sees the language as triton defines it.
"""

from __future__ import annotations

import pytest

from tests.conftest import NO_TRITON, TRITON

if not TRITON:  # (collected for its doctests too: a clear skip, not an import error, without the extra)
    pytest.skip(NO_TRITON, allow_module_level=True)

import triton
import triton.language as tl
from triton.language import core


@triton.jit
def store_row(ptr, x, W: core.constexpr):
    tl.store(ptr + tl.arange(0, W), x)
