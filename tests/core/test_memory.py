"""Memory spans and the tensors of a pytree: the fast paths give what the general rule gives."""

from __future__ import annotations

import collections

import pytest
import torch
from torch.utils import _pytree as pytree

from readfence.core.tracing._memory import BufferMap, Span, leaves, span_of, tensors_in

Pair = collections.namedtuple("Pair", "a b")
BASE = torch.arange(48, dtype=torch.int32).reshape(6, 8)


def _general(t: torch.Tensor) -> Span:
    # the definition: first to one past the last addressable element, strides included
    size, offset = t.element_size(), t.storage_offset()
    last = offset + sum((n - 1) * abs(s) for n, s in zip(t.shape, t.stride()))
    base = t.untyped_storage().data_ptr()
    return Span((t.device.type, t.device.index), base + offset * size, base + (last + 1) * size)


@pytest.mark.parametrize("view", [BASE, BASE[2], BASE[1:3], BASE.t(), BASE[:, 1], BASE[::2, 3:], BASE.view(-1)[5:],
                                  BASE.unsqueeze(0).expand(3, 6, 8), BASE[4:5, 2:3]])
def test_the_span_of_a_view_is_the_general_rules(view) -> None:
    assert span_of(view) == _general(view)


def test_tensors_without_addresses_get_spans_in_their_storage_space() -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode

    meta = torch.empty(4, 8, device="meta")
    with FakeTensorMode():
        fake = torch.empty(4, 8)
    for t in (meta, fake):
        s = span_of(t[1:3])
        assert not isinstance(s.space, tuple) and (s.start, s.stop) == (32, 96)
        assert span_of(t).overlaps(s)
    assert span_of(BASE[:0]) is None


@pytest.mark.parametrize("tree", [
    ((BASE[1], 1, [BASE, BASE]), {"dim": 0}),
    [BASE, (BASE[2], {"x": BASE, "y": [1.5, None, "s", torch.float32]})],
    Pair(BASE, [BASE[0]]),
    {"p": Pair(1, BASE)},
    torch.Size([2, 3]),
    BASE,
    (),
])
def test_the_leaves_of_a_tree_are_pytrees_in_the_same_order(tree) -> None:
    ours, theirs = leaves(tree), pytree.tree_leaves(tree)
    assert len(ours) == len(theirs)
    assert all(a is b or (not isinstance(a, torch.Tensor) and a == b) for a, b in zip(ours, theirs))


def test_a_buffer_map_names_what_a_tree_touches() -> None:
    shared = {"req_to_token": torch.zeros(4, 8, dtype=torch.int32), "seq_lens": torch.zeros(4, dtype=torch.int32)}
    bm = BufferMap.of(shared)
    args = ((shared["req_to_token"].t()[1], 2), {"out": [torch.zeros(3), Pair(shared["seq_lens"][2:], None)]})
    assert bm.touched_by(args) == {"req_to_token", "seq_lens"}
    assert [t.shape for t in tensors_in(args)] == [torch.Size([4]), torch.Size([3]), torch.Size([2])]
    assert BufferMap(()).touched_by(args) == frozenset()
