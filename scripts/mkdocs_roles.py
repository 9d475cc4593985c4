"""A griffe extension for the API reference: turns the docstrings' cross-reference roles
(``:func:`eval_step```, ``:class:`~readfence.core.Stage```) into links.

The docstrings are read by ``help()`` and doctests as well as by the site, so they keep the
roles; this extension resolves each role's target in the scope of the object that holds the
docstring (as Python would resolve the name there) and writes a cross-reference that the site's
link resolver (mkdocs-autorefs) turns into a link to the rendered object, or into plain code
where the target is not rendered (a private helper). A role this extension cannot read is left
as it is, and ``scripts/mkdocs_hooks.py`` fails the build on it.
"""

from __future__ import annotations

import html
import re
from typing import Any

import griffe

#: A role as the docstrings write it: ``:kind:`target``` or ``:kind:`~dotted.target```.
ROLE = re.compile(r":(?:py:)?(?P<kind>func|class|meth|mod|attr|data|exc|obj|const):`(?P<target>[^`]+)`")


def _resolve(obj: griffe.Object, target: str) -> str | None:
    """The full path ``target`` names in ``obj``'s scope, or ``None`` if it names nothing there."""
    if target.startswith("readfence."):
        return target
    head, _, rest = target.partition(".")
    scope: griffe.Object | None = obj
    while scope is not None:
        try:
            path = scope.resolve(head)
        except (griffe.NameResolutionError, AttributeError, KeyError):
            scope = scope.parent
            continue
        return f"{path}.{rest}" if rest else path
    return None


def _public_paths(module: griffe.Module, out: dict[str, str]) -> dict[str, str]:
    """Canonical path -> the public path it is rendered under, for every name a package exports."""
    for member in module.members.values():
        if isinstance(member, griffe.Alias):
            try:
                if member.is_exported:
                    out.setdefault(member.final_target.path, member.path)
            except (griffe.AliasResolutionError, griffe.CyclicAliasError):
                pass  # an import of another package (``__future__``): not ours to render
        elif member.is_module:
            _public_paths(member, out)  # type: ignore[arg-type]
    return out


def _objects(obj: griffe.Object) -> list[griffe.Object]:
    found = [obj]
    for member in obj.members.values():
        if not member.is_alias:
            found.extend(_objects(member))  # type: ignore[arg-type]
    return found


def link_roles(text: str, obj: griffe.Object | None = None, public: dict[str, str] | None = None) -> str:
    """``text`` with every role replaced by an optional cross-reference to its resolved target
    (its public path where ``public`` maps the canonical one), shown as code: the last dotted part
    under ``~``, else the target as written.

    >>> link_roles("see :func:`~readfence.core.audit` and :meth:`run`")
    'see <autoref identifier="readfence.core.audit" optional><code>audit</code></autoref> and <code>run</code>'
    """

    def replace(m: re.Match[str]) -> str:
        target = m["target"].strip()
        short = target.startswith("~")
        target = target.lstrip("~.")
        title = f"<code>{html.escape(target.rsplit('.', 1)[-1] if short else target)}</code>"
        path = target if target.startswith("readfence.") else (None if obj is None else _resolve(obj, target))
        if path is None:
            return title
        path = (public or {}).get(path, path)
        return f'<autoref identifier="{html.escape(path)}" optional>{title}</autoref>'

    return ROLE.sub(replace, text)


class RoleLinks(griffe.Extension):
    """Rewrites the roles of every docstring of a package once it is loaded (see the module
    docstring): then every public name is known, and a role naming a private module's object links
    to where the package renders it."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        public = _public_paths(pkg, {})
        for obj in _objects(pkg):
            if obj.docstring is not None:
                obj.docstring.value = link_roles(obj.docstring.value, obj, public)
