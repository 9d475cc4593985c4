"""The ``readfence`` command: ``demo``, ``plan``, ``audit``, ``verify`` and ``bench``.

>>> from click.testing import CliRunner
>>> result = CliRunner().invoke(main, ["--version"])
>>> result.output.startswith("readfence, version ")
True
"""

from __future__ import annotations

import click

from readfence import __version__

from ._audit_cmd import audit
from ._bench_cmd import bench
from ._demo_cmd import demo
from ._plan_cmd import plan
from ._verify_cmd import verify_cmd


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="readfence")
def main() -> None:
    """readfence: exact, sound fences for shared buffers read during graph replay.

    \b
    Start with `readfence demo`; `readfence plan SPEC` shows where fences go and why,
    `readfence audit` checks declarations against traced code, `readfence verify SPEC`
    checks the fences at run time (poison on release, a write guard, a read observer).
    """


for _command in (demo, plan, audit, verify_cmd, bench):
    main.add_command(_command)

__all__ = ["main"]
