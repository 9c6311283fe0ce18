"""A draft tree on a device that cannot verify one yet is refused before start in one line
that gives the device backend's own reason (``DeviceLimits.reason_no_draft_tree``): on
Ascend the tree mask is not routed and tree size + 1 <= 16. CPU and CUDA verify trees;
on CUDA on vLLM's V1 runner only (``reason_no_draft_tree_v2``), which vLLM is told through
its V2 opt-out list (``specx_selects_v1_runner``)."""

from __future__ import annotations

import pytest

from vllm_specx.backends import backend_for_device
from vllm_specx.config import SpecxConfigError, translate
from vllm_specx.glue.patches import vllm_method_names, vllm_speculative_fields

TREES = {
    "mtad": {"method": "mtad", "model": "draft", "num_speculative_tokens": 3, "num_beams": 4,
             "draft_tree": True},
    "adaptive": {"method": "adaptive", "model": "draft", "num_speculative_tokens": 4,
                 "draft_tree": {"max_nodes": 8, "max_depth": 3, "branching": 3}},
}


def _translate(config: dict, device: str):
    return translate(config, vllm_methods=vllm_method_names(),
                     vllm_fields=vllm_speculative_fields(),
                     limits=backend_for_device(device).limits, device=device,
                     check_available=False)


@pytest.mark.parametrize("method", sorted(TREES))
@pytest.mark.parametrize("device, fragments", [
    ("npu", ["not on npu yet", "npu_fused_infer_attention_score", "tree size + 1 <= 16"]),
])
def test_tree_refusal_gives_the_devices_reason(method, device, fragments) -> None:
    with pytest.raises(SpecxConfigError) as info:
        _translate(TREES[method], device)
    message = str(info.value)
    assert "\n" not in message and 'speculative_config["draft_tree"]' in message
    for fragment in fragments:
        assert fragment in message, message
    assert backend_for_device(device).limits.reason_no_draft_tree in message


@pytest.mark.parametrize("method", sorted(TREES))
@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_cpu_and_cuda_have_no_tree_refusal(method, device) -> None:
    assert backend_for_device(device).limits.reason_no_draft_tree == ""
    assert _translate(TREES[method], device).specx_settings["draft_tree"]


@pytest.mark.parametrize("method", sorted(TREES))
def test_trees_on_cuda_select_the_v1_runner(method) -> None:
    """On CUDA a tree config needs the V1 runner, with the reason in vLLM's opt-out list;
    a chain config of the same method, and any config on CPU, has no such reason."""
    from vllm_specx.glue.patches import device_v1_only_reason

    settings = _translate(TREES[method], "cuda").specx_settings
    cuda = backend_for_device("cuda")
    reason = device_v1_only_reason(settings, cuda)
    assert reason == cuda.limits.reason_no_draft_tree_v2 and "V1 model runner" in reason
    assert device_v1_only_reason(settings, backend_for_device("cpu")) is None
    assert device_v1_only_reason({**settings, "draft_tree": False}, cuda) is None
