"""README section 3's backend in a module, so that the command line can take it as MODULE:ATTR.

From the repository's root::

    readfence plan examples.my_backend:mine
    readfence audit examples.my_backend:mine --mode decode
    readfence verify examples.my_backend:model --steps 4 --batch-size 2
    readfence demo --spec examples.my_backend:model --steps 20 --trace run.json --plot run.png
"""

from readfence.backends import hybrid_linear, leaf, linear, page_meta, softmax_attention, store_kv
from readfence.core import ForwardMode
from readfence.effects import ReadEffect, ReadEnd


def snapshot(mode, shared, batch):  # reads the page table before the replay
    return page_meta(shared, batch)


def attend(mode, layer, q, k, v, pools, shared, batch, meta):
    store_kv(pools, layer, batch["out_cache_loc"], k, v)
    return softmax_attention(mode, q, pools, layer, meta["kv_indices"], meta["kv_lens"])


pre = ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY, "seq_lens": ReadEnd.PRE_REPLAY})
mine = leaf("mine", attend, prepare_out_graph=snapshot,
            declare={ForwardMode.DECODE: pre, ForwardMode.TARGET_VERIFY: pre})


def model():
    """A factory: the command line calls a function with no required argument for its backend."""
    return hybrid_linear(mine, linear())
