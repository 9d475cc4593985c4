"""readfence's internal API of ``effects``: what the other layers of the package share with it
(not public: its names may change without notice)."""

from ._names import parse_member as parse_member
from ._spec_tokens import Token as Token
from ._spec_tokens import _Fail as _Fail
from ._spec_tokens import called_names as called_names
from ._spec_tokens import tokenize as tokenize
from ._spec_tokens import unknown_name as unknown_name
from ._table import one_line as one_line
from ._table import table as table

__all__ = ["Token", "called_names", "one_line", "parse_member", "table", "tokenize", "unknown_name"]
