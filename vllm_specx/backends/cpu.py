"""CPU backend: the pure-PyTorch verification path."""

from vllm_specx.backends.base import Backend, DeviceLimits

BACKEND = Backend(
    name="cpu",
    kernel_impl="torch",
    limits=DeviceLimits(
        max_num_speculative_tokens=None,
        max_beam_positions=256,
        reason_max_beam_positions="the beam drafter batches num_beams * K tails per request",
    ),
    description="vectorised PyTorch on the host",
)
