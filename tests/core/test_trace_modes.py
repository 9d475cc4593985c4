"""The modes a stage is traced under: the indexing shims used under fake tensors on a device
this build lacks match torch's own indexing."""

from __future__ import annotations

import pytest
import torch

from readfence.core.tracing._trace_modes import _getitem, _setitem

_IDX = torch.tensor([2, 0])
CASES = [
    (slice(None), slice(1, 3)), (1,), (1, _IDX), (_IDX,), (Ellipsis, 1), (None, 0, slice(None, None, 2)),
    (slice(None), _IDX, 0), (_IDX, slice(1, 3)), (Ellipsis,), (0, Ellipsis, _IDX),
]


@pytest.mark.parametrize("index", CASES, ids=repr)
def test_getitem_and_setitem_shims_match_torch(index) -> None:
    t = torch.arange(3 * 4 * 5).reshape(3, 4, 5)
    assert torch.equal(_getitem(t, index), t[index])
    a, b = t.clone(), t.clone()
    a[index] = -1
    _setitem(b, index, -1)
    assert torch.equal(a, b)
