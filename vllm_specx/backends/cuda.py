"""CUDA backend: Triton kernels for verification.

The kernels live in :mod:`vllm_specx.backends.triton_verify` and are imported on the
first ``verify`` call, so importing this module (config validation does) needs
neither Triton nor a GPU. ROCm reports device type "cuda" and runs the same kernels.
"""

from __future__ import annotations

import torch

from vllm_specx.algorithms.verify import VerifyBatch
from vllm_specx.backends.base import Backend, DeviceLimits

__all__ = ["BACKEND", "verify"]


def verify(batch: VerifyBatch) -> torch.Tensor:
    """Triton verification (contract: :data:`vllm_specx.backends.base.VerifyFn`).

    Two launches: a token-parallel acceptance kernel and a per-request kernel that
    scans the drafts, samples the one extra token and writes the output row.
    Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
    """
    from vllm_specx.backends import triton_verify  # lazy: Triton only when used

    return triton_verify.verify(batch)


BACKEND = Backend(
    name="cuda",
    kernel_impl="triton",
    limits=DeviceLimits(
        max_num_speculative_tokens=None,
        max_beam_positions=256,
        reason_max_beam_positions="the beam drafter batches num_beams * K tails per request",
    ),
    verify=verify,
    description="Triton kernels (also run on CPU under TRITON_INTERPRET=1 in tests)",
)
