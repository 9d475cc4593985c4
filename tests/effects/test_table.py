"""The one table renderer: columns as wide as their widest cell, rows by key or by position."""

import pytest

from readfence.effects.internal import table


def test_columns_fit_the_widest_cell_and_missing_keys_are_empty() -> None:
    text = table([{"a": "x", "b": "long value"}, {"a": "wider cell"}], {"a": "A", "b": "B"})
    assert text.splitlines() == ["A           B", "x           long value", "wider cell"]


def test_sequence_rows_are_read_in_column_order() -> None:
    assert table([[1, 2.5], ["three", None]], ["n", "x"]).splitlines() == ["n      x", "1      2.5", "three  None"]


def test_a_row_of_the_wrong_length_names_the_row_and_the_columns() -> None:
    with pytest.raises(ValueError, match=r"row 1 has 1 cells for 2 columns \['n', 'x'\]"):
        table([[1, 2], [3]], ["n", "x"])
