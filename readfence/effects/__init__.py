"""The effect lattice: read ends, per-buffer effects, platform capabilities and laws.

>>> from readfence.effects import ReadEnd, ReadEffect, Capabilities, degrade
>>> degrade(ReadEffect.of({"req_to_token": ReadEnd.IN_REPLAY}), Capabilities(in_graph_events=False))
ReadEffect({'req_to_token': POST_REPLAY}, default=NONE)
"""

from ._errors import ReadfenceError
from ._failure import NOT_A_BOOL, Failure, Success, UnwrapError
from ._platform import Capabilities, degrade, resolve
from ._position import Position, publish_positions
from ._read_effect import ReadEffect
from ._read_end import ReadEnd

__all__ = ["NOT_A_BOOL", "Capabilities", "Failure", "Position", "ReadEffect", "ReadEnd", "ReadfenceError", "Success",
           "UnwrapError", "degrade", "publish_positions", "resolve"]
