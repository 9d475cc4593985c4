"""The base of readfence's dispatch modes: torch's, less the import of dynamo at the first op.

torch wraps every ``TorchDispatchMode.__torch_dispatch__`` so that dynamo never compiles the
handler's frames (``torch._disable_dynamo``): that wrapper imports ``torch._dynamo`` (with sympy
and the distributed tensor package: 1.7 s on a two-core machine) at the first op a mode sees,
and puts a Python wrapper around every op after. :class:`DispatchMode` keeps dynamo out the same way, at the
C level: the handler's frame is one dynamo skips (as ``torch._dynamo.skip_code`` marks it), and
the frame-evaluation callback that compiled code runs under is cleared for the handler's call and
restored after it (what the wrapper's ``_fn`` does); nothing is imported. A torch without these
C entry points keeps its own wrapper.

While any of readfence's modes is on, dynamo runs nothing compiled (:func:`eager_while_watched`):
code a stage calls runs as the Python it is, its ops seen one by one. This matters beyond
observing: torch runs a higher-order op such as ``torch.cond`` eagerly by compiling it, and a
compile made under a dispatch mode leaves a cache entry that makes every later eager call of
that op fail (torch's ``Unsupported``), in the step readfence lowers as in the user's own code.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from ._triton import see_launches

_EVAL_FRAME: Any = torch._C._dynamo.eval_frame
_set_eval_frame: Callable[[Any], Any] = _EVAL_FRAME.set_eval_frame
_AVAILABLE = all(hasattr(_EVAL_FRAME, name) for name in ("set_code_exec_strategy", "_FrameExecStrategy", "_FrameAction"))


def without_dynamo(handler: Callable[..., Any]) -> Callable[..., Any]:
    """``handler`` run with no frame-evaluation callback: code it calls is never compiled into
    a ``torch.compile``'d region it happens to be called from.

    >>> without_dynamo(lambda x: x + 1)(1)
    2
    """
    def run(*args: Any, **kwargs: Any) -> Any:
        prior = _set_eval_frame(None)
        try:
            return handler(*args, **kwargs)
        finally:
            _set_eval_frame(prior)

    # a frame of ``run`` is never compiled, even where dynamo's callback is set (a higher-order
    # op's branches traced by dynamo under the mode)
    skip = _EVAL_FRAME._FrameAction.SKIP
    functools.update_wrapper(run, handler)
    _EVAL_FRAME.set_code_exec_strategy(run.__code__, _EVAL_FRAME._FrameExecStrategy(skip, _EVAL_FRAME._FrameAction.DEFAULT))
    return run


#: The code of every handler :func:`without_dynamo` wraps (one code object for all of them).
_RUN_CODE = without_dynamo(lambda: None).__code__
_HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep  # readfence's folder


def runs_an_op_for_a_mode(code: Any) -> bool:
    """Whether a frame of ``code`` is readfence's dispatch machinery running an op for one of its
    modes (a handler, or the wrapper around one): an error raised below it is the op's, called
    where the frame above it is.

    >>> runs_an_op_for_a_mode(without_dynamo(len).__code__), runs_an_op_for_a_mode(without_dynamo.__code__)
    (True, False)
    """
    return code is _RUN_CODE or (getattr(code, "co_name", "") in ("__torch_dispatch__", "__torch_function__")
                                 and code.co_filename.startswith(_HERE))


class _Eager:
    """The dynamo stance ``force_eager`` while at least one of readfence's modes is on, on any
    thread (the stance is the process's): the first to enter sets it, the last to leave restores
    it. Dynamo is not imported for it: where it was not imported when the first mode entered and
    is when the last leaves (a stage's ``torch.cond`` imported it), what it compiled meanwhile, under
    a mode, is dropped from its caches."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.stance: Any = None
        self.imported = False

    def enter(self) -> None:
        with self.lock:
            self.depth += 1
            if self.depth > 1:
                return
            self.imported = "torch._dynamo" in sys.modules
            if self.imported:
                self.stance = torch.compiler.set_stance("force_eager")
                self.stance.__enter__()

    def exit(self) -> None:
        with self.lock:
            self.depth -= 1
            if self.depth > 0:
                return
            stance, self.stance = self.stance, None
            if stance is not None:
                stance.__exit__(None, None, None)
            elif "torch._dynamo" in sys.modules:
                torch._dynamo.reset_code_caches()


_EAGER = _Eager()


class DispatchMode(TorchDispatchMode):
    """A ``TorchDispatchMode`` whose subclasses' ``__torch_dispatch__`` runs
    :func:`without_dynamo` rather than under torch's lazily importing wrapper.

    >>> class Count(DispatchMode):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.ops = 0
    ...     def __torch_dispatch__(self, func, types, args=(), kwargs=None):
    ...         self.ops += 1
    ...         return func(*args, **(kwargs or {}))
    >>> with Count() as count:
    ...     _ = torch.ones(2) + 1
    >>> count.ops
    2
    """

    def __enter__(self) -> Any:
        see_launches()  # a triton launch made while readfence watches is an op (``_triton``)
        _EAGER.enter()
        try:
            return super().__enter__()
        except BaseException:
            _EAGER.exit()
            raise

    def __exit__(self, *exc: Any) -> Any:
        try:
            return super().__exit__(*exc)
        finally:
            _EAGER.exit()

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return not _AVAILABLE  # where ours can be applied (``__init_subclass__``), torch's is not

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        handler = cls.__dict__.get("__torch_dispatch__")
        if _AVAILABLE and handler is not None and not isinstance(handler, classmethod):
            cls.__torch_dispatch__ = without_dynamo(handler)  # type: ignore[method-assign]
