"""CUDA backend: Triton kernels for verification and for draft-tree attention.

The kernels live in :mod:`vllm_specx.backends.triton_verify` and
:mod:`vllm_specx.backends.triton_tree_attention` and are imported on first use, so
importing this module (config validation does) needs neither Triton nor a GPU. ROCm
reports device type "cuda" and runs the same kernels.

Draft trees: :func:`tree_attention` is the one-call-per-layer attention a tree step
needs on CUDA (tested against the CPU tree attention under the Triton interpreter), and
:func:`copy_slots` the accepted path's KV move in the cache layout of vLLM's
``TRITON_ATTN`` backend. A tree config runs with the target on that backend, whose
forward is routed to the tree kernel during a tree step (``glue/cuda_tree_attention.py``),
on vLLM's V1 runner or Model Runner V2 (vLLM's default; issue 34: the V2 tree step sets
the same masks and compacts through :func:`copy_slots` too).
"""

from __future__ import annotations

import torch

from vllm_specx.algorithms.verify import VerifyBatch
from vllm_specx.backends.base import Backend, DeviceLimits

__all__ = ["BACKEND", "copy_slots", "tree_attention", "verify"]



def verify(batch: VerifyBatch) -> torch.Tensor:
    """Triton verification (contract: :data:`vllm_specx.backends.base.VerifyFn`).

    Two launches: a token-parallel acceptance kernel and a per-request kernel that
    scans the drafts, samples the one extra token and writes the output row.
    Runs on CUDA tensors, or on CPU tensors under ``TRITON_INTERPRET=1`` (tests).
    """
    from vllm_specx.backends import triton_verify  # lazy: Triton only when used

    return triton_verify.verify(batch)


def tree_attention(*args, **kwargs) -> torch.Tensor:
    """Tree-masked paged attention in Triton: see
    :func:`vllm_specx.backends.triton_tree_attention.tree_attention` (same arguments)."""
    from vllm_specx.backends import triton_tree_attention  # lazy: Triton only when used

    return triton_tree_attention.tree_attention(*args, **kwargs)


def copy_slots(kv_cache: torch.Tensor, src_slots: torch.Tensor,
               dst_slots: torch.Tensor) -> None:
    """A tree step's KV move (contract: :data:`vllm_specx.backends.base.CopySlotsFn`) in
    one layer's ``TRITON_ATTN`` cache (logical ``[blocks, kv heads, block, 2 * head]``, K
    and V side by side per slot; any physical order), in place, by device indexing: no
    host sync. ``src_slots`` / ``dst_slots`` on the cache's device (a host tensor is
    moved there). Every source is read (gathered into a copy) before any destination is
    written, so overlapping moves are safe."""
    if src_slots.numel() == 0:
        return
    block_size = kv_cache.shape[2]
    by_slot = kv_cache.transpose(1, 2)  # [blocks, block, kv heads, 2 * head], a view
    src = src_slots.to(device=kv_cache.device, dtype=torch.int64)
    dst = dst_slots.to(device=kv_cache.device, dtype=torch.int64)
    moved = by_slot[src // block_size, src % block_size]  # a copy: [n, kv heads, 2 * head]
    by_slot[dst // block_size, dst % block_size] = moved


BACKEND = Backend(
    name="cuda",
    kernel_impl="triton",
    limits=DeviceLimits(
        max_num_speculative_tokens=None,
        max_beam_positions=256,
        reason_max_beam_positions="the beam drafter batches num_beams * K tails per request",
    ),
    verify=verify,
    copy_slots=copy_slots,
    description="Triton kernels (also run on CPU under TRITON_INTERPRET=1 in tests)",
)
