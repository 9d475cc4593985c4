"""readfence's internal API of ``lowering``: what the later parts of the package share with it
(not public: its names may change without notice)."""

from readfence.core.internal import preserved as preserved
from readfence.core.internal import restore as restore
from readfence.core.internal import snapshot as snapshot

from ._fence import check_owned as check_owned
from ._fence import claim_events as claim_events
from ._fence import event_owners as event_owners
from ._keywords import names_keywords as names_keywords
from ._keywords import unexpected_keyword as unexpected_keyword
from ._live_state import check_live_state as check_live_state
from ._live_state import device_of as device_of
from ._options import LOOP_KEYWORDS as LOOP_KEYWORDS
from ._options import for_a_loop as for_a_loop
from ._options import lowering_options as lowering_options
from ._options import set_by as set_by
from ._plan import placing_effect as placing_effect
from ._poison import poison_points as poison_points
from ._verdict import audit_verdict as audit_verdict
