"""A draft tree on a device that cannot verify one yet is refused before start in one line
that gives the device backend's own reason (``DeviceLimits.reason_no_draft_tree``): on CUDA
the Triton tree kernel is ready but its engine path is not validated on a GPU; on Ascend
the tree mask is not routed and tree size + 1 <= 16. The CPU backend has no such reason."""

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
    ("cuda", ["not on cuda yet", "Triton tree attention kernel is ready",
              "not yet validated on a GPU"]),
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
def test_cpu_has_no_tree_refusal(method) -> None:
    assert backend_for_device("cpu").limits.reason_no_draft_tree == ""
    assert _translate(TREES[method], "cpu").specx_settings["draft_tree"]
