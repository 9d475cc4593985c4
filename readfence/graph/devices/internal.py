"""readfence's internal API of ``devices``: what the later parts of the package share with it
(not public: its names may change without notice)."""

from ._copy import copy_all_from_host as copy_all_from_host
from ._cuda import self_check_error as self_check_error
from ._open import check_device as check_device
