"""readfence's internal API of ``runtime``: what the later parts of the package share with it
(not public: its names may change without notice)."""

from ._loop import same_logits as same_logits
