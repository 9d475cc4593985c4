"""Bad input to the adapter: each a clear error naming what was wrong, before anything runs."""

from __future__ import annotations

import enum

import pytest
import torch

from readfence.core import ForwardMode, ModelConfig, StepInputs, run_step
from readfence.engine import ContractError, EngineError, EngineMode, adapt
from readfence.engine._contract import read_end_of
from readfence.graph import make_state

from .classes import Ends, KeptCopies
from .conftest import CFG


def _step(engine, mode=ForwardMode.DECODE, batch_size=2):
    from readfence.core.internal import example_step

    example = example_step(engine.cfg, mode, batch_size)
    state = engine.state
    return run_step(engine, mode, engine.cfg, StepInputs(state["shared"], example.batch, state["pools"], state["params"]))


class NoInGraph:
    def __init__(self, runner):
        pass

    def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
        pass

    def shared_read_ends(self, mode):
        return Ends.IN_REPLAY

    def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
        return q


def test_an_object_missing_a_contract_method_is_named_with_the_method():
    with pytest.raises(ContractError, match=r"NoInGraph has no method init_forward_metadata_in_graph\(forward_batch\)"):
        adapt(NoInGraph, cfg=CFG)


def test_a_method_with_the_wrong_signature_is_named_with_its_signature():
    class OldStyle(NoInGraph):
        def init_forward_metadata_in_graph(self, forward_batch):
            pass

        def init_forward_metadata_out_graph(self, forward_batch):  # no in_capture
            pass

    with pytest.raises(ContractError, match=r"OldStyle.init_forward_metadata_out_graph must accept "
                                            r"\(forward_batch, in_capture=False\), its signature is \(forward_batch\)"):
        adapt(OldStyle, cfg=CFG)


def test_no_forward_and_no_forward_decode_is_a_missing_method():
    class Half(NoInGraph):
        forward = None

        def init_forward_metadata_in_graph(self, forward_batch):
            pass

    with pytest.raises(ContractError, match="Half has no method forward_decode"):
        adapt(Half, cfg=CFG)


def test_a_wrapper_child_missing_a_method_is_named_by_its_place():
    class Wrapper(KeptCopies):
        def __init__(self, runner):
            super().__init__(runner)
            self.attn_backend_list = [KeptCopies(runner), NoInGraph(runner)]

    with pytest.raises(ContractError, match=r"Wrapper.attn_backend_list\[1\] \(NoInGraph\) has no method "
                                            r"init_forward_metadata_in_graph"):
        adapt(Wrapper, cfg=CFG)


def test_attn_backend_list_must_be_a_list():
    class Odd(KeptCopies):
        attn_backend_list = "children"

    with pytest.raises(ContractError, match="Odd.attn_backend_list must be a list of backend objects"):
        adapt(Odd, cfg=CFG)


class Early(enum.Enum):
    PRE_REPLAY = 1
    IN_GRAPH = 2  # not one of the four names


@pytest.mark.parametrize("value, shown", [
    (Early.IN_GRAPH, r"<Early.IN_GRAPH: 2> \(Early\)"),
    (2, r"2 \(int\).*return the member, not its value"),
    ("EARLY", r"'EARLY' \(str\)"),
    (None, r"None \(NoneType\)"),
])
def test_a_declaration_that_is_not_one_of_the_four_names_is_refused(value, shown):
    class Declares(KeptCopies):
        def shared_read_ends(self, mode):
            return value if mode.is_decode() else Ends.UNKNOWN

    with pytest.raises(ValueError, match=rf"Declares.shared_read_ends\(DECODE\) returned {shown}"):
        adapt(Declares, cfg=CFG)


def test_names_are_matched_by_name_in_any_enum_or_as_strings():
    assert read_end_of(Early.PRE_REPLAY, "x").name == "PRE_REPLAY"
    assert read_end_of("POST_REPLAY", "x").name == "POST_REPLAY"


def test_a_buffer_name_that_does_not_exist_is_refused_with_the_closest():
    with pytest.raises(ValueError, match="buffers names unknown buffer 'req_to_tokn'; shared buffers are "
                                         "req_to_token, seq_lens, swa_map, state_slots; did you mean 'req_to_token'"):
        adapt(KeptCopies, cfg=CFG, buffers={"req_to_tokn": "req_to_token_pool.req_to_token"})
    with pytest.raises(ValueError, match="reads names unknown buffer 'page_table'"):
        adapt(KeptCopies, cfg=CFG, reads=["page_table"])


@pytest.mark.parametrize("buffers, match", [
    ({"seq_lens": "req_to_token_pool.req_to_token"}, "buffers 'req_to_token' and 'seq_lens' are both at"),
    ({"seq_lens": "device"}, "would replace the runner's 'device'"),
    ({"seq_lens": "token_to_kv_pool"}, "would replace the runner's 'token_to_kv_pool'"),
    ({"seq_lens": "lens table"}, "must be a dotted attribute path"),
    ({"seq_lens": 3}, "must be a dotted attribute path"),
])
def test_a_layout_path_that_cannot_be_placed_is_refused(buffers, match):
    with pytest.raises(ValueError, match=match):
        adapt(KeptCopies, cfg=CFG, buffers=buffers)


def test_a_factory_that_raises_is_named_with_its_error():
    def factory(runner):
        raise KeyError("no such pool")

    with pytest.raises(EngineError, match=r"the factory .*factory\(runner\) raised KeyError: 'no such pool'"):
        adapt(factory, cfg=CFG)


def test_a_factory_that_returns_nothing_is_refused():
    with pytest.raises(ContractError, match=r"returned None \(NoneType\), not an engine backend object"):
        adapt(lambda runner: None, cfg=CFG)
    with pytest.raises(TypeError, match="factory must be callable"):
        adapt(KeptCopies(adapt(KeptCopies, cfg=CFG).runner), cfg=CFG)


def test_a_state_of_another_model_config_is_refused():
    with pytest.raises(ContractError, match=r"page table is \(16, 64\), but the model config has max_reqs=4"):
        adapt(KeptCopies, cfg=CFG, state=make_state(ModelConfig()))


def test_running_on_a_page_table_of_another_shape_says_which_state_to_pass():
    engine = adapt(KeptCopies, cfg=CFG)
    from readfence.core.internal import example_step

    other = example_step(ModelConfig(), ForwardMode.DECODE, 2)
    with pytest.raises(ContractError, match="pass cfg=engine.cfg and state=engine.state"):
        run_step(engine, ForwardMode.DECODE, ModelConfig(), other)


def test_an_error_in_the_engine_code_names_the_class_method_and_mode():
    class Broken(KeptCopies):
        def init_forward_metadata_in_graph(self, forward_batch):
            raise IndexError("row 9 out of range")

    engine = adapt(Broken, cfg=CFG)
    with pytest.raises(EngineError, match=r"Broken.init_forward_metadata_in_graph raised IndexError in DECODE: "
                                          r"row 9 out of range"):
        _step(engine)


def test_forward_returning_the_wrong_shape_is_named():
    class Wide(KeptCopies):
        def forward(self, q, k, v, layer, forward_batch, save_kv_cache=True):
            return q.repeat(1, 2, 1)

    with pytest.raises(EngineError, match=r"Wide.forward returned \(2, 4, 16\) in DECODE; expected a tensor of "
                                          r"2 tokens x 2 heads x 16 dims"):
        _step(adapt(Wide, cfg=CFG))


def test_the_engine_mode_has_sglangs_predicates():
    # SGLang 0.5.23's: DRAFT_EXTEND_V2 is neither an extend (unless asked) nor a CUDA-graph mode
    assert [m.name for m in EngineMode if m.is_extend()] == ["TARGET_VERIFY", "EXTEND"]
    assert [m.name for m in EngineMode if m.is_extend(include_draft_extend_v2=True)] == [
        "TARGET_VERIFY", "DRAFT_EXTEND", "EXTEND"]
    assert [m.name for m in EngineMode if not m.is_cuda_graph()] == ["DRAFT_EXTEND", "EXTEND"]
    assert EngineMode.of(ForwardMode.DECODE).readfence is ForwardMode.DECODE


def test_an_exception_is_said_to_be_raised_by_whose_code_raised_it():
    from readfence.engine import audit_engine
    from readfence.engine._contract import origin_of
    from tests.conftest import NO_TRITON, TRITON

    class Broken(KeptCopies):
        def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
            super().init_forward_metadata_out_graph(forward_batch, in_capture)
            self.meta["lens"].reshape(3, 5)  # torch refuses the shape

    with pytest.raises(EngineError, match=r"Broken.init_forward_metadata_out_graph raised RuntimeError in DECODE"):
        _step(adapt(Broken, cfg=CFG))  # raised by a torch op the engine's own line called: the engine's error
    try:
        {}["missing"]
    except KeyError as e:
        assert origin_of(e) == "engine"
    if not TRITON:
        pytest.skip(NO_TRITON)
    import triton
    import triton.language as tl

    @triton.jit
    def ragged(src, out):
        i = tl.arange(0, 3)  # not a power of two: triton refuses it
        tl.store(out + i, tl.load(src + i))

    class KernelBug(KeptCopies):
        def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
            super().init_forward_metadata_out_graph(forward_batch, in_capture)
            lens = self.meta["lens"]
            ragged[(1,)](lens, lens.clone())

    with pytest.raises(EngineError, match=r"KernelBug.init_forward_metadata_out_graph raised \w+ inside triton") as caught:
        audit_engine(adapt(KernelBug, cfg=CFG), ForwardMode.DECODE, batch_sizes=[2], steps=1)
    assert caught.value.origin == "triton"
    assert "test_contract.py" in caught.value.where, caught.value.where  # the engine's line, not triton's


@torch.library.custom_op("rf_contract_test::lookup", mutates_args=())
def _lookup(x: torch.Tensor) -> torch.Tensor:
    return {}["missing"]  # the engine's own kernel raises


@_lookup.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


def test_an_error_in_the_engine_s_own_kernel_is_the_engine_s_under_readfence_s_modes():
    # the capture-time call runs under the read observer, which runs the kernel below it: the error
    # is the kernel's (the engine's code, its line named), not torch's dispatch machinery's
    class KernelRaises(KeptCopies):
        def init_forward_metadata_out_graph(self, forward_batch, in_capture=False):
            super().init_forward_metadata_out_graph(forward_batch, in_capture)
            _lookup(self.meta["lens"])

    with pytest.raises(EngineError, match=r"KernelRaises.init_forward_metadata_out_graph raised KeyError in DECODE") as e:
        _step(adapt(KernelRaises, cfg=CFG))
    assert e.value.origin == "engine" and "test_contract.py" in (e.value.where or ""), (e.value.origin, e.value.where)
