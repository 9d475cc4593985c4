"""Every ``readfence ...`` command in the bash blocks of the README and of the docs' pages runs
(``docs_pages.shrink``: with fewer demo and serve steps, from the repository's root).

A command whose printed output the README shows as a sample is run, and its output compared,
by ``tests/test_readme_samples.py``; the others run here (in-process but for the ``--tp`` runs:
the installed script is tested by ``tests/cli/test_script.py``).
"""

from __future__ import annotations

import json
import re
import shlex

import pytest

from tests.command_runs import run_readfence
from tests.docs_pages import PAGES, blocks, run_folder, sampled_commands, shrink

pytestmark = pytest.mark.slow  # end to end (the README, the scripts, worker processes): the full suite

TEXT = PAGES["README.md"]
COMMANDS = list(dict.fromkeys(line.strip() for _, _, block in blocks("bash") for line in block.splitlines()
                              if line.startswith("readfence ")))
SAMPLED = sampled_commands()


def test_readme_shows_the_commands():
    assert {shlex.split(c)[1] for c in COMMANDS} >= {"demo", "plan", "audit"}


def test_main_command_runs_the_demo():
    block = TEXT.split("<!-- main-command -->", 1)[1]
    command = re.search(r"```bash\n(.*?)\n```", block, flags=re.S).group(1)
    assert command.rstrip().endswith("&& readfence demo")
    assert '(python -c "import torch" 2>/dev/null || pip install torch==2.13.0)' in command


def test_some_commands_are_run_as_samples_and_the_rest_here():
    assert len(SAMPLED & set(COMMANDS)) >= 3 and len(set(COMMANDS) - SAMPLED) >= 5


@pytest.mark.parametrize("command", [c for c in COMMANDS if c not in SAMPLED])
def test_readme_command_runs(command, tmp_path):
    argv = shrink(shlex.split(command))
    code, stdout, stderr = run_readfence(argv[1:], run_folder(argv, tmp_path))
    assert code == 0, f"{command}\n{stdout}\n{stderr}"
    assert "Traceback" not in stderr
    if "--json" in argv:
        json.loads(stdout)
    for flag in ("--trace", "--plot"):
        if flag in argv:
            assert (tmp_path / argv[argv.index(flag) + 1]).stat().st_size > 0
