"""``observe_engine``'s arguments: what is not an adapted backend is refused up front, by its type."""

from __future__ import annotations

import pytest

from readfence.core import ForwardMode
from readfence.engine import observe_engine


def test_a_name_not_an_adapted_engine_is_refused_naming_its_type():
    with pytest.raises(TypeError, match=r"^engine must be an adapted backend, got 'triton' \(str\); adapt the "
                                        r"engine's backend class first: readfence\.engine\.adapt\(BackendClass\)$"):
        observe_engine("triton", ForwardMode.DECODE, steps=1)  # type: ignore[arg-type]
