"""Compose read effects and see which fence end each platform can offer."""

from readfence.effects import Capabilities, ReadEffect, ReadEnd, degrade, resolve

paged = ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY, "seq_lens": ReadEnd.IN_REPLAY})
trtllm = ReadEffect.of({"req_to_token": ReadEnd.PRE_REPLAY, "swa_map": ReadEnd.PRE_REPLAY})
joined = paged | trtllm
for caps in (Capabilities(), Capabilities(in_graph_events=False)):
    print(f"{caps}: per buffer {degrade(joined, caps)!r}; joined end "
          f"{resolve(joined, owns_publish=True, caps=caps).name}")
