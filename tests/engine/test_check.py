"""``verify_engine``'s result: a failure exactly when a fence has a finding, carrying the whole
verification and naming the first fence with one; what is not an adapted backend is refused by its type."""

from __future__ import annotations

import pytest
from returns.pipeline import is_successful

from readfence.backends import paged
from readfence.core import ForwardMode
from readfence.engine import RUNNER, EngineFindings, EngineVerification, adapt, verify_engine
from readfence.graph import Policy

from .classes import KeepsAView, KeptCopies
from .conftest import CFG


def test_a_fence_with_a_finding_is_a_failure_carrying_the_whole_verification(dev):
    result = verify_engine(adapt(KeepsAView, cfg=CFG), device=dev, policies=[Policy.COARSE, Policy.EXACT], steps=2,
                           batch_size=2)
    assert not is_successful(result)
    failed = result.failure()
    assert isinstance(failed, EngineFindings) and isinstance(failed.report, EngineVerification)
    # the whole verification: the clean COARSE row too, and the two fences with findings in order
    assert [r.name for r in failed.report.rows] == ["COARSE", "EXACT", RUNNER] and failed.report.rows[0].clean
    assert [r.name for r in failed.rows] == ["EXACT", RUNNER] and failed.row.name == "EXACT"
    assert failed.message == (f"KeepsAView in DECODE: 2 of 3 fences with findings; first EXACT: "
                              f"{failed.report.row('EXACT').text()}"), failed.message
    assert failed.row.finding.kind == "unsound declaration" and str(failed) == failed.message
    with pytest.raises(ValueError, match="must have a finding"):
        EngineFindings(verify_engine(adapt(KeptCopies, cfg=CFG), device=dev, policies=[], steps=2, batch_size=2).unwrap())


def test_every_fence_clean_is_a_success(dev):
    result = verify_engine(adapt(KeptCopies, cfg=CFG), ForwardMode.DECODE, device=dev, policies=[Policy.EXACT],
                           steps=2, batch_size=2)
    assert is_successful(result), result.failure().message
    assert result.unwrap().ok and [r.name for r in result.unwrap().rows] == ["EXACT", RUNNER]


def test_a_readfence_backend_not_an_adapted_engine_is_refused_naming_its_type(dev):
    backend = paged()
    with pytest.raises(TypeError, match=rf"^engine must be an adapted backend, got <Backend paged> "
                                        rf"\({type(backend).__name__}\); adapt the engine's backend class first"):
        verify_engine(backend, device=dev, steps=2, batch_size=2)  # type: ignore[arg-type]
