"""vLLM plugin entry point (group ``vllm.general_plugins``)."""

from __future__ import annotations


def register() -> None:
    """Called by vLLM in every process; must be idempotent and cheap."""
    from vllm_specx.cpu_ops import register_cpu_reference_ops_if_needed

    register_cpu_reference_ops_if_needed()
