"""``audit_engine``'s arguments: a mode given as a string is one (wrong) mode, not its letters;
``errors="report"`` audits every other (node, mode) when the engine's own code raises in one."""

from __future__ import annotations

import pytest

from readfence.core import ForwardMode
from readfence.engine import EngineError, adapt, audit_engine

from .classes import KeptCopies
from .conftest import CFG


class RaisesInExtend(KeptCopies):
    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        if forward_batch.forward_mode.name == "EXTEND":
            raise KeyError("no prefill plan")
        super().init_forward_metadata_out_graph(forward_batch, in_capture)


def test_a_mode_given_as_a_string_is_refused_as_one_mode_not_iterated():
    engine = adapt(KeptCopies, cfg=CFG)
    with pytest.raises(TypeError, match=r"^mode must be a ForwardMode, got 'decode' \(str\); did you mean "
                                        r"ForwardMode\.DECODE\?$"):
        audit_engine(engine, "decode", batch_sizes=[2], steps=1)
    with pytest.raises(ValueError, match="errors must be one of 'raise', 'report', got 'ignore'"):
        audit_engine(engine, ForwardMode.DECODE, batch_sizes=[2], steps=1, errors="ignore")


def test_errors_report_audits_the_other_modes_and_names_what_raised():
    engine = adapt(RaisesInExtend, cfg=CFG)
    modes = [ForwardMode.DECODE, ForwardMode.EXTEND]
    with pytest.raises(EngineError, match="RaisesInExtend.init_forward_metadata_out_graph raised KeyError in EXTEND"):
        audit_engine(engine, modes, batch_sizes=[2], steps=1)
    report = audit_engine(engine, modes, batch_sizes=[2], steps=1, errors="report")
    (failed,) = report.errors()
    assert failed.mode is ForwardMode.EXTEND and failed.rows == ()
    assert failed.error.startswith("RaisesInExtend.init_forward_metadata_out_graph raised KeyError in EXTEND: "
                                   "'no prefill plan' (at ") and "test_audit.py" in failed.error
    assert report.sound and {r.mode for r in report.rows()} == {ForwardMode.DECODE}
    assert "ERROR: RaisesInExtend in EXTEND: " in report.table()
