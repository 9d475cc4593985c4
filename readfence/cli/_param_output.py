"""Where a command's output goes: a file option checked before anything runs, and the ``--json``
document every command prints the same way."""

from __future__ import annotations

import pathlib
from typing import Any

import click

from ._param_base import _fail


class OutputFile(click.ParamType):
    """A file to write, with ``suffix``: refused before anything runs when it cannot be written
    (a wrong suffix, a missing folder, something that is not a regular file, a place the user
    may not write). Nothing is left behind by the check.

    >>> OutputFile(".png").convert("timeline.txt", None, None)
    Traceback (most recent call last):
    ...
    readfence.cli._errors.InputError: invalid value 'timeline.txt': the file name must end in .png
    """

    name = "FILE"

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix
        self.expects = f"a file name ending in {suffix}"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> pathlib.Path:
        if isinstance(value, pathlib.Path):
            return value
        path = pathlib.Path(value)
        if path.suffix.lower() != self.suffix or not path.stem:
            raise _fail(param, value, f"the file name must end in {self.suffix}")
        folder = path.parent
        if not folder.is_dir():
            # a file where a folder should be is not a missing folder: say which it is
            if folder.exists():
                raise _fail(param, value, f"{str(folder)!r} is not a directory (it is a file)")
            raise _fail(param, value, f"directory {str(folder)!r} does not exist")
        if path.is_dir():
            raise _fail(param, value, f"{str(path)!r} is a directory; give a file name ending in {self.suffix}")
        if path.exists() and not path.is_file():
            raise _fail(param, value, "not a regular file")
        existed = path.exists()
        try:
            with open(path, "ab"):
                pass
        except OSError as e:
            raise _fail(param, value, f"cannot write there ({e.strerror})") from None
        if not existed:
            path.unlink()  # only checking: a run that fails leaves nothing behind
        return path


JSON_SCHEMA_VERSION = 1  # bumped when a --json key changes meaning or goes away (new keys do not)


def echo_json(doc: object) -> None:
    """Print a ``--json`` document: every object in it (one, or a list of them) carries
    ``schema_version``.

    >>> echo_json([{"policy": "EXACT"}])
    [
      {
        "schema_version": 1,
        "policy": "EXACT"
      }
    ]
    """
    import json

    def versioned(obj: Any) -> Any:
        return {"schema_version": JSON_SCHEMA_VERSION, **obj} if isinstance(obj, dict) else obj

    click.echo(json.dumps([versioned(o) for o in doc] if isinstance(doc, list) else versioned(doc), indent=2))
