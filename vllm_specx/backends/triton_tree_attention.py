"""Tree attention over vLLM's paged KV cache, in Triton (the ``cuda`` backend; issue 34).

One call per layer attends every query row of a ragged batch in which some requests
are draft trees: a tree request's query rows ``[root, node 0, node 1, ...]`` (nodes in
BFS order, each written at KV slot ``context + 1 + i``) see the whole context and,
among the step's own rows, only their ancestors and themselves; every other request
(decodes, chunked prefills, chain verifications) is causal, as in vLLM's own kernel.

Why our own kernel and not vLLM's ``qq_bias``. vLLM 0.32's Triton
``unified_attention`` still takes ``qq_bias``, but it is ONE ``[Q, Q]`` additive bias
for the whole batch: the kernel reads ``qq_bias[query row within its request, key row
within its request]`` with no request index, so every request of a step would get the
same mask. Our trees are per request and ragged (each request its own shape and size),
batches mix tree and causal requests (the bias would also cut a causal request's rows,
and a chunked prefill longer than ``Q`` would read rows past the bias), and
``TritonAttentionImpl.forward`` does not pass a bias at all. A per-request bias cannot
be expressed through that hook, so this module is a small kernel of our own (online
softmax over key tiles read through the block table, like vLLM's, plus one mask lookup
for tree rows) instead of a patched copy of vLLM's 1,200-line kernel.

Layouts (vLLM's Triton backend, read off 0.32): ``key_cache`` / ``value_cache`` are
``[num_blocks, block_size, num_kv_heads, head_size]`` views with any strides (the
backend splits one ``[..., 2 * head_size]`` cache tensor); ``query`` / ``out`` are
``[num_tokens, num_heads, head_size]``. Not handled (config validation refuses tree
configs for such targets first): ALiBi, soft-capping, sliding windows, sinks, and
quantised (fp8/int8/int4) KV caches.

The kernel is decorated lazily (:func:`_kernel`), keyed by ``TRITON_INTERPRET``, as in
:mod:`vllm_specx.backends.triton_verify`, so it also runs on CPU tensors under the
Triton interpreter (tests). Importing this module needs Triton but no GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from vllm_specx.envflags import env_flag

__all__ = ["TreeMasks", "tree_attention", "MAX_TREE_QUERY_ROWS"]

# A tree of at most 64 nodes (draft_tree's limit) plus its root.
MAX_TREE_QUERY_ROWS = 65


@dataclass(frozen=True)
class TreeMasks:
    """The step's tree masks in the kernel's compact form.

    ``first_row`` [reqs] int32: for a tree request, the row of ``rows`` that holds its
    query row 0; -1 for a causal request (nothing stored for it, so a long chunked
    prefill in the batch costs nothing here). ``rows`` [R, W] int8: ``rows[first_row[r]
    + i, j] != 0`` says query row ``i`` of tree request ``r`` sees query row ``j`` of
    ``r`` (only ``j <= i`` is ever read: a row never sees a later row).
    """

    first_row: torch.Tensor
    rows: torch.Tensor

    @classmethod
    def build(cls, q_lens: list[int], trees: dict[int, torch.Tensor],
              device: torch.device | str = "cpu") -> TreeMasks:
        """From request index -> ``[q, q]`` bool mask over that request's query rows
        (root first); requests not in ``trees`` are causal. Checked: a mask's shape is its
        request's, every row sees itself and no later row."""
        first_row = torch.full((len(q_lens),), -1, dtype=torch.int32)
        width = max((q_lens[r] for r in trees), default=1)
        if width > MAX_TREE_QUERY_ROWS:
            raise ValueError(f"a tree request has {width} query rows; at most "
                             f"{MAX_TREE_QUERY_ROWS} (64 nodes and the root)")
        rows = torch.zeros(sum(q_lens[r] for r in trees), width, dtype=torch.int8)
        at = 0
        for r in sorted(trees):
            mask, q = trees[r].to("cpu", torch.bool), q_lens[r]
            if tuple(mask.shape) != (q, q):
                raise ValueError(f"request {r}: mask {tuple(mask.shape)} for {q} query rows")
            lower = torch.ones(q, q, dtype=torch.bool).tril()
            if bool((mask & ~lower).any()) or not bool(mask.diagonal().all()):
                raise ValueError(f"request {r}: a query row must see itself and no later row")
            first_row[r] = at
            rows[at:at + q, :q] = mask.to(torch.int8)
            at += q
        return cls(first_row.to(device), rows.to(device))

    @classmethod
    def from_query_masks(cls, masks, device: torch.device | str = "cpu") -> TreeMasks:
        """From the CPU attention's :class:`~vllm_specx.cpu_ops.attention.QueryMasks`
        (what the V1 tree step builds): requests whose mask is the causal triangle are
        stored as causal."""
        q_lens = [int(q) for q in masks.q_lens]
        trees = {}
        for r, q in enumerate(q_lens):
            mask = masks.allowed[r, :q, :q]
            if not torch.equal(mask, torch.ones(q, q, dtype=torch.bool).tril()):
                trees[r] = mask
        return cls.build(q_lens, trees, device)


def _tree_attention(
    out_ptr,  # [T, H, D] out
    q_ptr,  # [T, H, D]
    k_ptr,  # [blocks, block_size, Hkv, D] (strided)
    v_ptr,  # [blocks, block_size, Hkv, D] (strided)
    block_table_ptr,  # [reqs, max_blocks] int32
    query_start_ptr,  # [reqs + 1] int32
    seq_lens_ptr,  # [reqs] int32: keys per request, its query rows' included
    first_row_ptr,  # [reqs] int32: TreeMasks.first_row
    mask_ptr,  # [R, W] int8: TreeMasks.rows
    scale,
    q_stride_t, q_stride_h,
    o_stride_t, o_stride_h,
    k_stride_b, k_stride_s, k_stride_h, k_stride_d,
    v_stride_b, v_stride_s, v_stride_h, v_stride_d,
    table_stride,
    mask_stride,
    GROUP: tl.constexpr,  # query heads per KV head
    HEAD: tl.constexpr,
    HEAD_PAD: tl.constexpr,  # power of 2 >= HEAD
    BLOCK_SIZE: tl.constexpr,  # KV cache block size
    BLOCK_Q: tl.constexpr,  # query rows per program
    BLOCK_M: tl.constexpr,  # power of 2 >= BLOCK_Q * GROUP (rows x heads of one KV head)
    TILE: tl.constexpr,  # keys per step of the online softmax
    PRECISION: tl.constexpr,  # tl.dot's input_precision: "ieee" for float32, else None
):
    req = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + req)
    q_len = tl.load(query_start_ptr + req + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    context = tl.load(seq_lens_ptr + req) - q_len
    first_row = tl.load(first_row_ptr + req)

    # Row m of the tile is query row q_block * BLOCK_Q + m // GROUP, query head
    # kv_head * GROUP + m % GROUP: the GROUP heads sharing one KV head share its loads.
    offs_m = tl.arange(0, BLOCK_M)
    row = q_block * BLOCK_Q + offs_m // GROUP
    head = kv_head * GROUP + offs_m % GROUP
    row_ok = (offs_m // GROUP < BLOCK_Q) & (row < q_len)
    offs_d = tl.arange(0, HEAD_PAD)
    d_ok = offs_d < HEAD
    token = (q_start + row).to(tl.int64)
    # Per row, not a scalar: the interpreter turns bool-block & bool-scalar into int32.
    tree_row = (row * 0 + first_row) >= 0
    q = tl.load(q_ptr + token[:, None] * q_stride_t + head[:, None] * q_stride_h
                + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], dtype=tl.float32)
    # The block's last row sees keys up to its own slot: no tile past that is read.
    last_row = tl.minimum(q_block * BLOCK_Q + BLOCK_Q, q_len) - 1
    kv_end = context + last_row + 1
    offs_t = tl.arange(0, TILE)
    for j in range(0, tl.cdiv(kv_end, TILE)):
        key = j * TILE + offs_t
        key_ok = key < kv_end
        block = tl.load(block_table_ptr + req * table_stride + key // BLOCK_SIZE,
                        mask=key_ok, other=0).to(tl.int64)
        slot = (key % BLOCK_SIZE).to(tl.int64)
        k = tl.load(k_ptr + block[None, :] * k_stride_b + slot[None, :] * k_stride_s
                    + kv_head * k_stride_h + offs_d[:, None] * k_stride_d,
                    mask=d_ok[:, None] & key_ok[None, :], other=0.0)  # [HEAD_PAD, TILE]
        v = tl.load(v_ptr + block[:, None] * v_stride_b + slot[:, None] * v_stride_s
                    + kv_head * v_stride_h + offs_d[None, :] * v_stride_d,
                    mask=key_ok[:, None] & d_ok[None, :], other=0.0)  # [TILE, HEAD_PAD]
        s = tl.dot(q, k, input_precision=PRECISION) * scale
        # Causal: a row sees the context and the step's rows up to itself ...
        rel = key[None, :] - context  # which of the request's query rows a key is
        seen = row_ok[:, None] & key_ok[None, :] & (rel <= row[:, None])
        # ... and a tree row, among the step's rows, only those its mask allows.
        in_step = seen & (rel >= 0) & tree_row[:, None]
        bit = tl.load(mask_ptr + (first_row + row)[:, None].to(tl.int64) * mask_stride + rel,
                      mask=in_step, other=1)
        seen = seen & (bit != 0)
        s = tl.where(seen, s, float("-inf"))
        # Online softmax; a row that has seen nothing yet keeps m = -inf, so its shift
        # is taken as 0 (exp(-inf) = 0 everywhere) instead of the NaN of -inf - -inf.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        shift = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - shift[:, None])
        alpha = tl.exp(m_i - shift)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    # Every real row sees at least itself (l > 0); padding rows are not stored.
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + token[:, None] * o_stride_t + head[:, None] * o_stride_h
             + offs_d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])


_JIT_CACHE: dict[bool, object] = {}


def interpreter_enabled() -> bool:
    """Whether ``TRITON_INTERPRET`` is set (the kernel then runs on CPU tensors)."""
    return env_flag("TRITON_INTERPRET")


def _kernel():
    interpret = interpreter_enabled()
    kernel = _JIT_CACHE.get(interpret)
    if kernel is None:
        kernel = _JIT_CACHE[interpret] = triton.jit(_tree_attention)
    return kernel


def tree_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    scale: float,
    masks: TreeMasks | None = None,
) -> torch.Tensor:
    """Paged attention over a ragged batch, tree requests masked, written into ``out``.

    Request ``r`` owns query tokens ``query_start_loc[r]:query_start_loc[r + 1]`` and
    ``seq_lens[r]`` keys in its blocks ``block_table[r]`` (its query rows' K/V already in
    the cache, last). ``masks=None``: every request causal. ``max_query_len`` (a host
    int, as vLLM's metadata carries it) sizes the launch grid, so nothing syncs.
    Returns ``out``.
    """
    if query.device.type == "cpu" and not interpreter_enabled():
        raise RuntimeError("the Triton tree attention needs CUDA tensors (or "
                           "TRITON_INTERPRET=1 to run it on CPU in tests)")
    num_tokens, num_heads, head_size = query.shape
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0 or max_query_len == 0:
        return out
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads over {num_kv_heads} KV heads")
    if query.stride(2) != 1 or out.stride(2) != 1:
        raise ValueError("query and out need a contiguous last (head_size) dimension")
    if masks is None:
        masks = TreeMasks(torch.full((num_reqs,), -1, dtype=torch.int32, device=query.device),
                          torch.zeros(1, 1, dtype=torch.int8, device=query.device))
    elif masks.rows.device != query.device:
        masks = TreeMasks(masks.first_row.to(query.device), masks.rows.to(query.device))
    group = num_heads // num_kv_heads
    # One program: BLOCK_Q query rows x the GROUP heads of one KV head. tl.dot wants at
    # least 16 rows; longer requests (prefill chunks) get 64-row tiles.
    block_m = max(16, triton.next_power_of_2(group))
    if max_query_len * group > 16:
        block_m = max(block_m, 64)
    block_q = block_m // group
    grid = (num_reqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _kernel()[grid](
        out, query, key_cache, value_cache, block_table, query_start_loc, seq_lens,
        masks.first_row, masks.rows, float(scale),
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        *key_cache.stride(), *value_cache.stride(),
        block_table.stride(0), masks.rows.stride(0),
        GROUP=group, HEAD=head_size, HEAD_PAD=max(16, triton.next_power_of_2(head_size)),
        BLOCK_SIZE=block_size, BLOCK_Q=block_q, BLOCK_M=block_m, TILE=32,
        # float32 models get float32 products (not TF32), as the CPU reference computes.
        PRECISION="ieee" if query.dtype == torch.float32 else None,
    )
    return out
