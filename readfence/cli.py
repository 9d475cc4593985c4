"""The ``readfence`` command."""

from __future__ import annotations

import click

from readfence import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="readfence")
def main() -> None:
    """readfence: exact, sound fences for shared buffers read during graph replay."""
