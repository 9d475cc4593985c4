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

The laws run under the active hypothesis profile (``settings.load_profile``): its example
database, its ``max_examples``, its deadline, its phases. Where the profile keeps hypothesis'
own default the kit uses its own: 200 examples, no deadline (a law over backends may take
longer than 200 ms per example), and no explain phase (it would point at this module's lines
and make a failing check about 25 times slower). ``max_examples=`` given to a suite wins over
the profile, as a test's own ``@settings`` does.

A law whose premise is an order relation (``a <= b implies ...``) says nothing about pairs
that fail the premise, and two values drawn independently from a rich lattice are rarely
comparable. Such laws draw their pairs as ``(a, join(a, c))`` (see :func:`ordered_pairs`),
which is why the monotonicity suites take the lattice's ``join``.
"""

from __future__ import annotations

import operator
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
from hypothesis import Phase, given
from hypothesis import seed as hseed
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from ._errors import ReadfenceError

Eq = Callable[[Any, Any], bool]

_T = TypeVar("_T")
_U = TypeVar("_U")

_VARS = "abc"

# The explain phase would point at lines of this module, not of the code under test, and
# makes each failing check about 25 times slower.
_PHASES = tuple(p for p in Phase if p is not Phase.explain)

#: The kit's own settings, used where the active profile keeps hypothesis' default.
KIT_DEFAULTS: dict[str, Any] = {"max_examples": 200, "deadline": None, "phases": _PHASES}


def law_settings(max_examples: int | None = None) -> hsettings:
    """The settings a law runs under: the active profile's, with :data:`KIT_DEFAULTS` where
    the profile keeps hypothesis' default, and ``max_examples`` when given.

    >>> was = hsettings.get_current_profile_name()
    >>> hsettings.load_profile("default")
    >>> law_settings().max_examples, law_settings(7).max_examples
    (200, 7)
    >>> hsettings.register_profile("more", max_examples=1000)
    >>> hsettings.load_profile("more")
    >>> law_settings().max_examples, law_settings(7).max_examples
    (1000, 7)
    >>> hsettings.load_profile(was)
    """
    active, stock = hsettings.default, hsettings.get_profile("default")
    chosen = {k: v for k, v in KIT_DEFAULTS.items() if getattr(active, k) == getattr(stock, k)}
    if max_examples is not None:
        chosen["max_examples"] = max_examples
    return hsettings(active, **chosen)


class LawViolation(ReadfenceError, AssertionError):
    """A law failed: carries the law's name, its equation and the inputs."""

    def __init__(self, suite: str, law: Law, args: tuple[object, ...], detail: str) -> None:
        shown = ", ".join(f"{v}={a!r}" for v, a in zip(_VARS, args))
        super().__init__(
            f"law {suite}.{law.name} failed: {law.equation}\n  with {shown}\n  {detail}"
        )
        self.suite, self.law, self.inputs, self.detail = suite, law, args, detail


Draw = Callable[[st.SearchStrategy[Any]], st.SearchStrategy[tuple[Any, ...]]]


@attrs.frozen
class Law:
    """One law: ``check(*args)`` returns ``None`` when it holds, else what went wrong.

    ``draw`` turns the suite's strategy into a strategy of argument tuples; without it the
    ``arity`` arguments are drawn independently.
    """

    name: str
    equation: str
    arity: int
    check: Callable[..., str | None]
    draw: Draw | None = None

    def arguments(self, strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[tuple[Any, ...]]:
        """The strategy of argument tuples this law is checked on."""
        if self.draw is not None:
            return self.draw(strategy)
        return st.tuples(*[strategy] * self.arity)


def ordered_pairs(
    strategy: st.SearchStrategy[_T], join: Callable[[_T, _T], _T]
) -> st.SearchStrategy[tuple[_T, _T]]:
    """Pairs ``(a, b)`` with ``b = join(a, c)``: ``a <= b`` always, strictly unless ``c <= a``.

    >>> from hypothesis import find
    >>> find(ordered_pairs(st.integers(0, 9), max), lambda ab: ab[0] < ab[1])
    (0, 1)
    """
    return st.tuples(strategy, strategy).map(lambda ac: (ac[0], join(ac[0], ac[1])))


def _monotone_law(
    f: Callable[[Any], Any],
    *,
    join: Callable[[Any, Any], Any],
    leq_in: Callable[[Any, Any], bool],
    leq_out: Callable[[Any, Any], bool],
) -> Law:
    def monotone(a: Any, b: Any) -> str | None:
        if not leq_in(a, b):
            # b was built as join(a, c): a correct join and order cannot get here.
            return "b = join(a, c) is not >= a: the join and the order disagree"
        fa, fb = f(a), f(b)
        return None if leq_out(fa, fb) else f"a <= b but f(a) = {fa!r} is not <= f(b) = {fb!r}"

    return Law("monotone", "a <= b  implies  f(a) <= f(b)", 2, monotone,
               lambda strategy: ordered_pairs(strategy, join))


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
    max_examples: int | None = None  # None: the active profile's (see the module docstring)

    def law(self, name: str) -> Law:
        for law in self.laws:
            if law.name == name:
                return law
        raise KeyError(f"suite {self.name} has no law {name!r}; laws: {[x.name for x in self.laws]}")

    def check_law(self, name: str, *, seed: int | None = None) -> None:
        """Run one law with hypothesis; raise :class:`LawViolation` on a counterexample.

        ``seed`` fixes hypothesis' random choices (to reproduce or vary a run). The settings
        are the active profile's when the law runs (:func:`law_settings`).
        """
        law = self.law(name)

        @law_settings(self.max_examples)
        @given(law.arguments(self.strategy))
        def run(args: tuple[Any, ...]) -> None:
            detail = law.check(*args)
            if detail is not None:
                raise LawViolation(self.name, law, args, detail)

        if seed is not None:
            run = hseed(seed)(run)
        run()

    def check(self, *, seed: int | None = None) -> None:
        """Run every law; the first failure raises :class:`LawViolation`."""
        for law in self.laws:
            self.check_law(law.name, seed=seed)

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
    strategy: st.SearchStrategy[_T],
    *,
    join: Callable[[_T, _T], _T],
    leq: Callable[[_T, _T], bool],
    bottom: _T | None = None,
    top: _T | None = None,
    eq: Callable[[_T, _T], bool] = operator.eq,
    name: str = "join_semilattice",
    max_examples: int | None = None,
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

    def some_ordered(strategy: st.SearchStrategy[Any]) -> st.SearchStrategy[tuple[Any, ...]]:
        # Independent pairs test "not a <= b" against "a | b != b"; ordered pairs test the
        # other direction, which independent draws from a rich lattice rarely reach.
        return st.one_of(st.tuples(strategy, strategy), ordered_pairs(strategy, join))

    def upper(a: Any, b: Any) -> str | None:
        j = join(a, b)
        ok = leq(a, j) and leq(b, j)
        return None if ok else f"a | b = {j!r} is not above both a and b"

    laws = [
        Law("associativity", "(a | b) | c == a | (b | c)", 3, assoc),
        Law("commutativity", "a | b == b | a", 2, comm),
        Law("idempotence", "a | a == a", 1, idem),
        Law("order_is_join", "a <= b  iff  a | b == b", 2, order, some_ordered),
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
    strategy: st.SearchStrategy[_T],
    f: Callable[[_T], _T],
    *,
    join: Callable[[_T, _T], _T],
    leq: Callable[[_T, _T], bool],
    eq: Callable[[_T, _T], bool] = operator.eq,
    name: str = "closure",
    max_examples: int | None = None,
) -> LawSuite:
    """The laws of a closure operator: extensive, monotone, idempotent.

    ``join`` is the lattice's join; the monotone law is checked on pairs ``(a, join(a, c))``.

    >>> suite = closure_laws(st.integers(0, 9), lambda x: x + x % 2, join=max, leq=operator.le)
    >>> suite.check()
    """

    def extensive(a: Any) -> str | None:
        return None if leq(a, f(a)) else f"f(a) = {f(a)!r} is below a"

    def idempotent(a: Any) -> str | None:
        return _equal(eq, "f(f(a))", "f(a)")(f(f(a)), f(a))

    return LawSuite(
        name,
        strategy,
        (
            Law("extensive", "a <= f(a)", 1, extensive),
            _monotone_law(f, join=join, leq_in=leq, leq_out=leq),
            Law("idempotent", "f(f(a)) == f(a)", 1, idempotent),
        ),
        max_examples,
    )


def monotone_laws(
    strategy: st.SearchStrategy[_T],
    f: Callable[[_T], _U],
    *,
    join: Callable[[_T, _T], _T],
    leq_in: Callable[[_T, _T], bool],
    leq_out: Callable[[_U, _U], bool],
    name: str = "monotone",
    max_examples: int | None = None,
) -> LawSuite:
    """The law that ``f`` preserves order: ``a <= b`` implies ``f(a) <= f(b)``.

    E.g. a combinator in one child's declaration. ``join`` is the join of the input lattice
    (the one ``leq_in`` orders); the law is checked on pairs ``(a, join(a, c))``.

    >>> monotone_laws(st.integers(0, 9), lambda x: x // 2, join=max,
    ...               leq_in=operator.le, leq_out=operator.le).check()
    """
    return LawSuite(name, strategy, (_monotone_law(f, join=join, leq_in=leq_in, leq_out=leq_out),),
                    max_examples)


def _caller_globals() -> dict[str, Any]:
    return sys._getframe(2).f_globals


def check_join_semilattice(strategy: st.SearchStrategy[object], **kwargs: Any) -> LawSuite:
    """Register one pytest test per join-semilattice law in the calling module."""
    return join_semilattice_laws(strategy, **kwargs).register(_caller_globals())


def check_closure(strategy: st.SearchStrategy[_T], f: Callable[[_T], _T], **kwargs: Any) -> LawSuite:
    """Register one pytest test per closure-operator law in the calling module."""
    return closure_laws(strategy, f, **kwargs).register(_caller_globals())


def check_monotone(strategy: st.SearchStrategy[_T], f: Callable[[_T], object], **kwargs: Any) -> LawSuite:
    """Register a pytest test that ``f`` is monotone in the calling module."""
    return monotone_laws(strategy, f, **kwargs).register(_caller_globals())
