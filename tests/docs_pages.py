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


def shrink(argv: list[str]) -> list[str]:
    """A page's command made cheaper, showing the same things: a demo of 4 steps of 2 requests
    (unless it names its batch size); a serving run of 8 steps (its traffic's first prefills and
    decode steps in captured graphs), one repetition (``tests/cli/test_serve.py`` tests the
    repetitions) and, unless it names its capture sizes, graphs for 1, 2 and 4 requests (the
    first 8 steps of the default traffic still prefill, and decode 1 request and 3 padded to
    4: a larger graph would be lowered and never replayed); the page's flags otherwise unchanged.

    >>> shrink(["readfence", "demo", "--steps", "20"])
    ['readfence', 'demo', '--steps', '4', '--batch-size', '2']
    >>> shrink(["readfence", "serve", "paged", "--steps", "30", "--verify"])
    ['readfence', 'serve', 'paged', '--steps', '8', '--verify', '--repeat', '1', '--capture-sizes', '1,2,4']
    """
    out = list(argv)
    if argv[1:2] == ["serve"]:
        if "--steps" in out:
            out[out.index("--steps") + 1] = "8"
        defaults = {"--repeat": "1", "--capture-sizes": "1,2,4"}
        return out + [word for flag, value in defaults.items() if flag not in out for word in (flag, value)]
    if argv[1:2] != ["demo"]:
        return out
    if "--steps" in out:
        out[out.index("--steps") + 1] = "4"
    else:
        out += ["--steps", "4"]
    return out if "--batch-size" in out else [*out, "--batch-size", "2"]


def run_folder(argv: list[str], own: pathlib.Path) -> str:
    """Where a page's command runs: the repository's root, where the pages say to run them,
    but ``own`` (the test's folder) for a command that writes a file (``--trace``, ``--plot``).

    >>> run_folder(["readfence", "plan", "paged"], pathlib.Path("/t")) == str(ROOT)
    True
    """
    return str(own) if {"--trace", "--plot"} & set(argv) else str(ROOT)
