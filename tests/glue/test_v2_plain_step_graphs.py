"""``v2_plain_step_graphs`` (glue/v2_patches.py): with VLLM_SPECX_V2_PLAIN_STEP_GRAPHS=1 a
ragged specx method's Model Runner V2 graph manager also plans FULL decode graphs for
1-token queries. Checked on vLLM's real ``ModelCudaGraphManager`` (its candidate planning
and ``dispatch``; nothing is captured on this CPU host, so the manager is marked captured
to reach ``dispatch``'s choice), with the distributed lookups it makes stubbed."""

from __future__ import annotations

import types

import pytest

from vllm_specx.config import SPECX_CONFIG_KEY
from vllm_specx.glue.v2_patches import PLAIN_STEP_GRAPHS_ENV, V2PlainStepGraphs

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

    def make(settings, decode_query_len=1 + K):
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
            config, "cpu", CUDAGraphMode.FULL_AND_PIECEWISE, decode_query_len=decode_query_len)
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
