"""What a triton kernel's IR (TTIR) reads and writes, by argument: the dataflow half of the IR analysis.

:func:`ttir_access` reads a TTIR module (``_kernel_ir`` builds it) into values and, for each value,
the values it may come from, then follows each memory op's address back to the kernel's
arguments (see ``_kernel_ir``'s docstring for the rules). Ops are told apart by what TTIR says
they do: the memory ops by name (the ops of TritonOps.td with a MemRead or MemWrite effect), the
arithmetic dialects, the structured control flow whose values it pairs (``scf.for``'s carried
values, ``scf.while``'s, ``scf.if``'s results), unstructured branches, and calls into the
module's other functions. An op it does not know raises :class:`Unanalysable`, and the caller
reads and writes every argument.

>>> _known("tt.store"), _known("arith.addi"), _known("ttng.tensormap_create")
(True, True, False)
"""

from __future__ import annotations

import inspect
import re
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import attrs

from readfence.effects import ReadfenceError

from ._kernel_access import FROM_IR, KernelAccess

#: Memory ops by what they do at the address of their first operand (TritonOps.td: the ops with a
#: MemRead or MemWrite effect).
WRITES = frozenset({"tt.store", "tt.atomic_store", "tt.descriptor_store", "tt.descriptor_scatter",
                    "tt.descriptor_reduce", "tt.experimental_descriptor_store"})
READS = frozenset({"tt.load", "tt.atomic_load", "tt.atomic_poll", "tt.descriptor_load", "tt.descriptor_gather",
                   "tt.experimental_descriptor_load"})
READ_WRITES = frozenset({"tt.atomic_rmw", "tt.atomic_cas"})
#: Ops of triton's dialect with no memory effect: their results carry their operands' provenance.
PURE = frozenset({
    "tt.addptr", "tt.advance", "tt.assert", "tt.bitcast", "tt.broadcast", "tt.cat", "tt.clampf", "tt.dot",
    "tt.dot_scaled", "tt.expand_dims", "tt.fp_to_fp", "tt.gather", "tt.get_num_programs", "tt.get_program_id",
    "tt.histogram", "tt.join", "tt.make_range", "tt.make_tensor_descriptor", "tt.make_tensor_ptr", "tt.mulhiui",
    "tt.precise_divf", "tt.precise_sqrt", "tt.print", "tt.ptr_to_int", "tt.reduce.return", "tt.reshape",
    "tt.return", "tt.scan.return", "tt.splat", "tt.split", "tt.trans", "tt.unsplat", "scf.yield", "scf.condition",
    "gpu.barrier", "ttg.barrier", "ub.poison", "tt.grid_dependency_wait", "tt.grid_dependency_launch_dependents",
})
#: Unstructured branches (an early ``return``): their operands become the arguments of blocks of their region.
BRANCHES = frozenset({"cf.br", "cf.cond_br"})
#: Dialects whose every op is arithmetic on values.
PURE_DIALECTS = ("arith.", "math.")
#: Ops that run code the analysis cannot read unless marked pure.
OPAQUE = frozenset({"tt.elementwise_inline_asm", "tt.extern_elementwise"})


class Unanalysable(ReadfenceError):
    """The IR holds something the analysis cannot follow: every argument is read and written."""


@attrs.frozen
class _Op:
    name: str
    operands: tuple[int, ...]
    results: tuple[int, ...]
    block: int
    regions: tuple[int, ...]
    site: str
    callee: str = ""
    pure: bool = True
    pointer_result: bool = False


@attrs.frozen
class _Function:
    params: tuple[int, ...]
    ops: tuple[_Op, ...]


@attrs.frozen
class _Summary:
    """One IR function's effects by argument index: where each is written or read, the argument
    indices whose loaded values index it, and why its memory is unbounded (``""``: it is not)."""

    writes: Mapping[int, str]
    reads: Mapping[int, str]
    indexed: Mapping[int, frozenset[int]]
    unbounded: str


class _Graph:
    """The IR read into values and the values each may come from (its *sources*)."""

    def __init__(self, module: Any) -> None:
        self.sites = _Sites(str(module))
        self.block_ops: dict[int, list[_Op]] = defaultdict(list)
        self.block_args: dict[int, tuple[int, ...]] = {}
        self.region_blocks: dict[int, list[int]] = defaultdict(list)
        self.block_region: dict[int, int] = {}
        self.functions: dict[str, _Function] = {}
        self.sources: dict[int, set[int]] = defaultdict(set)
        self.loaded: dict[int, int] = {}  # a value read from memory -> the address it was read at
        self.summaries: dict[str, _Summary] = {}
        pending: list[_Op] = []

        def visit(op: Any) -> None:  # called bottom-up: a region's ops before the op holding it
            name = op.get_name()
            if name == "builtin.module":
                return
            block = op.get_block()
            bid = block.id() if block is not None else -1
            if block is not None and bid not in self.block_args:
                self.block_args[bid] = tuple(block.get_argument(i).id() for i in range(block.get_num_arguments()))
                region = block.get_parent()
                if region is not None:
                    self.region_blocks[region.id()].append(bid)
                    self.block_region[bid] = region.id()
            results = tuple(op.get_result(i) for i in range(op.get_num_results()))
            record = _Op(name, tuple(op.get_operand(i).id() for i in range(op.get_num_operands())),
                         tuple(r.id() for r in results), bid, tuple(op.get_region(i).id() for i in range(op.get_num_regions())),
                         self.sites.next(name, results),
                         op.get_flat_symbol_ref_attr("callee") if name == "tt.call" else "",
                         bool(op.get_bool_attr("pure")) if name in OPAQUE else True,
                         any("!tt.ptr" in str(r.get_type()) for r in results))
            if name == "tt.func":
                blocks = self.region_blocks.get(record.regions[0], []) if record.regions else []
                if not blocks:
                    raise Unanalysable(f"a function without a body ({op.get_str_attr('sym_name')})")
                self.functions[op.get_str_attr("sym_name")] = _Function(self.block_args[blocks[0]], tuple(pending))
                pending.clear()
                return
            pending.append(record)
            self.block_ops[bid].append(record)

        module.walk(visit)
        for function in self.functions.values():
            for record in function.ops:
                self._connect(record)

    def _terminator(self, block: int) -> tuple[int, ...]:
        ops = self.block_ops.get(block, [])
        return ops[-1].operands if ops else ()

    def _connect(self, op: _Op) -> None:
        """Record where ``op``'s results (and its regions' block arguments) may come from."""
        if op.regions:
            blocks = [self.region_blocks.get(r, []) for r in op.regions]
            if op.name == "scf.for" and len(blocks) == 1 and blocks[0]:
                body = blocks[0][0]
                iv, *carried = self.block_args[body]
                inits, yielded = op.operands[3:], self._terminator(body)
                self._same_length(op, carried, inits, yielded, op.results)
                self.sources[iv].update(op.operands[:3])
                for i, value in enumerate(carried):  # a loop's value: its initial one or any iteration's
                    self.sources[value].update((inits[i], yielded[i]))
                    self.sources[op.results[i]].update((inits[i], yielded[i]))
                return
            if op.name == "scf.while" and len(blocks) == 2 and blocks[0] and blocks[1]:
                before, after = blocks[0][0], blocks[1][0]
                condition, yielded = self._terminator(before), self._terminator(after)
                forwarded = condition[1:]
                self._same_length(op, self.block_args[before], op.operands, yielded)
                self._same_length(op, self.block_args[after], forwarded, op.results)
                for i, value in enumerate(self.block_args[before]):
                    self.sources[value].update((op.operands[i], yielded[i]))
                for i, value in enumerate(self.block_args[after]):
                    self.sources[value].add(forwarded[i])
                    self.sources[op.results[i]].add(forwarded[i])
                return
            if op.name == "scf.if":
                for region in blocks:
                    for block in region:
                        yielded = self._terminator(block)
                        self._same_length(op, yielded, op.results)
                        for result, value in zip(op.results, yielded):
                            self.sources[result].add(value)
                return
            # any other op with regions (a reduction, a scan): whatever flows in may flow anywhere
            inner = [b for region in blocks for b in region]
            flows = set(op.operands).union(*(self._terminator(b) for b in inner))
            for value in (*op.results, *(a for b in inner for a in self.block_args[b])):
                self.sources[value].update(flows)
            return
        if op.name in BRANCHES:  # (an early return): its operands may flow to any later block's arguments
            entry, *later = self.region_blocks.get(self.block_region.get(op.block, -1), [op.block])
            for block in later:
                for value in self.block_args[block]:
                    self.sources[value].update(op.operands)
            return
        if op.name in READS or op.name in READ_WRITES:
            for result in op.results:  # data read from memory: indexes an address, is none
                self.loaded[result] = op.operands[0]
            return
        for result in op.results:
            self.sources[result].update(op.operands)

    @staticmethod
    def _same_length(op: _Op, *lists: Iterable[int]) -> None:
        if len({len(tuple(x)) for x in lists}) > 1:
            raise Unanalysable(f"an {op.name} whose values the analysis cannot pair ({op.site})")

    # -- effects -------------------------------------------------------------------------
    def summary(self, name: str, stack: tuple[str, ...] = ()) -> _Summary:
        """What function ``name`` reads and writes through its arguments (``stack``: its callers)."""
        if name in stack:
            raise Unanalysable(f"a recursive call of {name}")
        if name not in self.functions:
            raise Unanalysable(f"a call of {name}, which it does not define")
        found = self.summaries.get(name)
        if found is None:
            found = self.summaries[name] = self._summary(name, stack)
        return found

    def _summary(self, name: str, stack: tuple[str, ...]) -> _Summary:
        function = self.functions[name]
        param = {value: i for i, value in enumerate(function.params)}
        writes: dict[int, str] = {}
        reads: dict[int, str] = {}
        indexed: dict[int, set[int]] = defaultdict(set)
        unbounded = ""

        walked: dict[int, tuple[frozenset[int], frozenset[int]]] = {}

        def walk(value: int) -> tuple[frozenset[int], frozenset[int]]:
            """The arguments ``value`` may point into, and the addresses of the loads it is computed from."""
            found = walked.get(value)
            if found is None:
                into: set[int] = set()
                loads: set[int] = set()
                todo, seen = [value], set()
                while todo:
                    v = todo.pop()
                    if v in seen:
                        continue
                    seen.add(v)
                    if v in param:
                        into.add(param[v])
                    elif v in self.loaded:
                        loads.add(self.loaded[v])
                    else:
                        todo.extend(self.sources.get(v, ()))
                found = walked[value] = (frozenset(into), frozenset(loads))
            return found

        def roots(value: int) -> tuple[frozenset[int], set[int]]:
            """The arguments ``value`` may point into, and those whose loaded values index it."""
            into, loads = walk(value)
            return into, set().union(*(walk(address)[0] for address in loads))

        def note(effects: dict[int, str], value: int, site: str) -> None:
            into, index = roots(value)
            for i in into:
                effects.setdefault(i, site)
                indexed[i] |= index

        for op in function.ops:
            if op.name in WRITES or op.name in READ_WRITES:
                note(writes, op.operands[0], op.site)
            if op.name in READS or op.name in READ_WRITES:
                note(reads, op.operands[0], op.site)
                if op.pointer_result:
                    unbounded = unbounded or f"{op.site} (an address loaded from memory)"
            if op.name == "tt.int_to_ptr":
                unbounded = unbounded or f"{op.site} (an address made from an integer)"
            elif op.name in OPAQUE and not op.pure:
                unbounded = unbounded or f"{op.site} (code the analysis cannot read, not marked pure)"
            elif op.name == "tt.call":
                inner = self.summary(op.callee, (*stack, name))
                unbounded = unbounded or (f"{op.site} -> {inner.unbounded}" if inner.unbounded else "")
                for effects, theirs in ((writes, inner.writes), (reads, inner.reads)):
                    for i, site in theirs.items():
                        note(effects, op.operands[i], f"{op.site} -> {site}")
                for i, by in inner.indexed.items():
                    for j in by:
                        indexed_into = roots(op.operands[i])[0]
                        for k in indexed_into:
                            indexed[k] |= roots(op.operands[j])[0]
            elif not op.regions and not _known(op.name):
                raise Unanalysable(f"an op it does not know: {op.name} ({op.site})")
        return _Summary(writes, reads, {i: frozenset(v) for i, v in indexed.items()}, unbounded)


def _known(name: str) -> bool:
    return (name in PURE or name in WRITES or name in READS or name in READ_WRITES or name in OPAQUE or name in BRANCHES
            or name in ("tt.call", "tt.int_to_ptr") or name.startswith(PURE_DIALECTS))


class _Sites:
    """Where each op of a printed IR module comes from (``file:line``), by op name and order: the
    bindings give a location to values only, and a store has none. A leaf op is the n-th of its
    name in the printed text (pre-order) and in the walk (post-order) alike."""

    _LINE = re.compile(r'^\s*(?:%[^=]*=\s*)?([a-z_]+\.[a-z_.]+)\b.*\bloc\((#loc\d*|"[^"]*":\d+:\d+)\)\s*$')
    _ALIAS = re.compile(r"^(#loc\d*) = loc\((.*)\)\s*$")
    _FILE = re.compile(r'"([^"]+)":(\d+):\d+')

    def __init__(self, text: str) -> None:
        aliases: dict[str, str] = {}
        found: dict[str, list[str]] = defaultdict(list)
        lines = text.splitlines()
        for line in lines:
            m = self._ALIAS.match(line)
            if m:
                aliases[m.group(1)] = m.group(2)
        for line in lines:
            m = self._LINE.match(line)
            if m:
                found[m.group(1)].append(self._resolve(m.group(2), aliases, 0))
        self.found = found
        self.taken: dict[str, int] = defaultdict(int)

    def _resolve(self, ref: str, aliases: Mapping[str, str], depth: int) -> str:
        text = aliases.get(ref, ref)
        m = self._FILE.search(text)
        if m:
            return f"{m.group(1)}:{m.group(2)}"
        for inner in re.findall(r"#loc\d*", text):
            if depth < 16 and inner != ref:
                found = self._resolve(inner, aliases, depth + 1)
                if found:
                    return found
        return ""

    def next(self, name: str, results: tuple[Any, ...]) -> str:
        index = self.taken[name]
        self.taken[name] += 1
        where = self.found[name][index] if index < len(self.found[name]) else ""
        if not where and results:
            m = self._FILE.search(str(results[0].get_loc()))
            where = f"{m.group(1)}:{m.group(2)}" if m else ""
        return f"{where}: {name}" if where else name


def ttir_access(py: Callable[..., Any], module: Any, names: list[str]) -> KernelAccess:
    """What the kernel ``py`` reads and writes, from its TTIR ``module`` whose entry function's
    arguments stand for the parameters ``names`` (in order); :class:`Unanalysable` where the IR
    holds what the analysis cannot follow."""
    graph = _Graph(module)
    entry = module.get_entry_func_name()
    function = graph.functions.get(entry)
    if function is None:
        raise Unanalysable(f"no function named {entry}")
    if len(function.params) != len(names):
        raise Unanalysable(f"{len(function.params)} arguments for the {len(names)} the launch passes")
    summary = graph.summary(entry)
    params = tuple(inspect.signature(py).parameters)

    def by_name(effects: Mapping[int, str]) -> dict[str, str]:
        out: dict[str, str] = {}
        for i, site in sorted(effects.items()):
            out.setdefault(names[i], site)
        return out

    writes, reads = by_name(summary.writes), by_name(summary.reads)
    indexed: dict[str, set[str]] = defaultdict(set)
    for i, by in summary.indexed.items():
        indexed[names[i]] |= {names[j] for j in by}
    return KernelAccess(
        getattr(py, "__name__", "?"), params, frozenset(writes), tuple((p, writes[p]) for p in params if p in writes),
        summary.unbounded, reads=frozenset(reads), basis=FROM_IR,
        indexed=tuple((p, tuple(sorted(indexed[p]))) for p in params if indexed.get(p)))



__all__ = ["OPAQUE", "PURE", "READS", "READ_WRITES", "WRITES", "Unanalysable", "ttir_access"]
