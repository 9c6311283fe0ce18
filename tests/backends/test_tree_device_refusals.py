"""A draft tree on a device that cannot verify one yet is refused before start in one line
that gives the device backend's own reason (``DeviceLimits.reason_no_draft_tree``): on
Ascend the tree mask is not routed and tree size + 1 <= 16. CPU and CUDA verify trees, on
either runner (issue 34: Model Runner V2 on CUDA too, so a tree config is no longer sent to
V1 there), and the one line logged before start on CUDA names the runner."""

from __future__ import annotations

import pytest
from specx_log import specx_log_lines

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
def test_trees_on_cuda_are_not_pushed_to_v1(method) -> None:
    """Issue 34: Model Runner V2 runs tree steps on CUDA too, so no backend gives a tree
    config a V1-only reason any more (vLLM's own choice stands: V2 by default)."""
    from vllm_specx.glue.patches import device_v1_only_reason

    settings = _translate(TREES[method], "cuda").specx_settings
    for device in ("cpu", "cuda"):
        assert backend_for_device(device).limits.reason_no_draft_tree_v2 == ""
        assert device_v1_only_reason(settings, backend_for_device(device)) is None


@pytest.mark.parametrize("env, runner", [
    (None, "on Model Runner V2 (vLLM's default; V1 if vLLM finds a feature V2 lacks"),
    ("1", "on Model Runner V2 (VLLM_USE_V2_MODEL_RUNNER=1)."),
    ("0", "on Model Runner V1 (VLLM_USE_V2_MODEL_RUNNER=0)."),
])
def test_the_one_cuda_tree_line_names_the_runner(env, runner, monkeypatch) -> None:
    """The speculative-config patch on a (simulated) CUDA platform with Triton: a tree
    config is not refused with VLLM_USE_V2_MODEL_RUNNER=1, gets TRITON_ATTN and eager,
    and the one line before start names the runner vLLM will pick (and no second,
    contradicting runner line is logged)."""

    from vllm.config import ParallelConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    import vllm_specx.backends
    from vllm_specx.fixtures import fixtures_root
    from vllm_specx.glue import patches

    monkeypatch.setattr(vllm_specx.backends, "select_backend",
                        lambda: backend_for_device("cuda"))
    monkeypatch.setattr(patches, "_vllm_has_triton", lambda: True)  # as on a GPU host
    if env is None:
        monkeypatch.delenv("VLLM_USE_V2_MODEL_RUNNER", raising=False)
    else:
        monkeypatch.setenv("VLLM_USE_V2_MODEL_RUNNER", env)
    with specx_log_lines() as lines:
        root = fixtures_root()
        args = EngineArgs(model=str(root / "target"), speculative_config={
            **TREES["adaptive"], "model": str(root / "draft")})
        args.create_speculative_config(args.create_model_config(), ParallelConfig())
    said = [line for line in lines if "Model Runner" in line]
    assert len(said) == 1, said
    assert "with draft_tree on CUDA" in said[0] and "TRITON_ATTN" in said[0], said
    assert "eager" in said[0] and runner in said[0], said
    assert args.enforce_eager
    assert args.attention_backend == AttentionBackendEnum.TRITON_ATTN
