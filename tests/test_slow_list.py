"""The list of measured-slow tests names modules that exist, so the quick tier's cut does not rot."""

from __future__ import annotations

import pathlib

from tests.conftest import measured_slow

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_every_listed_slow_test_is_in_a_module_of_the_repository():
    # (some test names are generated, as the law kit's: the module is what can be checked cheaply)
    listed = measured_slow()
    assert len(listed) > 50
    for node in listed:
        assert "::" in node and (ROOT / node.split("::")[0]).is_file(), node
