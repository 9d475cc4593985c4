"""mkdocs hooks for the API reference: pages that open with their entry points, and a build that
fails on a docstring role left unrendered.

A reference page names its package and entry points in one line,

    <!-- api: readfence.core; entry: audit, trace; except: readfence.graph -->

which becomes the entry points' documentation first, then every other public name of the package
(its ``__all__``), less the entry points and the names the packages after ``except:`` already
document on their own pages. What a page lists is so computed from the packages' ``__all__`` when
the site is built, never kept by hand.
"""

from __future__ import annotations

import importlib
import os
import re
from typing import Any

from mkdocs.exceptions import PluginError

API = re.compile(r"^<!-- api: (?P<spec>[^>]*?) -->$", re.M)
#: A role as a docstring writes it, rendered raw: ``:func:`x``` read as text and code.
RAW_ROLE = re.compile(r":(?:py:)?(?:func|class|meth|mod|attr|data|exc|obj|const):(?:<code>|`)")


def _fields(spec: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for part in spec.split(";"):
        key, _, value = part.partition(":")
        out[key.strip()] = [v.strip() for v in value.split(",") if v.strip()]
    return out


def api_section(spec: str) -> str:
    """The mkdocstrings directives for one ``<!-- api: ... -->`` line (see the module docstring).

    >>> print(api_section("api: readfence.effects; entry: ReadEnd").splitlines()[0])
    ## Entry points
    """
    fields = _fields(f"api: {spec}" if not spec.startswith("api:") else spec)
    (package,) = fields["api"]
    entry = fields.get("entry", [])
    public = list(importlib.import_module(package).__all__)
    unknown = [n for n in entry if n not in public]
    if unknown:
        raise PluginError(f"reference page of {package}: entry point(s) {unknown} are not in its __all__")
    shown_elsewhere = {n for other in fields.get("except", []) for n in importlib.import_module(other).__all__}
    hidden = [*entry, *(n for n in public if n in shown_elsewhere)]
    lines = []
    if entry:
        lines += ["## Entry points", ""]
        for name in entry:
            lines += [f"::: {package}.{name}", "    options:", "      heading_level: 3", ""]
        lines += [f"## Everything else in `{package}`", ""]
    filters = ", ".join(['"!^_[^_]"', *(f'"!^{re.escape(n)}$"' for n in hidden)])
    lines += [f"::: {package}", "    options:", "      show_root_heading: false", "      show_root_toc_entry: false",
              f"      filters: [{filters}]", ""]
    return "\n".join(lines)


#: The packages the reference pages document, each with the pages it is on (filled as pages render).
_DOCUMENTED: dict[str, str] = {}


def on_page_markdown(markdown: str, *, page: Any, **kwargs: Any) -> str:
    for m in API.finditer(markdown):
        _DOCUMENTED[_fields(f"api: {m['spec']}")["api"][0]] = page.file.dest_uri
    return API.sub(lambda m: api_section(m["spec"]), markdown)


def on_post_build(*, config: Any, **kwargs: Any) -> None:
    """Every public name of every documented package has its heading on some reference page."""
    anchors: set[str] = set()
    for uri in set(_DOCUMENTED.values()):
        with open(os.path.join(config["site_dir"], uri), encoding="utf-8") as f:
            anchors |= set(re.findall(r'id="(readfence\.[^"]+)"', f.read()))
    missing = [f"{package}.{name}" for package in _DOCUMENTED for name in importlib.import_module(package).__all__
               if f"{package}.{name}" not in anchors
               and not any(f"{other}.{name}" in anchors for other in _DOCUMENTED if package.startswith(f"{other}."))]
    if missing:
        raise PluginError(f"public names with no entry in the API reference (a docstring, or a #: comment above a "
                          f"constant, makes one): {', '.join(missing)}")


def on_post_page(output: str, *, page: Any, **kwargs: Any) -> str:
    raw = RAW_ROLE.search(output)
    if raw is not None:
        start = max(0, raw.start() - 60)
        raise PluginError(f"{page.file.src_path}: a docstring role is left unrendered: ...{output[start:raw.end() + 40]}... "
                          f"(scripts/mkdocs_roles.py links :func:/:class:/... roles; write the target so it can)")
    return output
