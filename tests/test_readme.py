"""Every python code block in the README and in the docs' pages runs, in one namespace per block."""

import pytest

from tests.docs_pages import blocks

pytestmark = pytest.mark.slow  # end to end (the README, the scripts, worker processes): the full suite

BLOCKS = blocks("python")


def test_readme_has_python_blocks():
    assert sum(page == "README.md" for page, _, _ in BLOCKS) >= 1 and len(BLOCKS) >= 10


@pytest.mark.parametrize("page,index,block", [pytest.param(*b, id=f"{b[0]}:{b[1]}") for b in BLOCKS])
def test_readme_block_runs(page, index, block):
    namespace = {"__name__": f"docs_block_{index}"}
    exec(compile(block, f"{page}[python block {index}]", "exec"), namespace)
