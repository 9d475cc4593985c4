"""readfence's internal API of ``races``: what the later parts of the package (and the tests) share
with it (not public: its names may change without notice)."""

from ._sglang_cpu import MODULES as MODULES
from ._sglang_cpu import STANDINS as STANDINS
from ._sglang_cpu import import_sglang as import_sglang
from ._sglang_cpu import real_triton as real_triton
