"""readfence's internal API of ``engine``: what the later parts of the package share with it
(not public: its names may change without notice)."""

from ._load import load_attribute as load_attribute
from ._load import load_engines as load_engines
