"""CPU backend: the pure-PyTorch verification path (:mod:`vllm_specx.algorithms.verify`)
and the draft-tree KV move in the layout of vllm-specx's CPU attention."""

import time

import torch

from vllm_specx.algorithms.verify import verify
from vllm_specx.backends.base import Backend, DeviceLimits

__all__ = ["BACKEND", "copy_slots", "verify"]


def copy_slots(kv_cache: torch.Tensor, src_slots: torch.Tensor,
               dst_slots: torch.Tensor) -> None:
    """A tree step's KV move (contract: :data:`vllm_specx.backends.base.CopySlotsFn`) in
    the ``CPU_ATTN`` cache layout: :func:`vllm_specx.cpu_ops.attention.cpu_attn_copy_slots`
    (the attention a CPU engine runs, V1 runner or Model Runner V2)."""
    from vllm_specx.cpu_ops.attention import cpu_attn_copy_slots  # lazy: glue-free op

    cpu_attn_copy_slots(kv_cache, src_slots, dst_slots)


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
)
