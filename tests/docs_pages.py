"""The pages a user reads: the README and every markdown page of the docs site (``docs/``).

The tests of the README's code blocks, samples and commands read all of them, so a block or a
command moved from the README to a page of the guide stays tested.
"""

from __future__ import annotations

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = {path.relative_to(ROOT).as_posix(): path.read_text()
         for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]}
SAMPLE = r"<!-- sample: (readfence [^\n]*?)(?: \| ([a-z ,]+))? -->"


def blocks(language: str) -> list[tuple[str, int, str]]:
    """Every fenced block in ``language``, as (page, index within that page's blocks, text).

    >>> [(page, i) for page, i, _ in blocks("python")][:1]
    [('README.md', 0)]
    """
    return [(page, i, block) for page, text in PAGES.items()
            for i, block in enumerate(re.findall(rf"```{language}\n(.*?)```", text, flags=re.S))]


def samples() -> list[tuple[str, str, str, str]]:
    """Every sample: (page, command, flags, the text block the page shows after the marker)."""
    return [(page, *found) for page, text in PAGES.items()
            for found in re.findall(SAMPLE + r"\n+```text\n(.*?)```", text, flags=re.S)]


def sampled_commands() -> set[str]:
    """The commands whose output some page shows as a sample."""
    return {command for text in PAGES.values() for command, _ in re.findall(SAMPLE, text)}
