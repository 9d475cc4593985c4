"""SGLang's attention modules imported on a machine without a GPU, with import-time stand-ins for
the modules they import that cannot run on CPU.

``triton`` and ``sgl_kernel`` are GPU kernel packages, and PyPI's ``torchvision`` wheel links
CUDA's libraries: none of them loads on the CPU build of torch. SGLang's attention modules
import them at module level (``@triton.jit`` kernels, ``sgl_kernel`` ops) without calling them
on the CPU paths tested here, so each is replaced by a module whose every attribute is an inert
class: a decorator returns the function it decorates, a call returns a stand-in. A stand-in
that a test would really call does nothing useful, so a test that reaches a GPU kernel fails on
its output, not silently.

Where the real ``triton`` is installed (the ``triton`` extra) it is used as it is: on a machine
without a GPU its kernels run in triton's interpreter (``TRITON_INTERPRET=1``, set here before
SGLang's kernels are decorated), and SGLang's ``TritonAttnBackend`` is imported too; only
``sgl_kernel`` and ``torchvision`` get stand-ins then.

torch itself looks for ``triton`` when some of its modules are first imported: those are
imported first, so torch never takes the stand-in for a real compiler.
The stand-ins are on ``sys.meta_path`` (and in ``sys.modules``) only while :func:`import_sglang`
imports SGLang's modules.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
import types
from collections.abc import Iterator
from typing import Any

import torch

#: The top-level modules replaced, and why (for the skip reason and the README).
STANDINS = {
    "triton": "GPU kernel compiler",
    "sgl_kernel": "SGLang's CUDA kernels",
    "torchvision": "PyPI's wheel links CUDA libraries",
}


class _Meta(type):
    def __getattr__(cls, name: str) -> Any:
        return _attribute(name)

    def __getitem__(cls, key: Any) -> Any:
        return cls

    def __or__(cls, other: Any) -> Any:
        return cls

    __ror__ = __or__


class _Inert(metaclass=_Meta):
    """Any attribute of a stand-in module: a class, a decorator, a value that is false."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if len(args) == 1 and callable(args[0]) and not kwargs:
            return args[0]
        return self

    def __getattr__(self, name: str) -> Any:
        return _attribute(name)

    def __getitem__(self, key: Any) -> Any:
        return self

    def __bool__(self) -> bool:
        return False


def _attribute(name: str) -> Any:
    if name.startswith("__") and name.endswith("__"):
        raise AttributeError(name)
    if name == "driver":  # triton.runtime.driver.active: no GPU here, as code that probes for one expects
        raise RuntimeError("no GPU driver (an import-time stand-in for triton)")
    return _Meta(name, (_Inert,), {})


class _Module(types.ModuleType):
    def __getattr__(self, name: str) -> Any:
        return _attribute(name)


def real_triton() -> bool:
    """Whether the real ``triton`` is installed: then it is imported as it is (on a machine without
    a GPU its kernels run in triton's interpreter, ``TRITON_INTERPRET=1``), and only the other
    modules get stand-ins."""
    return importlib.util.find_spec("triton") is not None


def _replaced() -> frozenset[str]:
    return frozenset(STANDINS) - ({"triton"} if real_triton() else set())


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self) -> None:
        self.replaced = _replaced()

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name.split(".")[0] in self.replaced:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        module.__version__ = "3.4.0"  # type: ignore[attr-defined]
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        pass


@contextlib.contextmanager
def _standins() -> Iterator[None]:
    for name in ("torch._dynamo", "torch._inductor.compile_fx", "torch.utils.flop_counter"):
        importlib.import_module(name)  # each looks for triton when first imported
    import torch.utils._triton as probe

    probe.has_triton_package()  # cached: torch knows triton is absent
    finder = _Finder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        # SGLang's modules keep the stand-ins they imported; nothing imported later finds them
        for name in [n for n in sys.modules if n.split(".")[0] in finder.replaced]:
            del sys.modules[name]


#: SGLang's attention modules the suite and the tests use.
MODULES = ("base_attn_backend", "torch_native_backend", "tbo_backend", "hybrid_attn_backend",
           "hybrid_linear_attn_backend", "minimax_sparse_backend", "dots_hybrid_backend")


def import_sglang() -> tuple[dict[str, types.ModuleType], str]:
    """``({name: module}, "")`` for :data:`MODULES` of SGLang's attention package, or ``({}, why)``
    when SGLang (or a package its modules import) is not installed."""
    import warnings

    if real_triton() and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is decorated: before SGLang's modules
    try:
        with _standins(), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            found = {name: importlib.import_module(f"sglang.srt.layers.attention.{name}") for name in MODULES}
            if real_triton():  # its constructor launches nothing, but builds triton's launch parameters
                found["triton_backend"] = importlib.import_module("sglang.srt.layers.attention.triton_backend")
            importlib.import_module("sglang.srt.server_args")
            importlib.import_module("sglang.srt.runtime_context")
            importlib.import_module("sglang.srt.layers.radix_attention")
    except ImportError as e:
        return {}, (f"SGLang's attention modules cannot be imported ({type(e).__name__}: {e}); .ci/run installs "
                    f"sglang==0.5.23 --no-deps and what they import")
    return found, ""
