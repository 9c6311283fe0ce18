"""Fake vLLM-Ascend (see tests/ascend/fakes/README.md)."""

import torch_npu  # noqa: F401  (the real package needs torch_npu at import)


def register():
    """Register the NPU platform (entry point vllm.platform_plugins: ascend)."""
    return "vllm_ascend.platform.NPUPlatform"
