"""The runtime fixes of vLLM's CPU path (defects 3-5, docs/upstream-vllm-cpu-adapter-defects.md)."""

from __future__ import annotations

import sys
import types

import pytest

pytestmark = pytest.mark.usefixtures("reference_ops")


class _DictLiar:
    """Like llvmlite's ``_lib_wrapper``: ``__dict__`` is served by ``__getattr__`` and
    is not a mapping."""

    __slots__ = ()

    def __getattr__(self, name):
        return lambda *a: None


def test_register_kernels_survives_objects_without_a_real_dict(monkeypatch):
    from vllm.triton_utils import dispatcher

    def kern(x_ptr, n):  # stands in for a Triton kernel
        raise AssertionError("the original must have been replaced")

    defining = types.ModuleType("specx_fake_kernels")
    defining.kern = kern
    user = types.ModuleType("specx_fake_user")
    user.kern = kern  # a ``from specx_fake_kernels import kern`` copy
    liar = types.ModuleType("specx_fake_llvmlite")
    liar.lib = _DictLiar()
    for mod in (defining, user, liar):
        monkeypatch.setitem(sys.modules, mod.__name__, mod)
    monkeypatch.setattr(dispatcher, "_registry", dict(dispatcher._registry))

    calls = []
    dispatcher.register_kernels({"specx_fake_kernels.kern": lambda x_ptr, n: calls.append(n)})
    defining.kern[(1,)](x_ptr=None, n=3)
    user.kern[(1,)](x_ptr=None, n=4)  # the copy was rebound too
    assert calls == [3, 4]


def test_platform_registers_its_overrides_once(monkeypatch):
    from vllm.platforms import current_platform
    from vllm.triton_utils import dispatcher

    calls = []
    monkeypatch.setattr(dispatcher, "register_kernels", lambda overrides: calls.append(1))
    current_platform.register_triton_kernel_overrides()  # already done by the fixture
    assert calls == []


def test_top_k_only_passes_an_empty_batch_through():
    """Defect 5: top-k without top-p on a step with no draft tokens (an empty batch)."""
    import torch
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    empty = torch.empty(0, 10)
    out = apply_top_k_top_p_pytorch(empty, torch.empty(0, dtype=torch.int32), None,
                                    allow_cpu_sync=True)
    assert out.shape == (0, 10)
    # A real batch is still masked: only the top 2 of each row survive.
    logits = torch.tensor([[0.0, 3.0, 1.0, 2.0], [4.0, 0.0, 1.0, 2.0]])
    masked = apply_top_k_top_p_pytorch(logits.clone(), torch.tensor([2, 2]), None,
                                       allow_cpu_sync=True)
    assert torch.isfinite(masked).sum(dim=1).tolist() == [2, 2]
    assert torch.isfinite(masked[0]).tolist() == [False, True, False, True]


@pytest.mark.parametrize(
    ("world_size", "is_last_rank", "expected_receives"),
    [(1, True, 0), (2, True, 0), (2, False, 1)],
)
def test_seeded_partial_prefill_leaves_the_early_return_to_vllm(
    monkeypatch, world_size, is_last_rank, expected_receives
):
    """A runner with no model state (a pipeline-parallel rank that is not the last, a
    KV-transfer-only step) takes vLLM's early return: the patched ``sample_tokens`` must
    not read ``input_batch``, which such a runner may not have. Built the way vLLM's own
    test_sample_tokens_receives_pp_sampled_ids_only_on_non_last_rank builds it."""
    from types import SimpleNamespace

    from vllm.v1.outputs import EMPTY_MODEL_RUNNER_OUTPUT
    from vllm.v1.worker import gpu_model_runner
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    patched = GPUModelRunner.sample_tokens
    assert patched.__specx_patch__ == "cpu_seeded_partial_prefill"  # the fix is on

    def bare_runner(receives: list[int]) -> GPUModelRunner:
        runner = GPUModelRunner.__new__(GPUModelRunner)  # no input_batch
        runner.execute_model_state = None
        runner.kv_connector_output = None
        runner.use_async_scheduling = True
        runner._pp_receive_prev_sampled_token_ids_to_input_batch = lambda: receives.append(1)
        return runner

    monkeypatch.setattr(
        gpu_model_runner,
        "get_pp_group",
        lambda: SimpleNamespace(world_size=world_size, is_last_rank=is_last_rank),
    )
    ours: list[int] = []
    vllms: list[int] = []
    output = patched(bare_runner(ours), None)
    expected = patched.__specx_original__(bare_runner(vllms), None)
    assert output is expected is EMPTY_MODEL_RUNNER_OUTPUT
    assert len(ours) == len(vllms) == expected_receives
