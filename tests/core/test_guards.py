"""What a backend's code can read, walked from the backend: every spelling of a setting changes the
key, per-step state does not, and a captured tensor is stale exactly when the backend let it go."""

from __future__ import annotations

import dataclasses
import enum
import functools
import types

import pytest
import torch

from readfence.backends import leaf, paged, redeclare, reference_compositions, softmax_attention
from readfence.core.internal import code_key, kept_tensors, reach
from readfence.core.tracing._guards import GONE, KeptTensor, Path, tensor_layout
from readfence.effects import ReadEffect

FLAG = True
TABLE = {"scale": 1.0, "modes": [1, 2]}


class Mode(enum.Enum):
    FAST = "fast"
    EXACT = "exact"


MODE = Mode.FAST


@dataclasses.dataclass
class Config:
    scale: float = 1.0
    window: int | None = None


CONFIG = Config()
SETTINGS = types.ModuleType("guard_settings")
SETTINGS.depth = 2


class Kernel:
    LIMIT = 8  # a class attribute

    def __init__(self) -> None:
        self.scale, self.cfg, self.meta = 1.0, Config(), None

    def attend(self, q):
        self.meta = q * 2  # per-step state: assigned by the code it reads
        out = q * self.scale * self.cfg.scale * self.LIMIT * SETTINGS.depth * TABLE["scale"] * CONFIG.scale
        return out if FLAG and MODE is Mode.FAST else -out


def _settings(root: object):
    return reach(root, "backend").settings


@pytest.fixture(autouse=True)
def _restored():
    global FLAG, MODE
    yield
    FLAG, MODE = True, Mode.FAST
    TABLE.update(scale=1.0, modes=[1, 2])
    CONFIG.scale, SETTINGS.depth, Kernel.LIMIT = 1.0, 2, 8


def _set_global(name: str, value: object) -> None:
    globals()[name] = value


CHANGES = {
    "global flag": (lambda k: _set_global("FLAG", False), "__globals__['FLAG']"),
    "global enum": (lambda k: _set_global("MODE", Mode.EXACT), "__globals__['MODE']"),
    "dict item": (lambda k: TABLE.update(scale=2.0), "['scale']"),
    "list in a dict": (lambda k: TABLE["modes"].append(3), "['modes']"),
    "config field": (lambda k: setattr(CONFIG, "scale", 2.0), "__globals__['CONFIG'].scale"),
    "module attribute": (lambda k: setattr(SETTINGS, "depth", 3), "__globals__['SETTINGS'].depth"),
    "attribute of self": (lambda k: setattr(k, "scale", 2.0), "__self__.scale"),
    "config on self": (lambda k: setattr(k.cfg, "scale", 2.0), "__self__.cfg.scale"),
    "class attribute": (lambda k: setattr(Kernel, "LIMIT", 16), "LIMIT"),
}


@pytest.mark.parametrize("change", list(CHANGES))
def test_each_spelling_of_a_setting_changes_the_settings_and_names_where(change: str) -> None:
    kernel = Kernel()
    before = _settings(kernel.attend)
    assert _settings(kernel.attend) == before  # unchanged: equal
    do, where = CHANGES[change]
    do(kernel)
    after = _settings(kernel.attend)
    assert after != before and where in str(after.changed_from(before))


def test_closure_cells_defaults_and_partials_are_settings() -> None:
    def make(scale):
        def attend(q, bias=0.0):
            return q * scale + bias

        def rebind(value):
            nonlocal scale
            scale = value

        return attend, rebind

    attend, rebind = make(1.0)
    before = _settings(attend)
    rebind(2.0)
    assert "__closure__[0].cell_contents" in str(_settings(attend).changed_from(before))
    rebind(1.0)
    assert _settings(attend) == before
    attend.__defaults__ = (1.0,)
    assert "__defaults__[0]" in str(_settings(attend).changed_from(before))
    assert _settings(functools.partial(attend, bias=1.0)) != _settings(functools.partial(attend, bias=2.0))


def test_what_the_code_assigns_is_per_step_state_but_its_tensors_are_found() -> None:
    kernel = Kernel()
    before = _settings(kernel.attend)
    kernel.attend(torch.ones(2))  # assigns self.meta a new tensor
    kernel.attend(torch.zeros(3))
    found = reach(kernel.attend, "backend")
    assert found.settings == before
    assert [str(p) for p, t in found.tensors if t is kernel.meta] == ["backend.__self__.meta"]


def test_a_tensor_is_a_setting_by_its_memory_and_shape_not_its_values() -> None:
    held = torch.zeros(4)

    def attend(q):
        return q + held

    before = _settings(attend)
    held.add_(1.0)
    assert _settings(attend) == before
    held.resize_(8)
    assert _settings(attend) != before


def test_machinery_is_taken_by_identity_and_backends_are_walked() -> None:
    assert code_key(paged()) == code_key(redeclare(paged(), lambda m: ReadEffect.unknown()))  # not the declaration
    for backend in reference_compositions().values():
        found = reach(backend, "backend")
        assert found.settings.complete and found.settings == reach(backend, "backend").settings
    # torch's modules and functions are taken by identity, never walked (nothing of theirs is a
    # backend's setting); a backend's own helpers are
    def attend(q):
        return torch.nn.functional.relu(q) * FLAG

    entries = {str(p): token for p, token in reach(attend, "fn").settings.entries}
    assert entries["fn.__globals__['torch']"] == ("module", "torch")
    assert not any(name.startswith("fn.__globals__['torch'].") for name in entries)
    assert any("softmax_attention" in name for name in
               (str(p) for p, _ in reach(lambda q: softmax_attention(*q), "fn").settings.entries))


def test_a_walk_past_its_bounds_says_it_is_incomplete() -> None:
    chain: list[object] = [1.0]
    for _ in range(40):
        chain = [chain]

    def attend(q):
        return q * len(chain)

    assert not reach(attend, "fn", depth=10).settings.complete
    assert not reach(attend, "fn", limit=5).settings.complete
    assert reach(attend, "fn", depth=50).settings.complete


def test_a_leaf_made_of_a_kernel_object_is_keyed_by_what_its_methods_read() -> None:
    kernel = Kernel()
    backend = leaf("guarded", lambda mode, layer, q, k, v, pools, shared, batch, meta: kernel.attend(q))
    before = code_key(backend)
    kernel.scale = 3.0
    assert code_key(backend) != before
    kernel.scale = 1.0
    assert code_key(backend) == before


# -- captured tensors where the backend keeps them ---------------------------------------------------
class _Stage:
    """Stands for a stage graph that captured ``tensor`` (what ``kept_tensors`` reads of one)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        from readfence.core import BODY

        self.stage = BODY
        self.graph = types.SimpleNamespace(gm=types.SimpleNamespace(_tensor_constant0=tensor, graph=types.SimpleNamespace(nodes=[])))
        self.analysis = types.SimpleNamespace(captured=[types.SimpleNamespace(target="_tensor_constant0", filled_by=frozenset())])


class Owner:
    def __init__(self) -> None:
        self.buf = torch.zeros(4)
        self.view = self.buf[:2]
        self.step_meta = {"buf": self.buf}

    def attend(self, q):
        self.step_meta = {"buf": self.buf}  # rebuilt every step
        return q + self.buf[:2] + self.view


def _kept(owner: Owner) -> KeptTensor:
    (kept,) = kept_tensors([_Stage(owner.buf)], reach(owner.attend, "backend"))
    return kept


def test_a_captured_tensor_is_stale_once_the_backend_replaced_or_resized_it() -> None:
    owner = Owner()
    kept = _kept(owner)
    assert kept.where == "backend.__self__.buf" and kept.stale(owner.attend) is None
    owner.step_meta = {"buf": torch.zeros(4)}  # one home of several changes each step: still kept
    assert kept.stale(owner.attend) is None
    owner.buf = torch.zeros(8)  # replaced (its view stays: a view of the old memory is not what is read now)
    owner.view = owner.buf[:2]
    owner.step_meta = {"buf": owner.buf}
    assert "was replaced (it holds a tensor of shape (8,) now)" in kept.stale(owner.attend)

    other = Owner()
    kept = _kept(other)
    other.buf.resize_(16)  # in place: the same object, other memory
    assert "resized or moved in place" in kept.stale(other.attend)


def test_a_tensor_kept_only_as_a_view_is_kept_while_the_view_is() -> None:
    owner = Owner()
    base = owner.buf
    del owner.buf  # only the view (and the per-step dict) keeps its memory now
    owner.step_meta = {}
    (kept,) = kept_tensors([_Stage(base)], reach(owner.attend, "backend"))
    assert kept.where == "backend.__self__.view" and kept.stale(owner.attend) is None
    owner.view = torch.zeros(2)
    assert kept.stale(owner.attend) is not None


def test_paths_read_back_what_they_name() -> None:
    owner = Owner()
    found = reach(owner.attend, "backend")
    for path, tensor in found.tensors:
        assert path.resolve(owner.attend) is tensor
    assert Path("backend", (("attr", "gone"),)).resolve(owner.attend) is GONE
    assert tensor_layout(owner.buf) == tensor_layout(owner.buf)
