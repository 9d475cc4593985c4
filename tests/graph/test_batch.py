"""The host-side gather of a lowered step's inputs: order, missing keys, shapes, key counts."""

import pytest
import torch

from readfence.graph.lowering._batch import batch_gatherer


def _static(*shapes):
    return {f"in{i}": torch.zeros(s) for i, s in enumerate(shapes)}


@pytest.mark.parametrize("shapes", [(), ((4,),), ((4,), (4,), (2, 3), ())], ids=["none", "one", "four"])
def test_gathers_in_the_static_order_and_ignores_extra_keys(shapes):
    static = _static(*shapes)
    given = {k: torch.full(t.shape, float(i)) for i, (k, t) in enumerate(reversed(list(static.items())))}
    staged = batch_gatherer("g", static)({**given, "unused": torch.zeros(7)})
    assert isinstance(staged, tuple)
    assert [t is given[k] for k, t in zip(static, staged)] == [True] * len(static)
    assert len(staged) == len(static)


def test_each_wrong_shape_is_named_with_its_key_and_both_shapes():
    static = _static((4,), (2, 3))
    gather = batch_gatherer("low#1", static, " (batch_size=4)")
    ok = {"in0": torch.zeros(4), "in1": torch.zeros(2, 3)}
    assert gather(ok)[1] is ok["in1"]
    # each is refused; (1,), (1, 3) and () are shapes copy_ would broadcast silently
    for key, bad in [("in0", (1,)), ("in0", (3,)), ("in1", (3, 2)), ("in1", (1, 3)), ("in1", (6,)), ("in0", ())]:
        with pytest.raises(ValueError) as err:
            gather({**ok, key: torch.zeros(bad)})
        assert str(err.value) == (f"low#1: batch[{key!r}] has shape {bad}, the lowered graph was captured for "
                                  f"{tuple(static[key].shape)} (batch_size=4)")


def test_missing_keys_are_named_all_at_once():
    gather = batch_gatherer("low#2", _static((4,), (4,), (4,)))
    with pytest.raises(KeyError, match=r"low#2: batch is missing \['in0', 'in2'\]"):
        gather({"in1": torch.zeros(4)})
