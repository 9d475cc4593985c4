"""readfence's caches: one object of named tables, each keyed by a frozen record, each entry
rechecked where it depends on something its key cannot hold."""

from __future__ import annotations

import attrs
import pytest

from readfence.backends import paged
from readfence.core import ForwardMode, audit, clear_trace_cache, trace
from readfence.core.internal import CACHES, Caches
from readfence.core.tracing._cache import Table
from tests.conftest import DEFAULT as CFG


@attrs.frozen
class Key:
    name: str


def test_every_cache_is_a_named_table_of_one_object_with_a_key_record() -> None:
    import readfence.graph  # noqa: F401 (registers its tables)

    rows = {row["table"]: row for row in CACHES.rows()}
    for name in ("traces", "bound", "validated", "ledgers", "observed", "observed_steps", "segment_ops",
                 "segment_templates", "kernel_access", "verdicts", "effect_joins", "effect_tables"):
        assert name in rows and rows[name]["key"].endswith(")") and rows[name]["what"]
    assert rows["traces"]["key"] == "TraceKey(code, mode, cfg, batch_size, device, seed)"
    assert rows["verdicts"]["key"].startswith("VerdictKey(backend, code, ")
    described = CACHES.describe()
    assert all(name in described for name in rows)
    with pytest.raises(ValueError, match="'traces' exists already"):
        CACHES.table("traces", Key, "again", limit=1)


def test_clearing_forgets_every_table_but_the_kept_memos() -> None:
    clear_trace_cache()
    trace(paged(), ForwardMode.DECODE, cfg=CFG)
    assert len(CACHES["traces"]) == 1 and len(CACHES["effect_tables"]) > 0
    clear_trace_cache()
    assert len(CACHES["traces"]) == 0 and len(CACHES["effect_tables"]) > 0


def test_a_table_is_bounded_by_count_and_by_weight() -> None:
    table: Table[Key, str] = Table("words", Key, "", limit=3, budget=10, weight=len)
    for word in ("alpha", "beta", "gamma"):
        table.put(Key(word), word)
    assert list(table) == [Key("beta"), Key("gamma")]  # 5 + 4 + 5 > 10: the oldest went
    assert table.get(Key("alpha")) is None and table.get(Key("beta")) == "beta"
    assert table.stats.hits == 1 and table.stats.misses == 3


def test_an_entry_rechecked_at_use_is_computed_again_once_it_no_longer_holds() -> None:
    table: Table[Key, int] = Table("checked", Key, "", limit=8)
    valid = {"yes": True}
    table.put(Key("a"), 1, check=lambda: None if valid["yes"] else "the input moved")
    assert table.get(Key("a")) == 1
    valid["yes"] = False
    assert table.get(Key("a")) is None and table.stats.stale == 1 and table.stats.last_stale == "the input moved"
    assert Key("a") not in table


def test_an_entry_computed_from_other_entries_is_current_only_while_they_are() -> None:
    caches = Caches()
    source = caches.table("source", Key, "", limit=8)
    derived = caches.table("derived", Key, "", limit=8)
    valid = {"yes": True}
    made: list[str] = []

    def from_source() -> int:
        made.append("derived")
        value = source.get(Key("s"))
        if value is None:
            value = source.put(Key("s"), 10, check=lambda: None if valid["yes"] else "stale source")
        return value + 1

    assert derived.compute(Key("d"), from_source) == 11 and derived.compute(Key("d"), from_source) == 11
    assert made == ["derived"]
    valid["yes"] = False  # the source no longer holds: neither does what was computed from it
    assert derived.get(Key("d")) is None and "stale source" in derived.stats.last_stale
    valid["yes"] = True
    assert derived.compute(Key("d"), from_source) == 11 and made == ["derived", "derived"]
    source.put(Key("s"), 20)  # replaced: the derived entry is computed again
    assert derived.compute(Key("d"), from_source) == 21
    assert derived.compute(Key("d"), lambda: 0) == 21  # a falsy value is a value
    zero = derived.compute(Key("z"), lambda: None)
    assert zero is None and derived.compute(Key("z"), lambda: 1) is None


def test_the_audit_and_its_traces_are_answered_from_the_tables() -> None:
    clear_trace_cache()
    traces, observed = CACHES["traces"], CACHES["observed"]
    audit(paged(), ForwardMode.DECODE, cfg=CFG)
    made = (traces.stats.misses, observed.stats.misses)
    audit(paged(), ForwardMode.DECODE, cfg=CFG)
    assert (traces.stats.misses, observed.stats.misses) == made  # every trace and observation a hit
