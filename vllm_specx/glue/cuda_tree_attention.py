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
* ``copy_slots``: the accepted path's K/V moved in the Triton backend's cache layout
  (:func:`vllm_specx.backends.cuda.copy_slots`, the CUDA backend's ``copy_slots``, which
  both runners' compaction calls through ``backends.select_backend``).

* :class:`TritonTreeRoute`: the named patch (``triton_attention_tree_route``) of
  ``TritonAttentionImpl.forward`` that calls :func:`tree_forward` while a forward's tree
  masks are set (the CPU path's step-scoped state, ``cpu_ops.attention.query_masks``:
  the target's tree step and the EAGLE heads' tree passes set it) and vLLM's own forward,
  untouched, otherwise.

Status: tested on CPU (the kernel and the patched forward under the Triton interpreter,
against vLLM's real ``TritonAttentionImpl`` and metadata, V1's and Model Runner V2's); the
engine path (``TRITON_ATTN``, eager; vLLM's default runner, V2, or V1) is switched on for
CUDA; the GPU run of the engine tests (``tests/backends/test_cuda_tree_engine.py``) showed
it on both runners (an H200, 2026-11-26).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from vllm_specx.backends import cuda as _cuda_backend
from vllm_specx.cpu_ops.attention import active_query_masks as _active_query_masks
from vllm_specx.glue.patch_base import VllmPatch

__all__ = ["TRITON_ATTN", "TritonTreeRoute", "copy_slots", "device_tree_masks",
           "prepare_cuda_tree_engine", "tree_config_refusal", "tree_forward",
           "tree_forward_args", "tree_forward_refusal"]

# vLLM's name of its Triton attention backend (AttentionBackendEnum.TRITON_ATTN).
TRITON_ATTN = "TRITON_ATTN"

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


def tree_config_refusal(model_config: Any, kv_cache_dtype: str | None) -> str | None:
    """What :func:`tree_forward_refusal` would say of the target's layers, read off the
    model config before start (the layers themselves exist only after load; the patched
    forward checks them again): a quantised KV cache, logit soft-capping, a sliding
    window. One line, or None."""
    if kv_cache_dtype not in (None, *_PLAIN_KV_DTYPES):
        return (f"kv_cache_dtype {kv_cache_dtype!r}: the tree kernel reads unquantised "
                "caches only")
    hf = getattr(model_config, "hf_text_config", None)
    for key in ("attn_logit_softcapping", "attn_logit_softcap"):
        if getattr(hf, key, None):
            return "logit soft-capping is not in the tree kernel"
    window = model_config.get_sliding_window() if hasattr(
        model_config, "get_sliding_window") else None
    if window:
        return (f"a sliding window ({window}): it would cut keys by KV slot, not by tree "
                "position")
    return None


def _backend_name(value: Any) -> str | None:
    name = getattr(value, "name", value)
    if name is None or str(name).lower() == "auto":
        return None
    return str(name).upper()


def prepare_cuda_tree_engine(engine_args: Any, model_config: Any, method: str,
                             tree: Any, *, runner: str) -> str:
    """Before start, for a ``draft_tree`` config on CUDA: refuse in one line what the tree
    kernel cannot stand in for, put the target on vLLM's ``TRITON_ATTN`` backend (vLLM
    picks FlashAttention on NVIDIA by default, which takes no per-request mask) and make
    the engine eager; returns the one log line that says so and names ``runner`` (the
    model runner vLLM will pick and why: ``patches.runner_choice``). Both runners run
    tree steps on CUDA; eager on both (no CUDA graph: V2's capture is switched off by
    ``enforce_eager`` as V1's is).

    ``engine_args`` is the ``EngineArgs`` being turned into a ``VllmConfig`` (its
    attention backend is read after the speculative config, so setting it here takes
    effect); ``model_config`` the target's ``ModelConfig``, already built, whose
    ``enforce_eager`` decides CUDA graphs and compilation in ``VllmConfig``."""
    from vllm_specx.config import SpecxConfigError

    head = (f'speculative_config["draft_tree"] = {tree!r} is not allowed for method '
            f"'{method}' on CUDA")
    refusal = tree_config_refusal(model_config, getattr(engine_args, "kv_cache_dtype", None))
    if refusal is not None:
        raise SpecxConfigError(f"{head}: {refusal}.")
    attention = getattr(engine_args, "attention_config", None)
    given = _backend_name(getattr(engine_args, "attention_backend", None)) or _backend_name(
        getattr(attention, "backend", None))
    per_kind = {kind: _backend_name(b) for kind, b in
                (getattr(attention, "backend_per_kind", None) or {}).items()}
    others = sorted({b for b in [given, *per_kind.values()] if b not in (None, TRITON_ATTN)})
    if others:
        raise SpecxConfigError(
            f"{head} with the {', '.join(others)} attention backend: a tree step runs "
            f"vllm-specx's Triton tree kernel in place of vLLM's {TRITON_ATTN} backend's "
            "attention (the others take no per-request tree mask); leave the attention "
            f"backend unset (vllm-specx then picks {TRITON_ATTN}) or set it to {TRITON_ATTN}.")
    if given is None:
        from vllm.v1.attention.backends.registry import AttentionBackendEnum

        engine_args.attention_backend = AttentionBackendEnum.TRITON_ATTN
    engine_args.enforce_eager = True
    model_config.enforce_eager = True
    chose = ("switched from vLLM's automatic choice (FlashAttention on NVIDIA for 16-bit "
             "models) to" if given is None else "on")
    return (f"vllm-specx: {method} with draft_tree on CUDA: the target's attention "
            f"{chose} vLLM's {TRITON_ATTN} backend, whose layers run vllm-specx's Triton "
            "tree kernel during tree steps (glue/cuda_tree_attention.py); the engine runs "
            "eager (enforce_eager: no CUDA graph is captured for the target, the drafter "
            f"or the tree steps, and nothing is torch.compiled); on {runner}.")


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
    if attn_metadata.causal is not True:
        # The CPU op refuses this too: tree masks refine a causal forward only.
        raise RuntimeError("vllm-specx: tree query masks on a non-causal attention call")
    if getattr(attn_metadata, "mm_prefix_range_tensor", None) is not None:
        raise NotImplementedError("vllm-specx tree attention on CUDA: bidirectional "
                                  "multimodal prefixes are not in the tree kernel")
    reqs = attn_metadata.seq_lens.shape[0]
    if masks.first_row.shape[0] < reqs:
        # Requests padded past the step's (seq_len 0, no query rows) are causal.
        pad = torch.full((reqs - masks.first_row.shape[0],), -1, dtype=torch.int32,
                         device=masks.first_row.device)
        masks = type(masks)(torch.cat([masks.first_row, pad]), masks.rows)
    elif masks.first_row.shape[0] > reqs:
        raise RuntimeError(
            f"vllm-specx: the step's tree masks were built for {masks.first_row.shape[0]} "
            f"requests, but attention ran over {reqs}")
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


# The device twin of the forward's QueryMasks: (the QueryMasks object, device, TreeMasks,
# the query tokens the masks were built for). Built on the first layer of a forward, read
# by every other layer of it.
_TWIN: tuple[Any, torch.device, Any, int] | None = None


def device_tree_masks(masks: Any, device: torch.device) -> Any:
    """The kernel's :class:`~vllm_specx.backends.triton_tree_attention.TreeMasks` on
    ``device`` for the CPU path's ``QueryMasks`` (built once per forward, not per layer;
    copied from pinned memory without a host sync on CUDA)."""
    return _twin(masks, device)[2]


def _twin(masks: Any, device: torch.device) -> tuple[Any, torch.device, Any, int]:
    global _TWIN
    twin = _TWIN
    if twin is not None and twin[0] is masks and twin[1] == device:
        return twin
    from vllm_specx.backends.triton_tree_attention import TreeMasks

    host = TreeMasks.from_query_masks(masks)
    if device.type == "cuda":
        built = TreeMasks(host.first_row.pin_memory().to(device, non_blocking=True),
                          host.rows.pin_memory().to(device, non_blocking=True))
    else:
        built = TreeMasks(host.first_row.to(device), host.rows.to(device))
    _TWIN = (masks, device, built, int(masks.q_lens.sum()))
    return _TWIN


# The accepted path's K/V move in the Triton backend's cache layout lives with the CUDA
# backend (``Backend.copy_slots``, chosen in ``backends.select_backend``); kept here under
# its old name for callers that want the Triton layout whatever the platform (tests).
copy_slots = _cuda_backend.copy_slots


class TritonTreeRoute(VllmPatch):
    name = "triton_attention_tree_route"
    target = "vllm.v1.attention.backends.triton_attn:TritonAttentionImpl.forward"
    replaces = ("TritonAttentionImpl.forward, vLLM's Triton attention layer (its "
                "unified_attention call)")
    why = ("draft trees on CUDA: while a forward's tree masks are set (the target's tree "
           "step, an EAGLE head's tree pass) the layer runs vllm-specx's Triton tree kernel "
           "(cuda_tree_attention.tree_forward) instead of unified_attention, which takes no "
           "per-request mask; every other forward calls vLLM's own, unchanged")
    lazy = True

    def wrap(self, original: Any) -> Any:
        signature = inspect.signature(original)

        def forward(self_: Any, *args: Any, **kw: Any) -> Any:
            masks = _active_query_masks()
            if masks is None:
                return original(self_, *args, **kw)
            bound = signature.bind(self_, *args, **kw)
            a = bound.arguments
            metadata = a["attn_metadata"]
            if metadata is None:  # vLLM's profiling run: no cache, nothing to mask
                return original(self_, *args, **kw)
            if a.get("output_scale") is not None or a.get("output_block_scale") is not None:
                raise NotImplementedError("vllm-specx tree attention on CUDA: fused output "
                                          "quantisation is not in the tree kernel")
            query = a["query"]
            _, _, tree_masks, tokens = _twin(masks, query.device)
            if tokens != metadata.num_actual_tokens:
                # As the CPU op: masks set for one forward must never reach another (and
                # requests past the masks' own are then padding without query rows).
                raise RuntimeError(
                    f"vllm-specx: the step's tree masks were built for {tokens} query "
                    f"tokens, but attention ran over {metadata.num_actual_tokens}")
            return tree_forward(self_, query, a["kv_cache"], metadata, a["output"],
                                tree_masks)

        return forward
