"""Shared fixtures for the CPU reference op tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def reference_ops() -> None:
    """Register the reference ops in this process (as vLLM's plugin loader would) and
    let the platform install its kernel overrides (as each vLLM worker does).

    Skips where the ops are not ours to test: a GPU host or a real vLLM CPU build.
    """
    from vllm_specx.cpu_ops import register_cpu_reference_ops_if_needed

    if not register_cpu_reference_ops_if_needed():
        pytest.skip("vllm-specx CPU reference ops not active on this host")
    from vllm.platforms import current_platform

    current_platform.register_triton_kernel_overrides()
