"""Every ``--json`` document: each object carries ``schema_version``."""

from __future__ import annotations

import json

import pytest

from readfence.cli._params import JSON_SCHEMA_VERSION


@pytest.mark.parametrize("args", [
    ["plan", "paged"],
    ["plan", "eagle(paged, trtllm_mha)"],
    ["audit", "paged", "--mode", "decode", "--batch-size", "2"],
    ["verify", "paged", "--policy", "exact", "--steps", "1", "--batch-size", "1"],
    ["demo", "--policy", "exact", "--steps", "2", "--batch-size", "1"],
])
def test_every_json_object_carries_the_schema_version(cli, args):
    result = cli(*args, "--json")
    assert result.exit_code == 0, result.output
    doc = json.loads(result.output)
    objects = doc if isinstance(doc, list) else [doc]
    assert objects and all(o["schema_version"] == JSON_SCHEMA_VERSION for o in objects)
    assert len(objects[0]) > 1  # the version comes with the document, not instead of it
