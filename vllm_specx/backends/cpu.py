"""CPU backend: the pure-PyTorch verification path (:mod:`vllm_specx.algorithms.verify`)."""

from vllm_specx.algorithms.verify import verify
from vllm_specx.backends.base import Backend, DeviceLimits

__all__ = ["BACKEND", "verify"]

BACKEND = Backend(
    name="cpu",
    kernel_impl="torch",
    limits=DeviceLimits(
        max_num_speculative_tokens=None,
        max_beam_positions=256,
        reason_max_beam_positions="the beam drafter batches num_beams * K tails per request",
    ),
    verify=verify,
    description="vectorised PyTorch on the host",
)
