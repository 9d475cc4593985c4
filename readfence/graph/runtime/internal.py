"""readfence's internal API of ``runtime``: what the later parts of the package share with it
(not public: its names may change without notice)."""

from ._loop import settled_on_error as settled_on_error
from ._options import CHECKS as CHECKS
from ._options import Options as Options
from ._options import as_record as as_record
from ._options import options_of as options_of
from ._options import said_in as said_in
from ._plot import LABEL_GAP as LABEL_GAP
from ._plot import MIN_BAR as MIN_BAR
from ._plot import OUTLIER as OUTLIER
from ._plot import step_ends as step_ends
from ._plot import timeline_figure as timeline_figure
from ._result import same_logits as same_logits
from ._traces import IN_FLIGHT as IN_FLIGHT
from ._traces import TRACE_STEPS as TRACE_STEPS
from ._traces import WaitRecorder as WaitRecorder
from ._traces import add_replays as add_replays
from ._traces import add_step_replays as add_step_replays
from ._traces import add_waits as add_waits
from ._traces import write_chrome_trace as write_chrome_trace
