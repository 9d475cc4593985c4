"""The files a user looks for in a project: its license (and a build that declares it without
setuptools' deprecation warning), a changelog, a contributing guide, ``python -m readfence``, a
short README whose links lead somewhere, and docs whose every page the site lists."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys
import tomllib

import readfence

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_license_is_apache_2_as_pyproject_says_in_the_spdx_form():
    text = (ROOT / "LICENSE").read_text()
    assert text.lstrip().startswith("Apache License\n                           Version 2.0, January 2004")
    assert "END OF TERMS AND CONDITIONS" in text and "limitations under the License." in text
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0"  # an SPDX expression, not the deprecated table
    assert project["license-files"] == ["LICENSE"]
    setuptools = [r for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    assert setuptools == ["setuptools>=77"]  # the first setuptools that reads both


def test_the_build_declares_the_license_without_a_deprecation_warning(tmp_path):
    """What ``pip install -e .`` asks setuptools for, with its warnings turned into errors."""
    script = (
        "import warnings, setuptools.build_meta as b\n"
        "from setuptools.warnings import SetuptoolsDeprecationWarning\n"
        "warnings.simplefilter('error', SetuptoolsDeprecationWarning)\n"
        f"print(b.prepare_metadata_for_build_editable({str(tmp_path)!r}))\n"
    )
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    metadata = (tmp_path / run.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata and "License-File: LICENSE" in metadata


def test_the_changelog_has_the_current_version():
    text = (ROOT / "CHANGELOG.md").read_text()
    assert re.search(rf"^## {re.escape(readfence.__version__)}\b", text, flags=re.M), readfence.__version__


def test_contributing_runs_the_readmes_test_command_and_the_lint_ci_runs():
    readme, guide = (ROOT / "README.md").read_text(), (ROOT / "CONTRIBUTING.md").read_text()
    test_command = re.search(r"<!-- test-command -->\n```bash\n(.*?)\n```", readme, flags=re.S).group(1)
    assert test_command in guide
    assert "ruff check && mypy readfence" in guide and '-m "not slow"' in guide


def test_python_m_readfence_is_the_command():
    version = subprocess.run([sys.executable, "-m", "readfence", "--version"], capture_output=True, text=True,
                             timeout=120)
    assert version.returncode == 0 and version.stdout.strip() == f"readfence, version {readfence.__version__}"
    bare = subprocess.run([sys.executable, "-m", "readfence"], capture_output=True, text=True, timeout=120)
    assert bare.returncode == 2 and bare.stdout.startswith("Usage: readfence [OPTIONS] COMMAND")
    assert bare.stderr.strip().startswith("Error: missing command; commands: demo, plan, audit")


def test_the_readme_is_short_and_its_links_lead_to_files():
    assert len((ROOT / "README.md").read_bytes()) <= 12_000
    for page in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        prose = re.sub(r"`[^`]*`", "", re.sub(r"```.*?```", "", page.read_text(), flags=re.S))
        for target in re.findall(r"\]\(([^)#:]+)(?:#[^)]*)?\)", prose):
            assert (page.parent / target).exists(), f"{page.relative_to(ROOT)} links to {target}"


def test_the_site_lists_every_page_of_the_docs_and_builds_in_ci():
    config = (ROOT / "mkdocs.yml").read_text()
    listed = set(re.findall(r"^\s*-\s*(?:[^\n:]+:\s*)?([\w/.-]+\.md)\s*$", config, flags=re.M))
    pages = {p.relative_to(ROOT / "docs").as_posix() for p in (ROOT / "docs").rglob("*.md")}
    assert listed == pages
    assert "mkdocs build --strict" in (ROOT / ".ci" / "run").read_text()
    assert {r.split(">")[0].split("[")[0] for r in PYPROJECT["project"]["optional-dependencies"]["docs"]} == {
        "mkdocs", "mkdocs-material", "mkdocstrings"}
    assert "site/" in (ROOT / ".gitignore").read_text().split()
