"""MLA decode attention for vLLM's ``CPU_MLA`` backend, in PyTorch.

vLLM 0.32's ``CPU_MLA`` backend (``vllm/v1/attention/backends/mla/cpu_mla.py``) writes
the latent KV cache itself and runs prefill through SDPA; only the weight-absorbed
decode step (one query token per request, MQA over the latent cache) is a compiled op,
``torch.ops._C.mla_decode_kvcache``. Layout, as the backend calls it:

* ``query``: ``[num_reqs, num_heads, kv_lora_rank + rope]`` (576 = 512 + 64 in every
  DeepSeek model; the backend accepts no other size);
* ``kv_cache``: ``[num_blocks, block_size, kv_lora_rank + rope]`` (block size 16; any
  extra singleton head dim is flattened away), one latent row per token: the first
  ``kv_lora_rank`` entries are the compressed KV (keys AND values), the rest the
  rotary part of the key;
* ``out``: ``[num_reqs, num_heads, kv_lora_rank]``, written in place: the softmax of
  ``scale * query . key`` over the request's ``seq_lens[r]`` cached tokens, applied to
  the values (the key's first ``kv_lora_rank`` entries).

The value width is ``out.shape[-1]``, so the op does not hard-code 512.
"""

from __future__ import annotations

import torch


def mla_decode_kvcache(
    out: torch.Tensor,
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    """Latent-cache decode attention, vectorised over requests (see module doc)."""
    if query.dim() != 3 or out.dim() != 3:
        raise ValueError(
            f"query and out must be [reqs, heads, dim], got {tuple(query.shape)} and "
            f"{tuple(out.shape)}"
        )
    num_reqs, num_heads, head_dim = query.shape
    if num_reqs == 0:
        return
    value_dim = out.shape[-1]
    if value_dim > head_dim:
        raise ValueError(f"out's last dim {value_dim} exceeds the query's {head_dim}")
    num_blocks, block_size = kv_cache.shape[0], kv_cache.shape[1]
    cache = kv_cache.reshape(num_blocks, block_size, -1)
    if cache.shape[-1] != head_dim:
        raise ValueError(f"kv_cache rows are {cache.shape[-1]} wide, query is {head_dim}")
    compute = torch.float64 if query.dtype == torch.float64 else torch.float32

    lens = seq_lens[:num_reqs].to(torch.int64)
    max_len = int(lens.max())
    if max_len == 0:
        out.zero_()
        return
    n_blk = (max_len + block_size - 1) // block_size
    blk_ids = block_tables[:num_reqs, :n_blk].to(torch.int64).clamp(0, num_blocks - 1)
    # [reqs, n_blk, block, dim] -> [reqs, max_len, dim]
    keys = cache[blk_ids].reshape(num_reqs, n_blk * block_size, head_dim)[:, :max_len]
    valid = torch.arange(max_len)[None, :] < lens[:, None]  # [reqs, max_len]
    # Rows past a request's length may hold another request's data or NaN: zero them
    # so a 0 attention weight cannot meet a NaN.
    keys = keys.to(compute).masked_fill(~valid[:, :, None], 0.0)

    scores = torch.einsum("rhd,rsd->rhs", query.to(compute), keys) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    probs = torch.where(valid.any(dim=-1)[:, None, None], probs, 0.0)  # empty requests
    ctx = torch.einsum("rhs,rsd->rhd", probs, keys[:, :, :value_dim])
    out.copy_(ctx.to(out.dtype))
