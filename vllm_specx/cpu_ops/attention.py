"""Paged attention for vLLM's ``CPU_ATTN`` backend, in PyTorch.

KV cache layout (vLLM 0.32.0 ``CPU_ATTN``): one tensor per layer of shape
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` that the backend views as
``[num_blocks, num_kv_heads, 2 * block_size, head_size]`` and splits along dim 2, so
``key_cache`` and ``value_cache`` are non-contiguous ``[num_blocks, num_kv_heads,
block_size, head_size]`` views. Every write below goes through those views in place.

The attention itself is written for clarity and vectorised over requests: gather each
request's keys/values through its block table into a padded ``[reqs, kv_heads,
max_seq, head]`` tensor, build one boolean mask for every (request, query, key), and
run a masked softmax in float32 (float64 for float64 inputs). A batch of one request
without ALiBi, softcap, sinks or a key-cutting window (decoding and verification at
batch 1) takes a shorter path with the same maths: its op count per layer is what a
small model's step pays in Python and dispatch, not in arithmetic.

Draft trees (issue 37) need one more rule: a tree request's query rows attend to the
whole context but, among the step's own query rows, only to their ancestors. The op's
signature is vLLM's, so that rule reaches it through an explicit per-step side channel,
:func:`query_masks`: the V1 runner hook (``glue/tree_step.py``) sets the step's
:class:`QueryMasks` around the target's forward only and clears it after. Without one
set, every request is causal as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import cached_property

import torch

# Matrix products get at least this many rows (zero-padded): torch's CPU kernels (MKL,
# oneDNN) pick another summation order below 4 rows, so a query row's result would depend
# on how many rows share the call -- and greedy speculative decoding, which verifies K + 1
# rows where plain decoding runs one, would drift from plain decoding in bfloat16.
MIN_MATMUL_ROWS = 4

# ISA hints vLLM's CPU backend may pass; the reference computes the same thing for all.
KNOWN_ISA_HINTS = frozenset({"amx", "amx_fp8", "vec", "vec16", "neon", "vxe", "rvv", "vsx"})


@dataclass(frozen=True)
class QueryMasks:
    """Which of its own request's query rows each query row may attend to, for one
    forward pass (the keys before a request's first query row are all visible).

    ``q_lens`` [reqs] int64: the query rows per request the masks were built for (the
    op refuses a batch of another shape: a mask set for the target's forward must never
    reach another forward). ``allowed`` [reqs, max_q, max_q] bool: ``allowed[r, i, j]``
    says whether query row ``i`` of request ``r`` sees query row ``j`` of ``r``; a row
    must see itself and nothing after it (``j <= i``), so a causal request is the lower
    triangle and a tree request is its ancestor mask (root first, nodes in BFS order).
    """

    q_lens: torch.Tensor
    allowed: torch.Tensor

    @classmethod
    def causal_except(cls, q_lens: list[int], trees: dict[int, torch.Tensor]) -> QueryMasks:
        """Causal rows for every request but those of ``trees`` (request index ->
        ``[q, q]`` mask over its query rows)."""
        max_q = max(q_lens) if q_lens else 0
        allowed = torch.ones(max_q, max_q, dtype=torch.bool).tril()
        allowed = allowed.unsqueeze(0).repeat(len(q_lens), 1, 1)
        for r, mask in trees.items():
            q = q_lens[r]
            if tuple(mask.shape) != (q, q):
                raise ValueError(f"request {r}: mask {tuple(mask.shape)} for {q} query rows")
            if bool((mask & ~torch.ones(q, q, dtype=torch.bool).tril()).any()) or not bool(
                    mask.diagonal().all()):
                raise ValueError(f"request {r}: a query row must see itself and no later row")
            allowed[r, :q, :q] = mask.to(torch.bool)
        return cls(torch.tensor(q_lens, dtype=torch.int64), allowed)

    @cached_property
    def tree_rows(self) -> dict[int, _TreeRows]:
        """Per request whose mask is not the causal one, its rows' plan for
        :func:`_tree_rows_as_decoding`. Built once per forward (every layer's call reads
        it), not once per layer."""
        out: dict[int, _TreeRows] = {}
        for r, q in enumerate(self.q_lens.tolist()):
            mask = self.allowed[r, :q, :q]
            if not torch.equal(mask, torch.ones(q, q, dtype=torch.bool).tril()):
                out[r] = _TreeRows.of(mask)
        return out


@dataclass
class _TreeRows:
    """A tree request's query rows grouped by how many query rows each sees (its depth
    + 1): ``order`` [n] the rows, group after group; ``groups`` ``(start, end, c)``
    slices of ``order``; ``seen`` per group ``[end - start, c]`` the query rows each
    row sees, in slot order. The key slots per context length are cached (one forward
    calls every layer with the same context)."""

    order: torch.Tensor
    in_order: bool  # order is 0..n-1 (BFS trees): rows are written back as one slice
    groups: list[tuple[int, int, int]]
    seen: list[torch.Tensor]
    _slots: dict[tuple[int, int], torch.Tensor]

    @classmethod
    def of(cls, mask: torch.Tensor) -> _TreeRows:
        counts = mask.sum(dim=1)
        order = torch.argsort(counts, stable=True)
        groups, seen, start = [], [], 0
        for c in torch.unique(counts).tolist():
            rows = order[start:start + int((counts == c).sum())]
            # nonzero walks row-major: each row's c seen rows, ascending.
            seen.append(torch.nonzero(mask[rows])[:, 1].view(rows.shape[0], c))
            groups.append((start, start + rows.shape[0], c))
            start += rows.shape[0]
        in_order = torch.equal(order, torch.arange(order.shape[0]))
        return cls(order, in_order, groups, seen, {})

    def key_slots(self, s: int, ctx: int, num_kv_heads: int) -> torch.Tensor:
        """Every row's keys in its chain's order (context, then the query rows it sees),
        as rows of the request's ``[kv_heads * s, head]`` keys, group after group, each
        group ``[kv_heads, rows, L]`` (contiguous per group: its products need no copy)."""
        got = self._slots.get((s, num_kv_heads))
        if got is None:
            heads = s * torch.arange(num_kv_heads)[:, None]
            got = torch.cat([
                (torch.cat((torch.arange(ctx).expand(seen.shape[0], ctx), ctx + seen),
                           dim=1).flatten()[None, :] + heads).flatten()
                for seen in self.seen])
            self._slots[(s, num_kv_heads)] = got
        return got


# The masks of the forward pass running now (None: every request causal). Set only
# through query_masks(); one engine core drives one forward at a time per process.
_ACTIVE_MASKS: QueryMasks | None = None


@contextmanager
def query_masks(masks: QueryMasks | None) -> Iterator[None]:
    """Apply ``masks`` to every attention call inside the block, then clear them (also on
    an exception). ``None`` is a no-op block, so a caller need not branch."""
    global _ACTIVE_MASKS
    if masks is None:
        yield
        return
    if _ACTIVE_MASKS is not None:
        raise RuntimeError("vllm-specx: query masks are already set for another forward")
    _ACTIVE_MASKS = masks
    try:
        yield
    finally:
        _ACTIVE_MASKS = None


def active_query_masks() -> QueryMasks | None:
    """The masks set for the forward running now, if any (tests, debugging)."""
    return _ACTIVE_MASKS


def _masks_for(batch: _Batch) -> QueryMasks | None:
    masks = _ACTIVE_MASKS
    if masks is None:
        return None
    if masks.q_lens.shape[0] != batch.num_reqs or not torch.equal(masks.q_lens, batch.q_lens):
        raise RuntimeError(
            "vllm-specx: the step's tree query masks were built for query lengths "
            f"{masks.q_lens.tolist()}, but attention ran over {batch.q_lens.tolist()}"
        )
    if not bool(batch.req_causal.all()):
        raise RuntimeError("vllm-specx: tree query masks on a non-causal attention call")
    return masks


def _check_isa(isa: str) -> None:
    if isa not in KNOWN_ISA_HINTS:
        # The compiled op rejects unknown hints too; a new hint means vLLM changed.
        raise ValueError(f"Unsupported CPU attention ISA hint: {isa!r}")


def _check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype != "auto":
        raise NotImplementedError(
            "vllm-specx CPU reference attention supports kv_cache_dtype='auto' only, "
            f"got {kv_cache_dtype!r} (FP8 KV caches need vLLM's compiled CPU build)"
        )


def cpu_attn_has_isa(isa: str) -> bool:
    """Whether a specialised ISA path exists. vLLM asks for "rvv" and "amx_fp8" only
    to pick optional specialised kernels; the reference has none, so always False."""
    return False


def get_scheduler_metadata(
    num_req: int,
    num_heads_q: int,
    num_heads_kv: int,
    head_dim: int,
    seq_lens: torch.Tensor,
    dtype: torch.dtype,
    query_start_loc: torch.Tensor,
    casual: bool,
    window_size: int,
    isa_hint: str,
    enable_kv_split: bool,
    dynamic_causal: torch.Tensor | None,
    kv_cache_dtype: str = "auto",
) -> torch.Tensor:
    """The compiled op plans thread work items; the reference needs no plan.

    Returns a tiny placeholder tensor (the attention op ignores it) after validating
    the arguments the same way the compiled op would.
    """
    _check_isa(isa_hint)
    _check_kv_cache_dtype(kv_cache_dtype)
    if num_heads_q % num_heads_kv != 0:
        raise ValueError(f"num_heads_q={num_heads_q} not a multiple of {num_heads_kv=}")
    return torch.zeros(1, dtype=torch.int8)


def cpu_attn_reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    isa: str,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_cache_dtype: str = "auto",
) -> None:
    """Write ``key``/``value`` ``[tokens, kv_heads, head]`` into the paged caches.

    Token ``t`` goes to block ``slot // block_size`` at offset ``slot % block_size``;
    negative slots (vLLM's padding slot id -1) are skipped.
    """
    _check_isa(isa)
    _check_kv_cache_dtype(kv_cache_dtype)
    if key.dim() != 3 or value.dim() != 3 or key_cache.dim() != 4:
        raise ValueError("expected key/value [tokens, heads, head] and 4-D caches")
    num_tokens = key.shape[0]
    slots = slot_mapping[:num_tokens].to(torch.int64)
    valid = slots >= 0
    if not bool(valid.all()):
        keep = valid.nonzero().squeeze(1)
        slots = slots[keep]
        key = key[keep]
        value = value[keep]
    block_size = key_cache.shape[2]
    blocks = slots // block_size
    offsets = slots % block_size
    # Advanced indices on dims 0 and 2 with a slice between: the indexed result is
    # [tokens, kv_heads, head], which is exactly key's layout.
    key_cache[blocks, :, offsets] = key.to(key_cache.dtype)
    value_cache[blocks, :, offsets] = value.to(value_cache.dtype)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def cpu_attention_with_kv_cache(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    output: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    causal: bool,
    alibi_slopes: torch.Tensor | None,
    sliding_window_size: int,
    block_table: torch.Tensor,
    softcap: float,
    scheduler_metadata: torch.Tensor,
    s_aux: torch.Tensor | None,
    dynamic_causal: torch.Tensor | None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    kv_cache_dtype: str = "auto",
) -> None:
    """Paged attention over a ragged batch, written into ``output`` in place.

    Request ``r`` owns query rows ``query_start_loc[r]:query_start_loc[r+1]`` and
    ``seq_lens[r]`` cached tokens (its new tokens are already in the cache). Query row
    ``i`` of a request with ``q_len`` rows sits at position ``seq_len - q_len + i`` when
    the request is causal, and at ``i`` otherwise (encoder attention), mirroring the
    compiled kernel. Masking, per (query position p, key position k):

    * causal: ``k <= p``;
    * sliding window ``W > 0`` (vLLM's convention, the same as ``window_left = W - 1``
      in its other backends): ``p - k < W``, and also ``k - p < W`` when not causal;
    * ``dynamic_causal[r] != 0`` makes request ``r`` causal (``causal`` is then False).

    Scores: ``scale * q.k``, then ``softcap * tanh(s / softcap)`` when ``softcap > 0``,
    then ``+ alibi_slopes[h] * (k - p)``. ``s_aux[h]`` (attention sinks) is an extra
    logit per head that joins the softmax normaliser but carries no value.
    """
    _check_kv_cache_dtype(kv_cache_dtype)
    if query.dim() != 3:
        raise ValueError(f"query must be [tokens, heads, head], got {tuple(query.shape)}")
    num_tokens, num_heads, head_size = query.shape
    if num_tokens == 0:
        return
    out = output.view(num_tokens, num_heads, head_size)  # must alias: written in place
    batch = _Batch.of(query_start_loc, seq_lens, causal, dynamic_causal)
    if batch.max_q == 0:
        return
    masks = _masks_for(batch)
    window = int(sliding_window_size) if sliding_window_size and sliding_window_size > 0 else 0
    if masks is not None and window > 0:
        # A tree node's position is ctx + depth, not its key slot: a window over slots
        # would cut the wrong keys (tree configs are refused for such targets first).
        raise NotImplementedError("vllm-specx: tree query masks with a sliding window")
    plain = alibi_slopes is None and softcap <= 0 and s_aux is None
    tree_rows = masks.tree_rows if masks is not None and plain else {}
    if batch.num_reqs == 1 and plain and (window == 0 or window >= batch.max_s):
        if tree_rows:
            _tree_rows_as_decoding(query, key_cache, value_cache, out, batch, scale,
                                   block_table, 0, tree_rows[0])
        else:
            _attend_one_request(query, key_cache, value_cache, out, batch, scale,
                                block_table)
        return
    if len(tree_rows) < batch.num_reqs:  # (every request a tree: nothing else to attend)
        _attend_padded(query, key_cache, value_cache, out, batch, scale, block_table,
                       window, softcap, alibi_slopes, s_aux, masks)
    # A tree request's rows again, each computed as plain decoding computes it (see
    # _tree_rows_as_decoding); the padded pass's rows for it are within 1e-5 of these.
    for r, plan in tree_rows.items():
        _tree_rows_as_decoding(query, key_cache, value_cache, out, batch, scale,
                               block_table, r, plan)


class _Batch:
    """A ragged batch's shape: per request its query rows and cached length."""

    def __init__(self, qsl: torch.Tensor, q_lens: torch.Tensor, s_lens: torch.Tensor,
                 req_causal: torch.Tensor) -> None:
        self.qsl, self.q_lens, self.s_lens, self.req_causal = qsl, q_lens, s_lens, req_causal
        self.num_reqs = q_lens.shape[0]
        self.max_q = int(q_lens.max())
        self.max_s = int(s_lens.max())

    @classmethod
    def of(cls, query_start_loc: torch.Tensor, seq_lens: torch.Tensor, causal: bool,
           dynamic_causal: torch.Tensor | None) -> _Batch:
        qsl = query_start_loc.to(torch.int64)
        num_reqs = qsl.shape[0] - 1
        req_causal = torch.full((num_reqs,), bool(causal))
        if dynamic_causal is not None:
            req_causal = req_causal | (dynamic_causal[:num_reqs] != 0)
        return cls(qsl, qsl[1:] - qsl[:-1], seq_lens[:num_reqs].to(torch.int64), req_causal)


def _attend_one_request(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    batch: _Batch,
    scale: float,
    block_table: torch.Tensor,
) -> None:
    """One request without ALiBi, softcap, sinks or a window that cuts its keys: the
    common decoding/verification step at batch 1, in a few ops (no padding, no per-row
    masks beyond the causal one). Same maths as :func:`_attend_padded`."""
    _, num_kv_heads, block_size, head_size = key_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    n, s = int(batch.q_lens[0]), batch.max_s
    first = int(batch.qsl[0])
    cdt = _compute_dtype(query.dtype)
    rows = max(n, MIN_MATMUL_ROWS)
    # [n, kv_heads, group, head] -> [kv_heads, group, rows, head], zero rows past n
    q = query[first:first + n].view(n, num_kv_heads, group, head_size).permute(1, 2, 0, 3)
    q = q.to(cdt)
    if rows > n:
        q = torch.cat((q, q.new_zeros(num_kv_heads, group, rows - n, head_size)), dim=2)
    n_blk = (s + block_size - 1) // block_size
    blocks = block_table[:1, :n_blk].to(torch.int64)

    def gather(cache: torch.Tensor) -> torch.Tensor:
        # [1, kv_heads, s, head] -> [kv_heads, 1, s, head]
        return _gather_blocks(cache, blocks, s, cdt).transpose(0, 1)

    scores = torch.matmul(q, gather(key_cache).transpose(-1, -2)) * scale
    if n > 1 and bool(batch.req_causal[0]):
        # Query row i sits at position s - n + i and sees keys 0..s - n + i (padding
        # rows see all: they are dropped below).
        allowed = torch.ones(rows, s, dtype=torch.bool).tril(diagonal=s - n)
        allowed[n:] = True
        scores = scores.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
    else:
        probs = torch.softmax(scores, dim=-1)
    ctx = torch.matmul(probs, gather(value_cache))[:, :, :n]
    out[first:first + n] = ctx.permute(2, 0, 1, 3).reshape(n, num_heads, head_size).to(out.dtype)


def _tree_rows_as_decoding(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    batch: _Batch,
    scale: float,
    block_table: torch.Tensor,
    r: int,
    plan: _TreeRows,
) -> None:
    """Request ``r``'s tree rows, each bit for bit what plain decoding computes at that
    node's position (one query token over the context and the node's root-to-node path,
    :func:`_attend_one_request` with ``n = 1``).

    Why not the masked product over all the request's keys: CPU matrix kernels (MKL,
    oneDNN) choose their summation blocking from the product's shape, so masked
    siblings' zero weights between a node's ancestors -- or only trailing zeros past
    them -- change the last bit of ``probs @ V`` (AVX2 kernels at any length, AVX-512
    ones from ~500 keys), and a last-bit change flips near-ties of a greedy argmax.
    So each node gets its own keys and values gathered in its chain's order (context,
    then its ancestors and itself) and exactly plain decoding's shapes: ``[4, D] @ [D,
    L]`` for the scores (the query in row 0 of MIN_MATMUL_ROWS, the rest zero), a
    softmax over exactly its ``L`` keys, and ``[4, L] @ [L, D]`` for the values. Nodes
    of one depth have the same ``L`` and share one batched call; the gathers of all rows'
    keys and values are one indexing each.
    """
    _, num_kv_heads, block_size, head_size = key_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    n, s = int(batch.q_lens[r]), int(batch.s_lens[r])
    first, ctx = int(batch.qsl[r]), s - n
    cdt = _compute_dtype(query.dtype)
    n_blk = (s + block_size - 1) // block_size
    blocks = block_table[r:r + 1, :n_blk].to(torch.int64)
    # Every row's keys and values at once (rows of [kv_heads * s, head]): the request's
    # keys converted once (as plain decoding gathers them), then copied row by row.
    pos = plan.key_slots(s, ctx, num_kv_heads)
    keys = _gather_blocks(key_cache, blocks, s, cdt)[0].reshape(-1, head_size)
    keys = keys.index_select(0, pos)
    values = _gather_blocks(value_cache, blocks, s, cdt)[0].reshape(-1, head_size)
    values = values.index_select(0, pos)
    q = query[first:first + n]
    if not plan.in_order:
        q = q[plan.order]
    # [n, kv_heads, group, head] -> [kv_heads, n, m, head]: a kv head's query heads as the
    # rows of one product, zero rows up to MIN_MATMUL_ROWS (probed: the same bits as the
    # one-token decode's [group, MIN_MATMUL_ROWS] layout, without its broadcast copies).
    m = max(group, MIN_MATMUL_ROWS)
    q = q.view(n, num_kv_heads, group, head_size).transpose(0, 1).to(cdt)
    if m > group:
        q = torch.cat((q, q.new_zeros(num_kv_heads, n, m - group, head_size)), dim=2)
    parts, at = [], 0
    for start, end, c in plan.groups:
        nd, length = end - start, ctx + c
        size = num_kv_heads * nd * length
        k = keys[at:at + size].view(num_kv_heads, nd, length, head_size)
        v = values[at:at + size].view(num_kv_heads, nd, length, head_size)
        at += size
        probs = torch.softmax(torch.matmul(q[:, start:end], k.transpose(-1, -2)) * scale,
                              dim=-1)
        parts.append(torch.matmul(probs, v)[:, :, :group])  # [kv_heads, nd, group, head]
    rows = torch.cat(parts, dim=1).permute(1, 0, 2, 3).reshape(n, num_heads, head_size)
    if plan.in_order:
        out[first:first + n] = rows.to(out.dtype)
    else:
        out[first + plan.order] = rows.to(out.dtype)


def _attend_padded(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    batch: _Batch,
    scale: float,
    block_table: torch.Tensor,
    window: int,
    softcap: float,
    alibi_slopes: torch.Tensor | None,
    s_aux: torch.Tensor | None,
    masks: QueryMasks | None = None,
) -> None:
    """Any batch: pad queries and keys to the longest request, mask, softmax, scatter."""
    num_kv_heads = key_cache.shape[1]
    cdt = _compute_dtype(query.dtype)
    group = query.shape[1] // num_kv_heads
    # The products below have group * rows rows per (request, kv head).
    rows = max(batch.max_q, -(-MIN_MATMUL_ROWS // group))
    q_pad, req_of_token, row_of_token = _padded_queries(query, batch, num_kv_heads, cdt, rows)
    k_all, v_all = _gathered_kv(key_cache, value_cache, batch, block_table, cdt)
    # scores: [reqs, kv_heads, group, max_q, max_s]
    scores = torch.einsum("rqhgd,rhsd->rhgqs", q_pad, k_all) * scale
    if softcap > 0:
        scores = softcap * torch.tanh(scores / softcap)
    allowed, dist = _allowed_keys(batch, window, rows, masks)
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(cdt).view(num_kv_heads, group)
        scores = scores + slopes[None, :, :, None, None] * (-dist.to(cdt))[:, None, None]
    scores = scores.masked_fill(~allowed[:, None, None], float("-inf"))
    if masks is not None:
        probs = _softmax_keys_first(
            scores, allowed[:, None, None],
            lambda x, dim: _softmax_with_sinks(x, s_aux, num_kv_heads, cdt))
    else:
        probs = _softmax_with_sinks(scores, s_aux, num_kv_heads, cdt)
    # Padding rows (and any row with nothing to attend to) would be 0/0: zero them
    # explicitly rather than nan_to_num, which would also hide real NaNs.
    probs = torch.where(allowed.any(dim=-1)[:, None, None, :, None], probs, 0.0)
    ctx = torch.einsum("rhgqs,rhsd->rqhgd", probs, v_all)
    num_heads, head_size = query.shape[1], query.shape[2]
    ctx = ctx.reshape(batch.num_reqs, rows, num_heads, head_size)
    out[: req_of_token.shape[0]] = ctx[req_of_token, row_of_token].to(out.dtype)


def _padded_queries(
    query: torch.Tensor, batch: _Batch, num_kv_heads: int, cdt: torch.dtype, rows: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Queries padded to ``[reqs, rows, kv_heads, group, head]`` (``rows >= max_q``),
    and which request and row each query token is."""
    _, num_heads, head_size = query.shape
    req_of_token = torch.repeat_interleave(torch.arange(batch.num_reqs), batch.q_lens)
    n_q = req_of_token.shape[0]
    row_of_token = torch.arange(n_q) - batch.qsl[:-1][req_of_token]
    q_pad = query.new_zeros((batch.num_reqs, rows, num_heads, head_size), dtype=cdt)
    q_pad[req_of_token, row_of_token] = query[:n_q].to(cdt)
    group = num_heads // num_kv_heads
    q_pad = q_pad.view(batch.num_reqs, rows, num_kv_heads, group, head_size)
    return q_pad, req_of_token, row_of_token


def _gathered_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, batch: _Batch,
    block_table: torch.Tensor, cdt: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each request's keys/values through its block table, as ``[reqs, kv_heads, max_s,
    head]``, zero past each request's length."""
    num_blocks, _, block_size, _ = key_cache.shape
    num_reqs, max_s = batch.num_reqs, batch.max_s
    n_blk = (max_s + block_size - 1) // block_size
    blk_ids = block_table[:num_reqs, :n_blk].to(torch.int64).clamp(0, num_blocks - 1)
    # Slots past a request's length hold whatever an earlier request left (or block 0
    # for unused table entries); zero them so 0-weight * stale-NaN cannot leak in.
    key_valid = torch.arange(max_s)[None, :] < batch.s_lens[:, None]  # [reqs, max_s]
    k_all = _gather_blocks(key_cache, blk_ids, max_s, cdt)
    v_all = _gather_blocks(value_cache, blk_ids, max_s, cdt)
    return (k_all.masked_fill(~key_valid[:, None, :, None], 0.0),
            v_all.masked_fill(~key_valid[:, None, :, None], 0.0))


def _gather_blocks(
    cache: torch.Tensor, blk_ids: torch.Tensor, length: int, cdt: torch.dtype
) -> torch.Tensor:
    """The first ``length`` slots of each request's blocks ``blk_ids`` ``[reqs, n_blk]``
    from a ``[blocks, kv_heads, block, head]`` cache, as ``[reqs, kv_heads, length, head]``."""
    num_reqs, n_blk = blk_ids.shape
    _, num_kv_heads, block_size, head_size = cache.shape
    g = cache[blk_ids]  # [reqs, n_blk, kv_heads, block, head]
    g = g.permute(0, 2, 1, 3, 4).reshape(num_reqs, num_kv_heads, n_blk * block_size, head_size)
    return g[:, :, :length].to(cdt)


def _allowed_keys(
    batch: _Batch, window: int, num_rows: int, masks: QueryMasks | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Which key each (request, query row) may see, ``[reqs, num_rows, max_s]`` (rows
    past a request's queries see nothing), and the distance ``p - k`` between query
    position and key position. With ``masks``, a key among the request's own query rows
    is seen only where its mask allows."""
    q_lens, s_lens, req_causal = batch.q_lens, batch.s_lens, batch.req_causal
    rows = torch.arange(num_rows)
    keys = torch.arange(batch.max_s)
    # Query position per (request, row): [reqs, max_q].
    q_pos = torch.where(
        req_causal[:, None], (s_lens - q_lens)[:, None] + rows[None, :], rows[None, :]
    )
    dist = q_pos[:, :, None] - keys[None, None, :]  # p - k: [reqs, max_q, max_s]
    allowed = (keys[None, None, :] < s_lens[:, None, None]) & (
        rows[None, :, None] < q_lens[:, None, None]
    )
    allowed &= ~req_causal[:, None, None] | (dist >= 0)
    if window > 0:
        allowed &= dist < window
        allowed &= req_causal[:, None, None] | (-dist < window)
    if masks is not None:
        first_q = (s_lens - q_lens)[:, None, None]  # key slot of each request's row 0
        j = keys[None, None, :] - first_q  # which query row a key is: [reqs, 1, max_s]
        max_q = masks.allowed.shape[1]
        table = torch.zeros(batch.num_reqs, num_rows, max_q, dtype=torch.bool)
        n = min(num_rows, max_q)
        table[:, :n] = masks.allowed[:, :n]
        seen = table.gather(2, j.clamp(0, max_q - 1).expand(-1, num_rows, -1))
        allowed &= (j < 0) | seen
    return allowed, dist


def _softmax_keys_first(
    scores: torch.Tensor, allowed: torch.Tensor,
    softmax: Callable[..., torch.Tensor],
) -> torch.Tensor:
    """``softmax(scores, dim=-1)`` with each row's seen keys moved to the front first (in
    their slot order) and the result moved back: under a tree mask a node's keys are the
    context, the root and its ancestors, with masked siblings between them, and the
    vectorised max/sum of a softmax groups elements by their index, so the same keys at
    other indices would be summed in another order. Compacted, a node's row is reduced
    exactly as the row of plain decoding at its position (keys ``0 .. p``, nothing masked
    in between). The padded path's tree rows are then within 1e-5 of plain decoding;
    the product with V still sums the masked keys' zero weights with a blocking that
    depends on the shape, so rows that must be bit for bit plain decoding are computed
    again by :func:`_tree_rows_as_decoding` (all tree rows without ALiBi, softcap or
    sinks; this keys-first softmax is what the rest keep). ``allowed``
    broadcasts against ``scores``; ancestors precede their children in slot order (BFS),
    so the seen keys keep the chain's order."""
    hidden = (~allowed).to(torch.int8).expand(scores.shape)
    order = torch.argsort(hidden, dim=-1, stable=True)
    compact = softmax(torch.gather(scores, -1, order), dim=-1)
    return torch.empty_like(compact).scatter_(-1, order, compact)


def _softmax_with_sinks(
    scores: torch.Tensor, s_aux: torch.Tensor | None, num_kv_heads: int, cdt: torch.dtype
) -> torch.Tensor:
    """Softmax over keys; ``s_aux[h]`` (attention sinks) joins the normaliser only."""
    if s_aux is None:
        return torch.softmax(scores, dim=-1)
    group = scores.shape[2]
    sink = s_aux.to(cdt).view(1, num_kv_heads, group, 1, 1)
    row_max = torch.maximum(scores.amax(dim=-1, keepdim=True), sink)
    weights = torch.exp(scores - row_max)
    denom = weights.sum(dim=-1, keepdim=True) + torch.exp(sink - row_max)
    return weights / denom


def cpu_attn_copy_slots(kv_cache: torch.Tensor, src_slots: torch.Tensor,
                        dst_slots: torch.Tensor) -> None:
    """Copy the K and V of slots ``src_slots[i]`` to ``dst_slots[i]`` in one layer's
    ``CPU_ATTN`` cache ``[num_blocks, kv_heads, block_size, 2 * head_size]`` (the layout
    in the module docstring), in place.

    Draft trees (issue 37): a verified tree's accepted path was written at the slots of
    its nodes' flat indices; the next step reads the path from the contiguous slots after
    the root, so the path's entries are moved there. Every source is read before any
    destination is written, so overlapping moves (a node already in place, a destination
    that is another move's source) are safe.
    """
    if src_slots.numel() == 0:
        return
    if kv_cache.dim() != 4 or kv_cache.shape[-1] % 2:
        raise ValueError(f"expected a CPU_ATTN KV cache, got shape {tuple(kv_cache.shape)}")
    num_blocks, num_kv_heads, block_size, two_head = kv_cache.shape
    halves = kv_cache.view(num_blocks, num_kv_heads, 2 * block_size, two_head // 2)
    src = src_slots.to(torch.int64)
    dst = dst_slots.to(torch.int64)
    for cache in halves.chunk(2, dim=2):  # key_cache, value_cache
        moved = cache[src // block_size, :, src % block_size]  # a copy: [n, heads, head]
        cache[dst // block_size, :, dst % block_size] = moved
