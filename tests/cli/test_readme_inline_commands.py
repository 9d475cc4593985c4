"""The ``readfence ...`` commands the prose and the console blocks of the README and of the docs'
pages show run as printed
(``test_readme_commands`` runs its bash blocks, ``test_readme_samples`` its samples): pasted
from the repository's root, none ends in a traceback, none is bad input (exit status 2) but those
the prose shows as bad input, each with the one line it quotes; 1, a finding, is what some of them
are there to show."""

from __future__ import annotations

import importlib.util
import re
import shlex

import pytest

from tests.command_runs import run_readfence
from tests.docs_pages import PAGES, ROOT, blocks, sampled_commands

pytestmark = pytest.mark.slow  # end to end: the full suite

RUN_ELSEWHERE = {line.strip() for _, _, block in blocks("bash") for line in block.splitlines()} | sampled_commands()


def shown_commands(text: str) -> list[str]:
    """Commands in backticks in the prose (a line break inside one is a space) and in console blocks.

    >>> shown_commands("run `readfence audit --engine m:f --mode\\ndecode` or\\n```console\\nreadfence plan paged\\n```")
    ['readfence audit --engine m:f --mode decode', 'readfence plan paged']
    """
    inline = [" ".join(c.split()) for c in re.findall(r"`(readfence [^`]+)`", text)]
    console = [line.strip() for block in re.findall(r"```console\n(.*?)```", text, flags=re.S)
               for line in block.splitlines() if line.strip().startswith("readfence ")]
    return list(dict.fromkeys(inline + console))


def runnable(command: str) -> bool:
    """A whole command to paste, not a name in a sentence (``readfence plan``), a form with
    placeholders (``--batch-size N``), the benchmarks (``test_bench``) or a tensor-parallel run
    (``test_tp``)."""
    words = shlex.split(command)
    return (len(words) > 2 and not any(re.fullmatch(r"[A-Z]+", w) for w in words)
            and words[1] != "bench" and "--tp" not in words and command not in RUN_ELSEWHERE)


#: Commands the prose shows to show readfence's answer to bad input (exit status 2), with the words it quotes.
BAD_INPUT = {"readfence plan pagedd": "unknown backend 'pagedd' (did you mean 'paged'?)"}

COMMANDS = list(dict.fromkeys(c for text in PAGES.values() for c in shown_commands(text) if runnable(c)))


def test_the_prose_shows_commands_to_run():
    assert len(COMMANDS) >= 3, COMMANDS


@pytest.mark.parametrize("command", COMMANDS)
def test_a_command_the_readme_shows_runs_as_printed(command):
    if "sglang" in command and importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed (pip install --no-deps -r tests/engine/sglang-requirements.txt)")
    if "--engine sglang." in command:
        # SGLang's own module by name: it imports sgl_kernel and torchvision, which load on a GPU machine
        # only (the README says so); tests.engine.sglang_engines is the way in on CPU, run above
        pytest.skip("needs SGLang's CUDA imports (sgl_kernel, torchvision)")
    code, out, err = run_readfence(shlex.split(command)[1:], str(ROOT))
    if command in BAD_INPUT:
        lines = (out + err).strip().splitlines()
        assert code == 2 and len(lines) == 1 and BAD_INPUT[command] in lines[0], f"{command}\n{out}\n{err}"
        return
    assert code in (0, 1), f"{command}\n{out}\n{err}"
    assert "Traceback" not in err and "Error:" not in err, err
