"""Ascend NPU backend: pure torch (no Triton), limited by the NPU attention operator.

Never imports torch_npu at module import: the package must import on any machine.
"""

from vllm_specx.backends.base import Backend, DeviceLimits

ASCEND_MAX_QUERY_TOKENS = 16  # npu_fused_infer_attention_score, TND layout

BACKEND = Backend(
    name="npu",
    kernel_impl="torch",
    limits=DeviceLimits(
        max_num_speculative_tokens=ASCEND_MAX_QUERY_TOKENS - 1,
        max_beam_positions=64,
        reason_max_num_speculative_tokens=(
            "Ascend's npu_fused_infer_attention_score verifies at most 16 tokens per "
            "request per step (K + 1 <= 16)"
        ),
        reason_max_beam_positions=(
            "the beam drafter batches num_beams * K tails per request and Ascend graph "
            "capture sizes grow with it"
        ),
    ),
    description="torch ops that torch_npu supports; no Triton",
)
