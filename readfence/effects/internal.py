"""readfence's internal API of ``effects``: what the other layers of the package share with it
(not public: its names may change without notice)."""

from ._names import parse_member as parse_member
from ._table import table as table

__all__ = ["parse_member", "table"]
