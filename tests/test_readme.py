"""Every python code block in the README runs, in order, in one namespace per block."""

import pathlib
import re

import pytest

pytestmark = pytest.mark.slow  # end to end (the README, the scripts, worker processes): the full suite

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def test_readme_has_python_blocks():
    assert len(BLOCKS) >= 2


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_block_runs(index):
    namespace = {"__name__": f"readme_block_{index}"}
    exec(compile(BLOCKS[index], f"README.md[python block {index}]", "exec"), namespace)
