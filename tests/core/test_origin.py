"""Whose op an op is, decided by where it was registered, never by its namespace.

Attacks: an op defined in ``aten`` (``Library("aten", "FRAGMENT")``, ``torch.library.custom_op``), in
``prims`` (``torch.library.define``), in ``readfence``, in ``_c10d_functional`` named like a wait, in
``triton_kernel`` named like a launch; a kernel of one of torch's own ops replaced (a ``Library``
of kind ``IMPL``, ``torch.library.impl``). Each must count as someone else's op, so the checks that
take an op's schema at its word do not; torch's own ops (C++, ``prims``, the functional
collectives) and readfence's own escape marker stay trusted. The observer's independent view: an
op defined in ``aten`` whose kernel reads a shared buffer it was not given is seen reading it.
"""

from __future__ import annotations

import itertools
import warnings

import pytest
import torch
import torch.distributed._functional_collectives  # registers the collectives

from readfence.core import ReadObserver
from readfence.core.tracing import _collectives
from readfence.core.tracing._origin import readfence_op, torch_op, trusted_op
from readfence.core.tracing._triton import is_launch_op

_COUNT = itertools.count()


def _fresh(prefix: str) -> str:
    return f"rf_origin_{prefix}_{next(_COUNT)}"


@pytest.mark.parametrize("op", [torch.ops.aten.index_select.default, torch.ops.aten.add.Tensor,
                                torch.ops.aten.as_strided.default, torch.ops.prims.view_of.default,
                                torch.ops.prims.add.default, torch.ops._c10d_functional.wait_tensor.default,
                                torch.ops._c10d_functional.all_reduce.default], ids=str)
def test_torch_own_ops_are_torch_own(op) -> None:
    assert torch_op(op) and trusted_op(op)


@pytest.mark.parametrize("namespace", ["aten", "prims", "readfence", "rf_origin_user"])
def test_an_op_defined_with_a_library_fragment_is_no_one_s_own_whatever_its_namespace(namespace) -> None:
    lib = torch.library.Library(namespace, "FRAGMENT")
    name = _fresh("frag")
    lib.define(f"{name}(Tensor x) -> Tensor")
    lib.impl(name, lambda x: x.clone(), "CPU")
    op = getattr(getattr(torch.ops, namespace), name).default
    assert (torch_op(op), readfence_op(op), trusted_op(op)) == (False, False, False)


@pytest.mark.parametrize("namespace", ["aten", "prims", "rf_origin_user"])
def test_an_op_made_with_custom_op_or_library_define_is_no_one_s_own(namespace) -> None:
    name = _fresh("custom")

    @torch.library.custom_op(f"{namespace}::{name}", mutates_args=())
    def made(x: torch.Tensor) -> torch.Tensor:
        return x.clone()

    defined = _fresh("defined")
    torch.library.define(f"{namespace}::{defined}", "(Tensor x) -> Tensor")
    ns = getattr(torch.ops, namespace)
    assert not trusted_op(getattr(ns, name).default) and not trusted_op(getattr(ns, defined).default)


def test_a_torch_op_whose_kernel_another_library_replaced_is_no_longer_torch_s() -> None:
    op = torch.ops.aten.sinc.default
    assert torch_op(op)
    for register in ("IMPL", "impl"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch warns that a kernel is overridden
            if register == "IMPL":
                lib = torch.library.Library("aten", "IMPL")
                lib.impl("sinc", lambda x: x * 0, "CPU")
            else:
                lib = torch.library.Library("aten", "FRAGMENT")
                torch.library.impl("aten::sinc", "cpu", lambda x: x * 0, lib=lib)
        try:
            assert torch.equal(torch.sinc(torch.ones(2)), torch.zeros(2))  # the replacement runs
            assert not torch_op(op), register
        finally:
            lib._destroy()
        assert torch_op(op)  # torch's kernel back: torch's own again


def test_readfence_own_escape_marker_is_trusted_and_a_lookalike_is_not() -> None:
    assert readfence_op(torch.ops.readfence.opaque.default) and not torch_op(torch.ops.readfence.opaque.default)
    name = _fresh("lookalike")
    lib = torch.library.Library("readfence", "FRAGMENT")
    lib.define(f"{name}(Tensor t, str what) -> ()")
    assert not trusted_op(getattr(torch.ops.readfence, name).default)


def test_an_op_named_like_a_collective_wait_or_a_triton_launch_is_neither() -> None:
    name = _fresh("wait_tensor")
    lib = torch.library.Library("_c10d_functional", "FRAGMENT")
    lib.define(f"wait_tensor_{name}(Tensor a, Tensor b) -> Tensor")
    fake_wait = getattr(torch.ops._c10d_functional, f"wait_tensor_{name}").default
    launch = torch.library.Library("triton_kernel", "FRAGMENT")
    launch.define(f"{name}(int launch, Tensor[] reads, Tensor(a!)[] writes) -> ()")
    fake_launch = getattr(torch.ops.triton_kernel, name).default
    assert not _collectives.is_wait(fake_wait) and not _collectives.starts_collective(fake_wait)
    assert _collectives.is_wait(torch.ops._c10d_functional.wait_tensor.default)
    assert not is_launch_op(fake_launch)


def test_the_observer_sees_inside_an_op_defined_in_aten() -> None:
    # the kernel reads the live lengths it was not given (kept in a closure, as a plan/run kernel
    # keeps what plan stored): only an observer that runs the kernel under itself sees the read
    lens = torch.arange(6, dtype=torch.int32)
    for namespace in ("aten", "rf_origin_user"):
        lib = torch.library.Library(namespace, "FRAGMENT")
        name = _fresh("planned")
        lib.define(f"{name}(Tensor rows) -> Tensor")
        lib.impl(name, lambda rows: lens.index_select(0, rows), "CPU")
        op = getattr(getattr(torch.ops, namespace), name).default
        obs = ReadObserver({"seq_lens": lens})
        with obs, obs.stage("body"):
            out = op(torch.tensor([1, 3]))
        assert out.tolist() == [1, 3]
        assert [(a.buffer, a.op) for a in obs.accesses] == [("seq_lens", f"{op}/aten.index_select.default")], namespace
