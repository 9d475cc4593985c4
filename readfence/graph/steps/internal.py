"""readfence's internal API of ``steps``: what the later parts of the package share with it
(not public: its names may change without notice)."""

from ._capture import members as members
from ._capture import recapture as recapture
from ._capture import step_stale as step_stale
from ._composite import StreamOrder as StreamOrder
from ._composite import check_shares as check_shares
from ._target import LoweredStep as LoweredStep
from ._target import Target as Target
from ._target import check_run as check_run
from ._target import eager_step as eager_step
from ._target import lower_step as lower_step
from ._target import scheduling_mode as scheduling_mode
