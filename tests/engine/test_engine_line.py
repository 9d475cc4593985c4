"""Whose code a frame is: decided by where torch and readfence were imported from, never by a
path's spelling (a clone's folder is named ``readfence`` by default, and a venv may sit inside it)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from readfence.engine._contract import engine_line, library_file, origin_of

from .classes import KeptCopies
from .conftest import CFG

ROOT = pathlib.Path(__file__).resolve().parents[2]

ENGINE_CODE = '''
def forward(plan):
    return plan["kv_indices"]  # the engine's own line
'''


def _load(path: pathlib.Path):
    spec = importlib.util.spec_from_file_location(f"user_engine_{abs(hash(str(path)))}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("folder", ["readfence", "torch", os.path.join("readfence", ".venv", "lib", "torch")])
def test_a_users_file_in_a_folder_named_like_a_library_is_the_users(tmp_path, folder):
    where = tmp_path / folder / "my_engine.py"
    where.parent.mkdir(parents=True)
    where.write_text(ENGINE_CODE)
    module = _load(where)
    with pytest.raises(KeyError) as caught:
        module.forward({})
    assert not library_file(str(where))
    assert engine_line(caught.value) == f"{where}:3 in forward"
    assert origin_of(caught.value) == "engine"


def test_readfences_and_torchs_own_files_are_theirs_wherever_they_are():
    import torch

    import readfence
    from readfence.engine import _contract

    assert library_file(_contract.__file__) and library_file(torch.__file__)
    assert library_file(readfence.__file__, ("readfence",)) and not library_file(readfence.__file__, ("torch",))
    assert not library_file("<eval_with_key>.1") and not library_file(__file__)
    with pytest.raises(RuntimeError) as caught:
        torch.zeros(4).reshape(3, 5)
    assert engine_line(caught.value).startswith(f"{__file__}:")


def _copy_of_the_tree(dest: pathlib.Path) -> None:
    """The working tree's files (tracked and untracked, not ignored) copied to ``dest``."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


class LateLens(KeptCopies):
    """Declares PRE_REPLAY but reads the live lengths through the forward batch in every layer."""

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        self.lens = forward_batch.seq_lens.long()  # the engine's own line: the one an UNSOUND row names
        return super().forward(q, k, v, layer, forward_batch, save_kv_cache)


def test_an_unsound_row_names_the_engines_line_not_readfences_view():
    from readfence.core import ForwardMode
    from readfence.engine import adapt, audit_engine

    report = audit_engine(adapt(LateLens, cfg=CFG), ForwardMode.DECODE, batch_sizes=[2], steps=1).failure().report
    (row,) = [r for r in report.unsound() if r.buffer == "seq_lens"]
    line = LateLens.forward.__code__.co_firstlineno + 1
    assert row.where == f"{__file__}:{line} in forward", row.where
    assert f"at {__file__}:{line} in forward" in report.table()


@pytest.mark.slow
def test_the_engine_tests_pass_in_a_clone_folder_named_readfence(tmp_path):
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    clone = tmp_path / "readfence"
    _copy_of_the_tree(clone)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_", "PYTHONPATH"))}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                          "tests/engine/test_adapter.py", "tests/engine/test_engine_line.py", "-m", "not slow"],
                         cwd=clone, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    # the copy's own readfence ran, not the one installed in the environment
    probe = subprocess.run([sys.executable, "-c", "import readfence; print(readfence.__file__)"], cwd=clone,
                           env=env, capture_output=True, text=True, check=True)
    assert pathlib.Path(probe.stdout.strip()).is_relative_to(clone)
