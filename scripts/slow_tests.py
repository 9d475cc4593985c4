"""Write ``tests/slow.txt``: the tests a timed run measured at ``--over`` seconds or more.

The quick tier (``pytest -m "not slow"``) leaves them out; ``tests/conftest.py`` marks each
listed test ``slow`` at collection, next to the tests marked in place. Regenerate it from a
full run on a quiet two-core machine when the suite changes (as pytest-split keeps its
durations file). A quick-tier run does not time the tests already listed, so they are kept:

    python -m pytest -q -n 2 -m "not slow" --junitxml=/tmp/run.xml
    python scripts/slow_tests.py /tmp/run.xml [--over 0.3]

From a full run (every test timed), ``--full`` writes the list afresh: a listed test the run
did not collect (renamed, removed) is dropped, as is one now under ``--over``.
"""

from __future__ import annotations

import argparse
import pathlib
import xml.etree.ElementTree as ET

ROOT = pathlib.Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "slow.txt"
HEADER = """\
# Tests measured at {over} s or more on a quiet two-core machine: the quick tier (-m "not slow")
# leaves them out, the full suite runs them. Written by scripts/slow_tests.py from a timed run.
"""


def node_id(classname: str, name: str) -> str:
    """pytest's node id of a JUnit test case: the module path, any classes, the name.

    >>> node_id("tests.graph.test_fence", "test_a[EXACT]")
    'tests/graph/test_fence.py::test_a[EXACT]'
    """
    parts = classname.split(".")
    for cut in range(len(parts), 0, -1):
        path = "/".join(parts[:cut]) + ".py"
        if (ROOT / path).is_file():
            return "::".join([path, *parts[cut:], name])
    raise ValueError(f"no module of the repository for test class {classname!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("junit", type=pathlib.Path, help="pytest --junitxml output of a timed run")
    parser.add_argument("--over", type=float, default=0.3, help="seconds at or above which a test is slow")
    parser.add_argument("--full", action="store_true", help="the run was the full suite: keep no earlier entry")
    args = parser.parse_args()
    cases = ET.parse(args.junit).iter("testcase")
    kept = ({line for line in OUT.read_text().splitlines() if line and not line.startswith("#")}
            if OUT.is_file() and not args.full else set())
    slow = sorted(kept | {node_id(c.get("classname", ""), c.get("name", "")) for c in cases
                          if float(c.get("time", 0)) >= args.over})
    OUT.write_text(HEADER.format(over=args.over) + "".join(f"{n}\n" for n in slow))
    print(f"{len(slow)} tests written to {OUT.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
