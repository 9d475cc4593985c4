"""Hypothesis strategies for the effect lattice, registered for ``st.from_type``.

Installed packages register these through hypothesis' plugin entry point, so in a user's
test suite ``st.from_type(ReadEnd)`` and ``st.from_type(ReadEffect)`` just work.

>>> from hypothesis import strategies as st
>>> isinstance(read_ends().example(), ReadEnd)
True
"""

from __future__ import annotations

from collections.abc import Sequence

from hypothesis import strategies as st

from ._platform import Capabilities
from ._read_effect import ReadEffect
from ._read_end import ReadEnd

#: A small alphabet of buffer names, so that generated effects collide on buffers.
BUFFERS: tuple[str, ...] = ("req_to_token", "seq_lens", "swa_map", "state_slots")


def read_ends() -> st.SearchStrategy[ReadEnd]:
    """Any read end; shrinks towards ``NONE``."""
    return st.sampled_from(list(ReadEnd))


def read_effects(buffers: Sequence[str] = BUFFERS) -> st.SearchStrategy[ReadEffect]:
    """Effects over ``buffers`` with a random default."""
    return st.builds(
        ReadEffect.of,
        st.dictionaries(st.sampled_from(list(buffers)), read_ends(), max_size=len(buffers)),
        default=read_ends(),
    )


def capabilities() -> st.SearchStrategy[Capabilities]:
    return st.builds(Capabilities, in_graph_events=st.booleans(), graphs=st.booleans())


def register() -> None:
    """Make ``st.from_type`` produce these strategies (idempotent)."""
    st.register_type_strategy(ReadEnd, read_ends())
    st.register_type_strategy(ReadEffect, read_effects())
    st.register_type_strategy(Capabilities, capabilities())


def _hypothesis_setup_hook() -> None:
    register()


register()
