"""Draft trees on CUDA: what a tree step runs in vLLM's Triton attention backend.

On CPU a tree step sets the step's ancestor masks on vllm-specx's CPU attention
(``cpu_ops.attention.query_masks``, around the target's forward, ``glue/tree_step.py``)
and moves the accepted path's K/V with ``cpu_attn_copy_slots``. The CUDA counterparts:

* :func:`tree_forward`: what ``TritonAttentionImpl.forward`` (vLLM 0.32,
  ``v1/attention/backends/triton_attn.py``) computes for one layer, with the step's tree
  masks: the same K/V cache views and metadata fields it passes to vLLM's
  ``unified_attention``, given to vllm-specx's Triton tree kernel
  (:mod:`vllm_specx.backends.triton_tree_attention`; why not vLLM's ``qq_bias``: there).
* :func:`tree_forward_refusal`: the layer features the kernel does not have (ALiBi,
  soft-capping, sliding windows, sinks, quantised KV caches, encoder attention), one line.
* :func:`copy_slots`: the accepted path's K/V moved in the Triton backend's cache layout.

Status (honest): these are tested on CPU (the kernel under the Triton interpreter, the
argument mapping against vLLM's real ``TritonAttentionImpl`` and metadata), but no patch
routes ``TritonAttentionImpl.forward`` here yet and nothing has run on a GPU, so
``draft_tree`` stays refused on CUDA before start (``backends/cuda.REASON_NO_DRAFT_TREE``).
What is left: a named patch of ``TritonAttentionImpl.forward`` that calls
:func:`tree_forward` while the step's masks are set (and the FlashAttention choice:
switch a tree config's target to ``TRITON_ATTN`` with one log line), the tree step's
compaction through :func:`copy_slots` on CUDA, and a GPU run of the greedy-equality
engine tests before lifting the refusal.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["copy_slots", "tree_forward", "tree_forward_args", "tree_forward_refusal"]

# kv_cache_dtype values the kernel reads as they are (no dequantisation in it).
_PLAIN_KV_DTYPES = frozenset({"auto", "float16", "bfloat16", "float32"})


def tree_forward_refusal(impl: Any) -> str | None:
    """Why the Triton tree kernel cannot stand in for ``impl`` (a ``TritonAttentionImpl``)
    in a tree step, or None. One line: the feature and why it matters."""
    attn_type = getattr(impl.attn_type, "value", impl.attn_type)  # a str Enum in vLLM
    if attn_type != "decoder":
        return f"attention type {attn_type!r}: a tree step verifies decoder self-attention"
    if impl.kv_cache_dtype not in _PLAIN_KV_DTYPES:
        return (f"kv_cache_dtype {impl.kv_cache_dtype!r}: the tree kernel reads unquantised "
                "caches only")
    if impl.alibi_slopes is not None:
        return "ALiBi: a tree node's position is ctx + depth, not its KV slot"
    if tuple(impl.sliding_window) != (-1, -1):
        return "a sliding window: it would cut keys by KV slot, not by tree position"
    if impl.logits_soft_cap:
        return "logit soft-capping is not in the tree kernel"
    if impl.sinks is not None:
        return "attention sinks are not in the tree kernel"
    return None


def tree_forward_args(impl: Any, query: torch.Tensor, kv_cache: torch.Tensor,
                      attn_metadata: Any, output: torch.Tensor, masks: Any) -> dict[str, Any]:
    """The Triton tree kernel's arguments for one layer of a tree step: exactly the views
    and metadata fields ``TritonAttentionImpl.forward`` hands to ``unified_attention``
    (K/V split of the ``[blocks, kv heads, block, 2 * head]`` cache, the step's query
    rows, ``query_start_loc``, ``seq_lens``, ``block_table``, ``max_query_len``, the
    layer's scale), plus the step's ``TreeMasks``."""
    refusal = tree_forward_refusal(impl)
    if refusal is not None:
        raise NotImplementedError(f"vllm-specx tree attention on CUDA: {refusal}")
    n = attn_metadata.num_actual_tokens
    # (B, H, N, 2 hs) -> (B, N, H, 2 hs) -> K and V views, as the backend does.
    key_cache, value_cache = kv_cache.transpose(1, 2).split(impl.head_size, dim=-1)
    return dict(
        query=query[:n].view(n, impl.num_heads, impl.head_size), key_cache=key_cache,
        value_cache=value_cache, out=output[:n].view(n, impl.num_heads, impl.head_size),
        query_start_loc=attn_metadata.query_start_loc, seq_lens=attn_metadata.seq_lens,
        block_table=attn_metadata.block_table, max_query_len=attn_metadata.max_query_len,
        scale=impl.scale, masks=masks)


def tree_forward(impl: Any, query: torch.Tensor, kv_cache: torch.Tensor,
                 attn_metadata: Any, output: torch.Tensor, masks: Any) -> torch.Tensor:
    """One layer of a tree step on vLLM's Triton backend (``output`` written, returned)."""
    from vllm_specx.backends.cuda import tree_attention

    tree_attention(**tree_forward_args(impl, query, kv_cache, attn_metadata, output, masks))
    return output


def copy_slots(kv_cache: torch.Tensor, src_slots: torch.Tensor,
               dst_slots: torch.Tensor) -> None:
    """Copy the K and V of slots ``src_slots[i]`` to ``dst_slots[i]`` in one layer's
    Triton-backend cache (logical ``[blocks, kv heads, block, 2 * head]``, K and V side by
    side per slot; any physical order), in place. Every source is read before any
    destination is written, so overlapping moves are safe (as ``cpu_attn_copy_slots``)."""
    if src_slots.numel() == 0:
        return
    block_size = kv_cache.shape[2]
    by_slot = kv_cache.transpose(1, 2)  # [blocks, block, kv heads, 2 * head], a view
    src, dst = src_slots.to(torch.int64), dst_slots.to(torch.int64)
    moved = by_slot[src // block_size, src % block_size]  # a copy: [n, kv heads, 2 * head]
    by_slot[dst // block_size, dst % block_size] = moved
