"""CUDA backend: Triton kernels for verification (one program per request)."""

from vllm_specx.backends.base import Backend, DeviceLimits

BACKEND = Backend(
    name="cuda",
    kernel_impl="triton",
    limits=DeviceLimits(
        max_num_speculative_tokens=None,
        max_beam_positions=256,
        reason_max_beam_positions="the beam drafter batches num_beams * K tails per request",
    ),
    description="Triton kernels (also run on CPU under TRITON_INTERPRET=1 in tests)",
)
