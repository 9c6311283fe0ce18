"""A draft tree's KV compaction is a device backend function (issue 34): ``Backend.copy_slots``,
chosen where the backend is chosen (``backends.select_backend``), called by both runners'
compaction (``TreeState.compact_path_kv``, shared by V1's and V2's tree steps); and the
checks a runner makes before it builds its tree state on CUDA (TRITON_ATTN, no CUDA
graphs; V1 and V2 alike).

* cpu: the ``CPU_ATTN`` layout (``cpu_attn_copy_slots``); cuda: vLLM's ``TRITON_ATTN``
  layout, in both physical cache orders; npu: a one-line refusal (trees are refused there
  before start). Every backend reads all sources before writing, so a move whose
  destination is another move's source is safe.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_specx.backends import backend_for_device
from vllm_specx.config import SpecxConfigError

BLOCK, KV_HEADS, HEAD = 4, 2, 8


def _cpu_cache(blocks: int = 6) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A CPU_ATTN cache ``[blocks, kv heads, block, 2 * head]`` (K rows then V rows per
    block, module doc of cpu_ops/attention.py) and its K and V as ``[slot, heads, head]``."""
    kv = torch.randn(blocks, KV_HEADS, BLOCK, 2 * HEAD)
    halves = kv.view(blocks, KV_HEADS, 2 * BLOCK, HEAD)
    k, v = halves[:, :, :BLOCK], halves[:, :, BLOCK:]
    return kv, k.transpose(1, 2).reshape(-1, KV_HEADS, HEAD), v.transpose(1, 2).reshape(
        -1, KV_HEADS, HEAD)


def _triton_cache(order: str, blocks: int = 6
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A TRITON_ATTN cache, logical ``[blocks, kv heads, block, 2 * head]``, stored NHD
    (block-major slots) or HND, and its K and V as ``[slot, heads, head]``."""
    if order == "NHD":
        kv = torch.randn(blocks, BLOCK, KV_HEADS, 2 * HEAD).transpose(1, 2)
    else:
        kv = torch.randn(blocks, KV_HEADS, BLOCK, 2 * HEAD)
    by_slot = kv.transpose(1, 2).reshape(-1, KV_HEADS, 2 * HEAD)
    return kv, by_slot[..., :HEAD], by_slot[..., HEAD:]


# Slot 9 -> 5, 14 -> 6, 5 -> 7: slot 5 is both a destination and a later move's source.
SRC, DST = torch.tensor([9, 14, 5]), torch.tensor([5, 6, 7])


@pytest.mark.parametrize("device, order", [("cpu", "CPU_ATTN"), ("cuda", "NHD"),
                                           ("cuda", "HND")])
def test_backend_copy_slots_moves_k_and_v_and_nothing_else(device, order) -> None:
    kv, k, v = _cpu_cache() if device == "cpu" else _triton_cache(order)
    want_k, want_v = k.clone(), v.clone()
    want_k[DST], want_v[DST] = k[SRC].clone(), v[SRC].clone()
    backend_for_device(device).copy_slots(kv, SRC, DST)
    _, got_k, got_v = (kv, *_views(kv, device))
    assert torch.equal(got_k, want_k) and torch.equal(got_v, want_v)


def _views(kv: torch.Tensor, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    if device == "cpu":
        halves = kv.view(kv.shape[0], KV_HEADS, 2 * BLOCK, HEAD)
        return (halves[:, :, :BLOCK].transpose(1, 2).reshape(-1, KV_HEADS, HEAD),
                halves[:, :, BLOCK:].transpose(1, 2).reshape(-1, KV_HEADS, HEAD))
    by_slot = kv.transpose(1, 2).reshape(-1, KV_HEADS, 2 * HEAD)
    return by_slot[..., :HEAD], by_slot[..., HEAD:]


def test_backends_copy_slots_are_the_layouts_the_tree_steps_run_on() -> None:
    from vllm_specx.cpu_ops.attention import cpu_attn_copy_slots
    from vllm_specx.glue import cuda_tree_attention

    assert backend_for_device("cuda").copy_slots is cuda_tree_attention.copy_slots
    # The cpu backend's move is the CPU attention's own (same result on the same cache).
    kv, _, _ = _cpu_cache()
    other = kv.clone()
    backend_for_device("cpu").copy_slots(kv, SRC, DST)
    cpu_attn_copy_slots(other, SRC, DST)
    assert torch.equal(kv, other)
    with pytest.raises(NotImplementedError) as info:
        backend_for_device("npu").copy_slots(kv, SRC, DST)
    assert "\n" not in str(info.value) and "refused there before start" in str(info.value)


def test_compaction_calls_the_selected_backends_copy_slots(monkeypatch) -> None:
    """``TreeState.compact_path_kv`` (V1 and V2 compaction) moves the accepted path with
    whatever ``select_backend()`` gives, once per layer, slots as the tree step recorded
    them; a path already in place moves nothing."""
    import vllm_specx.backends
    from vllm_specx.glue.tree_step import StepTree, TreeState, TreeStep

    calls: list[tuple[torch.Tensor, list[int], list[int]]] = []
    fake = SimpleNamespace(copy_slots=lambda kv, s, d: calls.append((kv, s.tolist(),
                                                                      d.tolist())))
    monkeypatch.setattr(vllm_specx.backends, "select_backend", lambda: fake)
    parents = torch.tensor([-1, -1, 0, 1])
    slots = torch.tensor([40, 41, 42, 43, 44])  # root, then nodes 0..3
    tree = StepTree(row=0, start=0, ctx=7, parents=parents, tokens=torch.arange(4),
                    slots={0: slots})
    caches = [torch.zeros(1), torch.zeros(2)]
    state = TreeState()
    step = TreeStep([tree], masks=None, accepted={0: [1, 3]})
    assert state.compact_path_kv(step, tree, {0: caches}).tolist() == [1, 3]
    assert [(c is kv, s, d) for (c, s, d), kv in zip(calls, caches)] == [
        (True, [42, 44], [41, 42]), (True, [42, 44], [41, 42])]
    calls.clear()
    step.accepted[0] = [0]  # the first node, already in the chain slot after the root
    state.compact_path_kv(step, tree, {0: caches})
    assert calls == [] and state.stats.compacted == 1


def _cuda_runner(v2: bool, backend: str = "TRITON_ATTN", graphs: str = "NONE") -> object:
    """What ``new_tree_state`` reads off a runner (class module: V1 or V2)."""
    module = "vllm.v1.worker.gpu.model_runner" if v2 else "vllm.v1.worker.gpu_model_runner"
    runner_cls = type("GPUModelRunner", (), {"__module__": module})
    runner = runner_cls()
    runner.device = torch.device("cuda", 0)
    runner.vllm_config = SimpleNamespace(
        attention_config=SimpleNamespace(backend=SimpleNamespace(name=backend)),
        compilation_config=SimpleNamespace(cudagraph_mode=SimpleNamespace(name=graphs)))
    runner.model_config = SimpleNamespace(get_sliding_window=lambda: None)
    return runner


SETTINGS = {"method": "adaptive", "draft_tree": {"max_nodes": 8}}


@pytest.mark.parametrize("v2", [False, True])
def test_a_cuda_runner_builds_its_tree_state_on_either_runner(v2) -> None:
    from vllm_specx.glue.runner_hook import new_tree_state
    from vllm_specx.glue.tree_step import TreeState

    runner = _cuda_runner(v2)
    assert isinstance(new_tree_state(runner, SETTINGS), TreeState)
    assert runner.specx_tree_state is not None


@pytest.mark.parametrize("kw, fragment", [
    ({"backend": "FLASH_ATTN"}, "CUDA with the FLASH_ATTN attention backend"),
    ({"graphs": "FULL_AND_PIECEWISE"}, "CUDA graphs (cudagraph_mode FULL_AND_PIECEWISE)"),
])
def test_a_cuda_runner_refuses_what_the_route_cannot_serve(kw, fragment) -> None:
    from vllm_specx.glue.runner_hook import new_tree_state

    with pytest.raises(SpecxConfigError) as info:
        new_tree_state(_cuda_runner(True, **kw), SETTINGS)
    message = str(info.value)
    assert "\n" not in message and fragment in message, message
