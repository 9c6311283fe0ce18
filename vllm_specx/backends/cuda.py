"""CUDA backend: Triton kernels for verification and for draft-tree attention.

The kernels live in :mod:`vllm_specx.backends.triton_verify` and
:mod:`vllm_specx.backends.triton_tree_attention` and are imported on first use, so
importing this module (config validation does) needs neither Triton nor a GPU. ROCm
reports device type "cuda" and runs the same kernels.

Draft trees: :func:`tree_attention` is the one-call-per-layer attention a tree step
needs on CUDA (tested against the CPU tree attention under the Triton interpreter). On
vLLM's V1 runner a tree config runs with the target on vLLM's ``TRITON_ATTN`` backend,
whose forward is routed to it during a tree step (``glue/cuda_tree_attention.py``);
Model Runner V2 on CUDA is not wired (:data:`REASON_NO_DRAFT_TREE_V2`), so a tree config
runs on V1 there.
"""

from __future__ import annotations

import torch

from vllm_specx.algorithms.verify import VerifyBatch
from vllm_specx.backends.base import Backend, DeviceLimits

__all__ = ["BACKEND", "REASON_NO_DRAFT_TREE_V2", "tree_attention", "verify"]

REASON_NO_DRAFT_TREE_V2 = (
    "draft trees on CUDA run on vLLM's V1 model runner: Model Runner V2's tree step "
    "sets the tree masks for the CPU attention only, and its CUDA attention path (the "
    "Triton tree kernel through V2's attention metadata) is not wired yet"
)


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


BACKEND = Backend(
    name="cuda",
    kernel_impl="triton",
    limits=DeviceLimits(
        max_num_speculative_tokens=None,
        max_beam_positions=256,
        reason_max_beam_positions="the beam drafter batches num_beams * K tails per request",
        reason_no_draft_tree_v2=REASON_NO_DRAFT_TREE_V2,
    ),
    verify=verify,
    description="Triton kernels (also run on CPU under TRITON_INTERPRET=1 in tests)",
)
