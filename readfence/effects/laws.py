"""Reusable law suites: property-test a lattice or a closure operator in one line.

In a test module, one call registers one named pytest test per law::

    from readfence.effects import ReadEnd, laws
    from hypothesis import strategies as st

    laws.check_join_semilattice(
        st.from_type(ReadEnd), join=ReadEnd.join, leq=lambda a, b: a <= b,
        bottom=ReadEnd.NONE, top=ReadEnd.UNKNOWN, name="read_end",
    )
    # -> test_read_end_associativity, test_read_end_commutativity, ...

Inside a test, ``suite.check()`` runs every law and raises :class:`LawViolation` naming the
law, its equation and the (shrunk) inputs. Each ``check_*`` has a ``*_laws`` twin that only
builds the :class:`LawSuite`.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable
from typing import Any

import attrs
from hypothesis import given, settings as hsettings
from hypothesis import strategies as st

Eq = Callable[[Any, Any], bool]

_VARS = "abc"


class LawViolation(AssertionError):
    """A law failed: carries the law's name, its equation and the inputs."""

    def __init__(self, suite: str, law: Law, args: tuple[Any, ...], detail: str) -> None:
        shown = ", ".join(f"{v}={a!r}" for v, a in zip(_VARS, args))
        super().__init__(
            f"law {suite}.{law.name} failed: {law.equation}\n  with {shown}\n  {detail}"
        )
        self.suite, self.law, self.inputs, self.detail = suite, law, args, detail


@attrs.frozen
class Law:
    """One law: ``check(*args)`` returns ``None`` when it holds, else what went wrong."""

    name: str
    equation: str
    arity: int
    check: Callable[..., str | None]


def _equal(eq: Eq, lhs_text: str, rhs_text: str) -> Callable[[Any, Any], str | None]:
    def compare(lhs: Any, rhs: Any) -> str | None:
        return None if eq(lhs, rhs) else f"{lhs_text} = {lhs!r} but {rhs_text} = {rhs!r}"

    return compare


@attrs.frozen
class LawSuite:
    """Laws over values drawn from ``strategy``; run them or register them as pytest tests."""

    name: str
    strategy: st.SearchStrategy[Any]
    laws: tuple[Law, ...]
    max_examples: int = 200

    def law(self, name: str) -> Law:
        for law in self.laws:
            if law.name == name:
                return law
        raise KeyError(f"suite {self.name} has no law {name!r}; laws: {[x.name for x in self.laws]}")

    def check_law(self, name: str) -> None:
        """Run one law with hypothesis; raise :class:`LawViolation` on a counterexample."""
        law = self.law(name)

        @hsettings(max_examples=self.max_examples, deadline=None, database=None)
        @given(st.tuples(*[self.strategy] * law.arity))
        def run(args: tuple[Any, ...]) -> None:
            detail = law.check(*args)
            if detail is not None:
                raise LawViolation(self.name, law, args, detail)

        run()

    def check(self) -> None:
        """Run every law; the first failure raises :class:`LawViolation`."""
        for law in self.laws:
            self.check_law(law.name)

    def register(self, namespace: dict[str, Any]) -> LawSuite:
        """Add one ``test_<suite>_<law>`` function per law to ``namespace`` (a module's globals)."""
        for law in self.laws:
            test_name = f"test_{self.name}_{law.name}"
            if test_name in namespace:
                raise ValueError(f"{test_name} is already defined in this module")

            def test(law_name: str = law.name) -> None:
                self.check_law(law_name)

            test.__name__ = test.__qualname__ = test_name
            test.__doc__ = f"{self.name}: {law.equation}"
            test.__module__ = namespace.get("__name__", test.__module__)
            namespace[test_name] = test
        return self


def join_semilattice_laws(
    strategy: st.SearchStrategy[Any],
    *,
    join: Callable[[Any, Any], Any],
    leq: Callable[[Any, Any], bool],
    bottom: Any = None,
    top: Any = None,
    eq: Eq = operator.eq,
    name: str = "join_semilattice",
    max_examples: int = 200,
) -> LawSuite:
    """The laws of a join-semilattice (bounded if ``bottom``/``top`` are given).

    >>> suite = join_semilattice_laws(st.integers(0, 9), join=max, leq=operator.le, bottom=0)
    >>> [law.name for law in suite.laws][:3]
    ['associativity', 'commutativity', 'idempotence']
    """

    def assoc(a: Any, b: Any, c: Any) -> str | None:
        return _equal(eq, "(a | b) | c", "a | (b | c)")(join(join(a, b), c), join(a, join(b, c)))

    def comm(a: Any, b: Any) -> str | None:
        return _equal(eq, "a | b", "b | a")(join(a, b), join(b, a))

    def idem(a: Any) -> str | None:
        return _equal(eq, "a | a", "a")(join(a, a), a)

    def order(a: Any, b: Any) -> str | None:
        le, absorbed = leq(a, b), eq(join(a, b), b)
        return None if le == absorbed else f"a <= b is {le} but (a | b == b) is {absorbed}"

    def upper(a: Any, b: Any) -> str | None:
        j = join(a, b)
        ok = leq(a, j) and leq(b, j)
        return None if ok else f"a | b = {j!r} is not above both a and b"

    laws = [
        Law("associativity", "(a | b) | c == a | (b | c)", 3, assoc),
        Law("commutativity", "a | b == b | a", 2, comm),
        Law("idempotence", "a | a == a", 1, idem),
        Law("order_is_join", "a <= b  iff  a | b == b", 2, order),
        Law("join_is_upper_bound", "a <= a | b and b <= a | b", 2, upper),
    ]
    if bottom is not None:
        laws.append(
            Law("bottom_identity", "bottom | a == a", 1,
                lambda a: _equal(eq, "bottom | a", "a")(join(bottom, a), a))
        )
    if top is not None:
        laws.append(
            Law("top_absorbs", "top | a == top", 1,
                lambda a: _equal(eq, "top | a", "top")(join(top, a), top))
        )
    return LawSuite(name, strategy, tuple(laws), max_examples)


def closure_laws(
    strategy: st.SearchStrategy[Any],
    f: Callable[[Any], Any],
    *,
    leq: Callable[[Any, Any], bool],
    eq: Eq = operator.eq,
    name: str = "closure",
    max_examples: int = 200,
) -> LawSuite:
    """The laws of a closure operator: extensive, monotone, idempotent.

    >>> suite = closure_laws(st.integers(0, 9), lambda x: x + x % 2, leq=operator.le)
    >>> suite.check()
    """

    def extensive(a: Any) -> str | None:
        return None if leq(a, f(a)) else f"f(a) = {f(a)!r} is below a"

    def monotone(a: Any, b: Any) -> str | None:
        if not leq(a, b):
            return None
        return None if leq(f(a), f(b)) else f"a <= b but f(a) = {f(a)!r} is not <= f(b) = {f(b)!r}"

    def idempotent(a: Any) -> str | None:
        return _equal(eq, "f(f(a))", "f(a)")(f(f(a)), f(a))

    return LawSuite(
        name,
        strategy,
        (
            Law("extensive", "a <= f(a)", 1, extensive),
            Law("monotone", "a <= b  implies  f(a) <= f(b)", 2, monotone),
            Law("idempotent", "f(f(a)) == f(a)", 1, idempotent),
        ),
        max_examples,
    )


def monotone_laws(
    strategy: st.SearchStrategy[Any],
    f: Callable[[Any], Any],
    *,
    leq_in: Callable[[Any, Any], bool],
    leq_out: Callable[[Any, Any], bool],
    name: str = "monotone",
    max_examples: int = 200,
) -> LawSuite:
    """``f`` preserves order: ``a <= b`` implies ``f(a) <= f(b)`` (e.g. a combinator in a child)."""

    def monotone(a: Any, b: Any) -> str | None:
        if not leq_in(a, b):
            return None
        fa, fb = f(a), f(b)
        return None if leq_out(fa, fb) else f"a <= b but f(a) = {fa!r} is not <= f(b) = {fb!r}"

    return LawSuite(name, strategy, (Law("monotone", "a <= b implies f(a) <= f(b)", 2, monotone),),
                    max_examples)


def _caller_globals() -> dict[str, Any]:
    return sys._getframe(2).f_globals


def check_join_semilattice(strategy: st.SearchStrategy[Any], **kwargs: Any) -> LawSuite:
    """Register one pytest test per join-semilattice law in the calling module."""
    return join_semilattice_laws(strategy, **kwargs).register(_caller_globals())


def check_closure(strategy: st.SearchStrategy[Any], f: Callable[[Any], Any], **kwargs: Any) -> LawSuite:
    """Register one pytest test per closure-operator law in the calling module."""
    return closure_laws(strategy, f, **kwargs).register(_caller_globals())


def check_monotone(strategy: st.SearchStrategy[Any], f: Callable[[Any], Any], **kwargs: Any) -> LawSuite:
    """Register a pytest test that ``f`` is monotone in the calling module."""
    return monotone_laws(strategy, f, **kwargs).register(_caller_globals())
