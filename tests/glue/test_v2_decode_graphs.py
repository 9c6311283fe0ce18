"""The opt-in decode graphs of a ragged specx method on Model Runner V2 (glue/v2_patches.py).

``v2_plain_step_graphs``: with VLLM_SPECX_V2_PLAIN_STEP_GRAPHS=1 the graph manager also
plans FULL decode graphs for 1-token queries. ``v2_varlen_decode_graphs``: with
VLLM_SPECX_V2_VARLEN_GRAPHS=1 the manager is rebuilt with vLLM's varlen decode graphs
(any mix of 1..1 + K tokens a request), where the target's attention backends allow it.

Checked on vLLM's real ``ModelCudaGraphManager`` (its candidate planning and
``dispatch``; nothing is captured on this CPU host, so the manager is marked captured to
reach ``dispatch``'s choice) and vLLM's real backend check
(``get_varlen_cudagraph_unsupported_backend`` over vLLM's real metadata-builder classes),
with the distributed lookups the manager makes stubbed and the runner reduced to the
attributes the patch reads."""

from __future__ import annotations

import types

import pytest

from vllm_specx.config import SPECX_CONFIG_KEY
from vllm_specx.glue.v2_patches import (
    PLAIN_STEP_GRAPHS_ENV,
    VARLEN_GRAPHS_ENV,
    V2PlainStepGraphs,
    use_varlen_decode_graphs,
    varlen_decode_refusal,
)

MAX_NUM_SEQS = 4
K = 3  # decode_query_len 1 + K = 4


@pytest.fixture
def graph_manager(monkeypatch):
    """A factory: (specx settings or None, decode_query_len) -> a V2 graph manager."""
    import vllm.v1.worker.gpu.cudagraph_utils as cudagraph_utils
    from vllm.config import CompilationConfig, CUDAGraphMode

    V2PlainStepGraphs().apply()  # idempotent; the plugin applies it when vLLM imports it
    monkeypatch.setattr(cudagraph_utils, "get_pp_group", lambda: types.SimpleNamespace(
        is_first_rank=True, is_last_rank=True))
    monkeypatch.setattr(cudagraph_utils.current_platform, "get_global_graph_pool",
                        lambda: None, raising=False)

    def make(settings, decode_query_len=1 + K, mode=None, varlen_decode=False):
        compilation = CompilationConfig(cudagraph_capture_sizes=[1, 2, 4, 8, 16],
                                        max_cudagraph_capture_size=16)
        config = types.SimpleNamespace(
            scheduler_config=types.SimpleNamespace(max_num_seqs=MAX_NUM_SEQS),
            compilation_config=compilation, speculative_config=None,
            parallel_config=types.SimpleNamespace(tensor_parallel_size=1,
                                                  data_parallel_size=1),
            cache_config=types.SimpleNamespace(use_kda_recoverssm=False),
            additional_config={SPECX_CONFIG_KEY: settings} if settings else {},
        )
        manager = cudagraph_utils.ModelCudaGraphManager(
            config, "cpu", CUDAGraphMode.FULL_AND_PIECEWISE if mode is None else mode,
            decode_query_len=decode_query_len, varlen_decode=varlen_decode)
        manager._graphs_captured = True  # reach dispatch's choice (nothing is captured here)
        return manager

    return make


def _full(manager, uniform):
    from vllm.config import CUDAGraphMode

    return sorted(d.num_tokens for d in manager._capture_descs.get(CUDAGraphMode.FULL, [])
                  if d.uniform_token_count == uniform)


ADAPTIVE = {"method": "adaptive", "num_speculative_tokens": K}


def test_a_ragged_method_gets_the_one_token_decode_graphs_vllm_plans_without_drafts(
        graph_manager, monkeypatch):
    from vllm.config import CUDAGraphMode

    monkeypatch.setenv(PLAIN_STEP_GRAPHS_ENV, "1")
    manager = graph_manager(ADAPTIVE)
    reference = graph_manager(None, decode_query_len=1)  # vLLM's plan for 1-token decodes
    assert _full(manager, 1) == _full(reference, 1) == [1, 2, 4]
    assert _full(manager, 1 + K) == [4, 8, 16]  # the 1 + K graphs are kept
    # A plain step (every query one token) replays a FULL graph, padded to a captured
    # request count; a full-K step its own; a ragged step the PIECEWISE graphs.
    for num_reqs, want in ((1, 1), (3, 4), (4, 4)):
        desc = manager.dispatch(num_reqs, num_reqs, 1, 0)
        assert (desc.cg_mode, desc.uniform_token_count, desc.num_tokens) == (
            CUDAGraphMode.FULL, 1, want)
    desc = manager.dispatch(2, 2 * (1 + K), 1 + K, 0)
    assert (desc.cg_mode, desc.uniform_token_count) == (CUDAGraphMode.FULL, 1 + K)
    assert manager.dispatch(2, 5, None, 0).cg_mode == CUDAGraphMode.PIECEWISE


@pytest.mark.parametrize("settings, flag", [
    (ADAPTIVE, ""),  # opt-in: off unless the variable is set
    ({"method": "specx_eagle3", "num_speculative_tokens": K}, "1"),  # fixed K: not ragged
    (None, "1"),  # vLLM's own methods
])
def test_without_the_flag_or_a_ragged_method_the_plan_is_vllms(graph_manager, monkeypatch,
                                                               settings, flag):
    from vllm.config import CUDAGraphMode

    monkeypatch.setenv(PLAIN_STEP_GRAPHS_ENV, flag)
    manager = graph_manager(settings)
    assert _full(manager, 1) == []
    assert manager.dispatch(1, 1, 1, 0).cg_mode == CUDAGraphMode.PIECEWISE


# --- varlen decode graphs -----------------------------------------------------------------

TARGET_LAYERS = ("model.layers.0.attn", "model.layers.1.attn")
DRAFT_LAYERS = ("draft.layers.0.attn",)


def _group(layers, builder, backend):
    """An attention group as the backend check reads it, over vLLM's real builder class
    (its cudagraph support and varlen bound are class methods)."""
    return types.SimpleNamespace(layer_names=list(layers), kv_cache_spec=None,
                                 backend=backend, get_metadata_builder=lambda i=0: builder)


def _triton_group(layers):  # ALWAYS: replays any decode batch
    from vllm.v1.attention.backends.triton_attn import (
        TritonAttentionBackend,
        TritonAttentionMetadataBuilder,
    )

    return _group(layers, TritonAttentionMetadataBuilder, TritonAttentionBackend)


def _uniform_only_group(layers):  # UNIFORM_BATCH without a varlen bound
    from vllm.v1.attention.backends.short_conv_attn import (
        ShortConvAttentionBackend,
        ShortConvAttentionMetadataBuilder,
    )

    return _group(layers, ShortConvAttentionMetadataBuilder, ShortConvAttentionBackend)


def _runner(manager, groups):
    """The V2 runner attributes use_varlen_decode_graphs reads, after initialize_kv_cache."""
    from vllm.v1.attention.backend import AttentionCGSupport

    return types.SimpleNamespace(
        vllm_config=manager.vllm_config, device="cpu", cudagraph_manager=manager,
        attn_groups=[groups], fast_prefill=None,
        kv_cache_config=types.SimpleNamespace(kv_cache_groups=[
            types.SimpleNamespace(layer_names=list(TARGET_LAYERS + DRAFT_LAYERS))]),
        speculator=types.SimpleNamespace(draft_attn_layer_names=set(DRAFT_LAYERS)),
        model_state=types.SimpleNamespace(
            get_additional_cg_support=lambda: (AttentionCGSupport.ALWAYS, None)))


def _plan(manager):
    """What a manager captures: (mode, tokens, requests, uniform length, max query len)."""
    return sorted((d.cg_mode.name, d.num_tokens, d.num_reqs, d.uniform_token_count,
                   d.max_query_len) for descs in manager._capture_descs.values()
                  for d in descs)


def test_a_ragged_method_gets_vllms_varlen_decode_graphs(graph_manager, monkeypatch):
    from vllm.config import CUDAGraphMode

    monkeypatch.setenv(VARLEN_GRAPHS_ENV, "1")
    runner = _runner(graph_manager(ADAPTIVE), [_triton_group(TARGET_LAYERS),
                                               _uniform_only_group(DRAFT_LAYERS)])
    assert varlen_decode_refusal(runner) is None  # the draft's layers are not checked
    assert use_varlen_decode_graphs(runner)
    manager = runner.cudagraph_manager
    manager._graphs_captured = True
    # The plan vLLM makes for its own adaptive verification, and nothing else.
    assert manager.varlen_decode
    assert _plan(manager) == _plan(graph_manager(ADAPTIVE, varlen_decode=True))
    assert not any(d.uniform_token_count for d in manager._capture_descs[CUDAGraphMode.FULL])
    # Every decode step replays a FULL graph, padded to a captured size: a plain step
    # (nobody drafted), a ragged one, a full-K one. A batch with a prefill (the runner
    # passes no max query length then) replays the PIECEWISE graphs.
    for num_reqs, num_tokens, uniform, longest in ((1, 1, 1, 1), (3, 3, 1, 1),
                                                   (2, 5, None, 4), (3, 6, None, 3),
                                                   (4, 16, 1 + K, 1 + K)):
        desc = manager.dispatch(num_reqs, num_tokens, uniform, 0, max_query_len=longest)
        assert desc.cg_mode == CUDAGraphMode.FULL
        assert desc.num_tokens >= num_tokens and desc.num_reqs >= num_reqs
        assert desc.max_query_len == 1 + K
    assert manager.dispatch(2, 5, None, 0, max_query_len=None).cg_mode == \
        CUDAGraphMode.PIECEWISE


@pytest.mark.parametrize("settings, flag", [
    (ADAPTIVE, ""),  # opt-in: off unless the variable is set
    ({"method": "specx_eagle3", "num_speculative_tokens": K}, "1"),  # fixed K: not ragged
    ({**ADAPTIVE, "draft_tree": {"max_nodes": 4, "max_depth": 2, "branching": 2}}, "1"),
    (None, "1"),  # vLLM's own methods
])
def test_without_the_flag_or_a_ragged_chain_vllms_manager_stays(graph_manager, monkeypatch,
                                                                 settings, flag):
    monkeypatch.setenv(VARLEN_GRAPHS_ENV, flag)
    manager = graph_manager(settings)
    runner = _runner(manager, [_triton_group(TARGET_LAYERS)])
    assert not use_varlen_decode_graphs(runner)
    assert runner.cudagraph_manager is manager and not manager.varlen_decode


def test_where_vllm_could_not_replay_them_the_manager_stays_and_says_why(graph_manager,
                                                                         monkeypatch):
    from vllm.config import CUDAGraphMode

    monkeypatch.setenv(VARLEN_GRAPHS_ENV, "1")
    cases = {
        "ShortConvAttentionBackend": (graph_manager(ADAPTIVE), [
            _triton_group(TARGET_LAYERS[:1]), _uniform_only_group(TARGET_LAYERS[1:])]),
        "FULL has no FULL decode graphs of their own": (
            graph_manager(ADAPTIVE, mode=CUDAGraphMode.FULL), [_triton_group(TARGET_LAYERS)]),
        "no CUDA graphs": (graph_manager(ADAPTIVE, mode=CUDAGraphMode.NONE),
                           [_triton_group(TARGET_LAYERS)]),
    }
    for says, (manager, groups) in cases.items():
        runner = _runner(manager, groups)
        assert says in (varlen_decode_refusal(runner) or ""), says
        assert not use_varlen_decode_graphs(runner)
        assert runner.cudagraph_manager is manager and not manager.varlen_decode
    runner = _runner(graph_manager(ADAPTIVE), [_triton_group(TARGET_LAYERS)])
    runner.fast_prefill = object()
    assert "kv_sharing_fast_prefill" in varlen_decode_refusal(runner)
