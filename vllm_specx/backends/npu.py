"""Ascend NPU backend: pure torch (no Triton), limited by the NPU attention operator.

Never imports torch_npu (at import or at call time): the package must import on any
machine, and the verification path needs nothing from torch_npu beyond the ordinary
``torch`` ops it registers for the "npu" device once vLLM-Ascend has loaded it.

Verification runs the same vectorised torch code as the CPU backend
(:mod:`vllm_specx.algorithms.verify`); the two differ only in their limits and in one
cast: the randomness vLLM draws in float64 is cast to float32 before anything else
runs. That code was written to stay inside what
torch_npu runs natively (checked op by op in ``tests/backends/test_npu_ops.py``):

* elementwise: ``where``, comparisons, ``&``/``|``/``~``, ``sub``/``mul``,
  ``clamp``, ``log``, ``reciprocal``, dtype casts among int32/int64/float32/bool;
* indexing: ``gather`` and ``index_select`` with int64 indices (no advanced
  ``aten::index``, no ``scatter``);
* reductions, all over float32: ``argmax`` of probability rows, ``amax`` (residual
  mass), ``amin``/``amax`` over the [B, K] position grid (positions are float32 on
  purpose, as vLLM-Ascend's own sampler does with ``.float().argmax``), ``cumsum``
  (MTAD's running log-ratio); booleans are gathered as int32;
* no ``sort``/``topk``, no ``cumprod`` (the first rejection is a min over positions,
  not a boolean cumprod), no ``searchsorted``, no float64 arithmetic: float64
  uniforms or noise are cast to float32 first (pass float32 to skip even the cast),
  no host synchronisation and no data-dependent shapes (graph-capture friendly).
"""

from __future__ import annotations

import torch

from vllm_specx.algorithms.verify import VerifyBatch
from vllm_specx.algorithms.verify import verify as torch_verify
from vllm_specx.backends.base import Backend, DeviceLimits

__all__ = ["BACKEND", "ASCEND_MAX_QUERY_TOKENS", "REASON_NO_DRAFT_TREE", "copy_slots",
           "verify"]

ASCEND_MAX_QUERY_TOKENS = 16  # npu_fused_infer_attention_score, TND layout

# Draft trees on Ascend: decided NOT to route the tree mask (issue 34, item 4). The mask
# would have to reach npu_fused_infer_attention_score through vLLM-Ascend's attention
# metadata builders, which only the fakes could test here, and a tree of more than 15
# nodes could not be verified there at all; a refusal that says so is honest, a hook
# no NPU has run is not.
REASON_NO_DRAFT_TREE = (
    "vLLM-Ascend's attention (npu_fused_infer_attention_score) is not given the tree's "
    "ancestor mask by vllm-specx, and it verifies at most 16 query tokens per request per "
    "step, so a tree there would need tree size + 1 <= 16 (as K + 1 <= 16 for a chain); "
    "tree verification runs on CPU and on CUDA (vLLM's V1 runner or Model Runner V2)"
)


def verify(batch: VerifyBatch) -> torch.Tensor:
    """The CPU backend's torch path on the batch with float32 randomness, so no
    float64 kernel ever runs on the device."""
    return torch_verify(batch.with_float32_randomness())


def copy_slots(kv_cache: torch.Tensor, src_slots: torch.Tensor,
               dst_slots: torch.Tensor) -> None:
    """No tree KV move on Ascend: a tree config is refused there before start
    (:data:`REASON_NO_DRAFT_TREE`), so a call means that refusal was bypassed; vLLM-Ascend's
    cache layout was never checked for it, so it raises rather than guess."""
    raise NotImplementedError(
        "vllm-specx: no draft-tree KV compaction on Ascend NPUs (draft_tree is refused "
        "there before start: " + REASON_NO_DRAFT_TREE + ")")


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
        reason_no_draft_tree=REASON_NO_DRAFT_TREE,
    ),
    verify=verify,
    copy_slots=copy_slots,
    description="torch ops that torch_npu supports; no Triton",
)
