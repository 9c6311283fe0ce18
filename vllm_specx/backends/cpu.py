"""CPU backend: the pure-PyTorch verification path (:mod:`vllm_specx.algorithms.verify`),
the draft-tree KV move in the layout of vllm-specx's CPU attention, and a vectorised draw
of the verification's Exp(1) noise."""

import time

import torch

from vllm_specx.algorithms.verify import verify
from vllm_specx.backends.base import Backend, DeviceLimits

__all__ = ["BACKEND", "copy_slots", "fill_exp_noise", "verify"]


def copy_slots(kv_cache: torch.Tensor, src_slots: torch.Tensor,
               dst_slots: torch.Tensor) -> None:
    """A tree step's KV move (contract: :data:`vllm_specx.backends.base.CopySlotsFn`) in
    the ``CPU_ATTN`` cache layout: :func:`vllm_specx.cpu_ops.attention.cpu_attn_copy_slots`
    (the attention a CPU engine runs, V1 runner or Model Runner V2)."""
    from vllm_specx.cpu_ops.attention import cpu_attn_copy_slots  # lazy: glue-free op

    cpu_attn_copy_slots(kv_cache, src_slots, dst_slots)


def fill_exp_noise(out: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """Exp(1) noise (contract: :data:`vllm_specx.backends.base.ExpNoiseFn`) as ``-log(U)``,
    ``U`` uniform in ``[0, 1)`` from ``generator``: torch's CPU ``exponential_`` draws
    element by element (1.4-1.5 ms per 49,152-token row on a 2-core AMD EPYC, one per
    sampled request and verification step, twice for a seeded one), the vectorised uniform
    and log a quarter of that. The same distribution to float32 resolution; ``U = 0``
    (probability 2^-24 per element) gives ``+inf``, which leaves that token out of that one
    race (the verify rules take the noise's reciprocal)."""
    out.uniform_(generator=generator).log_().neg_()


BACKEND = Backend(
    name="cpu",
    kernel_impl="torch",
    limits=DeviceLimits(
        max_num_speculative_tokens=None,
        max_beam_positions=256,
        reason_max_beam_positions="the beam drafter batches num_beams * K tails per request",
    ),
    verify=verify,
    copy_slots=copy_slots,
    description="vectorised PyTorch on the host",
    cost_clock=time.process_time,
    fill_exp_noise=fill_exp_noise,
)
