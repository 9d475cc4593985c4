"""A case of the suite: a race an engine shipped, as a buggy and a fixed version, and where it comes from.

A :class:`Case` holds two zero-argument factories, ``buggy`` and ``fixed``, each building a
:class:`Subject`: the engine's code in the shape it had (its backend classes, its runner's
publish point, its staging ring), ready to be checked three ways, each independent of the
others: the audit (nothing runs), verify (the step run with poison on release, the write guard
and the read observer) and the overlapped run against the serial one (with the race sanitizer).
A check that finds something returns a :class:`Finding` naming the buffer and the user's line.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import attrs

from readfence.graph import Device


@attrs.frozen
class Source:
    """Where a case comes from: the public thread (``repository`` and pull-request or issue number,
    ``None`` where no thread could be checked) and the engine's ``file`` and ``function`` it follows.

    >>> print(Source("sgl-project/sglang", 37988, "speculative/eagle_draft_extend_cuda_graph_runner.py",
    ...              "EAGLEDraftExtendCudaGraphRunner.execute"))
    sgl-project/sglang#37988 (speculative/eagle_draft_extend_cuda_graph_runner.py: EAGLEDraftExtendCudaGraphRunner.execute)
    """

    repository: str
    thread: int | None
    file: str
    function: str
    also: tuple[int, ...] = ()  # related threads of the same repository

    def __str__(self) -> str:
        where = f"{self.file}: {self.function}"
        if self.thread is None:
            return f"{self.repository} (no thread checked; {where})"
        others = "".join(f", #{n}" for n in self.also)
        return f"{self.repository}#{self.thread}{others} ({where})"


@attrs.frozen
class Finding:
    """What one check found: ``check`` (``audit``, ``verify`` or ``run``), the ``buffer`` it names,
    the user's ``line`` (the reading op's source line, or the engine's method) and ``detail``."""

    check: str
    buffer: str | None
    line: str
    detail: str


@attrs.frozen
class RunOutcome:
    """The overlapped run against the serial one: the first step whose outputs differ (``None``:
    bit-identical) and what the race sanitizer found."""

    differs: int | None
    finding: Finding | None


@runtime_checkable
class Subject(Protocol):
    """One version of a case, ready to be checked (see the module docstring).

    ``audit`` runs nothing; ``verify`` and ``run`` run on ``device``; ``race`` is the deterministic
    evidence that the version races (a poisoned or held run that differs from the serial one,
    first step named), or ``None``.
    """

    @property
    def name(self) -> str:
        """What this version is, in a few words."""
        ...

    def audit(self) -> Finding | None: ...

    def verify(self, device: Device) -> Finding | None: ...

    def run(self, device: Device) -> RunOutcome: ...

    def race(self, device: Device) -> str | None: ...


@attrs.frozen
class Story:
    """A case's story in three lines: what the engine did, what went wrong, what readfence says."""

    did: str
    wrong: str
    says: str


@attrs.frozen
class Case:
    """A race an engine shipped: its ``buggy`` and ``fixed`` versions (zero-argument factories of a
    :class:`Subject`), its :class:`Source` and :class:`Story`. ``cpu`` says why the bug cannot show
    on the CPU device (``""``: it can, and the suite requires that it does); ``quick`` puts it in
    the quick subset; ``miss`` says why readfence does not catch it (``""``: it must).

    >>> from readfence.races import CASES
    >>> case = next(c for c in CASES if c.name == "sglang-tbo-forgets")
    >>> case.source.repository, callable(case.buggy)
    ('sgl-project/sglang', True)
    """

    name: str = attrs.field()
    title: str
    source: Source = attrs.field(validator=attrs.validators.instance_of(Source))
    story: Story = attrs.field(validator=attrs.validators.instance_of(Story))
    buggy: Callable[[], Subject] = attrs.field()
    fixed: Callable[[], Subject] = attrs.field()
    cpu: str = ""
    quick: bool = False
    miss: str = ""

    @name.validator
    def _check_name(self, _attribute: attrs.Attribute[str], value: str) -> None:
        if not isinstance(value, str) or not value or any(c.isspace() for c in value):
            raise ValueError(f"a case's name is one word (it names the case in the table), got {value!r}")

    @buggy.validator
    @fixed.validator
    def _check_factory(self, attribute: attrs.Attribute[Callable[[], Subject]], value: object) -> None:
        if not callable(value):
            raise TypeError(f"case {self.name!r}: {attribute.name} must be a function of no argument returning the "
                            f"version to check (an EngineSubject, StepSubject, StagingSubject...), got {value!r}")
