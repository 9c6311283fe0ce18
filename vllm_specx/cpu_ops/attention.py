"""Paged attention for vLLM's ``CPU_ATTN`` backend, in PyTorch.

KV cache layout (vLLM 0.32.0 ``CPU_ATTN``): one tensor per layer of shape
``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` that the backend views as
``[num_blocks, num_kv_heads, 2 * block_size, head_size]`` and splits along dim 2, so
``key_cache`` and ``value_cache`` are non-contiguous ``[num_blocks, num_kv_heads,
block_size, head_size]`` views. Every write below goes through those views in place.

Attention without ALiBi, softcap, sinks or a key-cutting window (every model this
project runs) is batch-invariant (:func:`_attend_rows_alone`): each decode, chain
verification or tree row is computed with exactly the product shapes of a lone one-token
decode at its position, over its own keys in key tiles, so its bits do not depend on the
other requests of the batch -- greedy speculation and batching stay exactly lossless.
The other calls take a path written for clarity and vectorised over requests: gather
each request's keys/values into a padded ``[reqs, kv_heads, max_seq, head]`` tensor,
build one boolean mask for every (request, query, key), and run a masked softmax in
float32 (float64 for float64 inputs); its rows depend on the batch in the last bit.

Draft trees (issue 37) need one more rule: a tree request's query rows attend to the
whole context but, among the step's own query rows, only to their ancestors. The op's
signature is vLLM's, so that rule reaches it through an explicit per-step side channel,
:func:`query_masks`: the V1 runner hook (``glue/tree_step.py``) sets the step's
:class:`QueryMasks` around the target's forward only and clears it after. Without one
set, every request is causal as before.
"""

from __future__ import annotations

import functools
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
# Batch-invariant attention (see _attend_rows_alone): keys in tiles of KEY_TILE, products
# of at most MAX_UNIT_M rows (a unit's query rows x a kv head's query heads), and at most
# MAX_CALL_TILES key tiles gathered per batched call (memory: long prefills are split).
KEY_TILE = 32
MAX_UNIT_M = 64
# Where rows may not share a product (rows_share_products: AVX2 kernels), requests of at
# most this many query rows (decoding, chain verification, short prefill chunks) get
# every row computed alone, as a one-token decode (see _plan_rows).
ROWS_ALONE = 16
MAX_CALL_TILES = 256

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
    def tree_rows(self) -> dict[int, list[torch.Tensor]]:
        """Per request whose mask is not the causal one, per query row the query rows it
        sees (ascending: for a BFS tree, the root, its ancestors and itself -- the chain
        ending at that node). Built once per forward, not once per layer."""
        out: dict[int, list[torch.Tensor]] = {}
        for r, q in enumerate(self.q_lens.tolist()):
            mask = self.allowed[r, :q, :q]
            if not torch.equal(mask, torch.ones(q, q, dtype=torch.bool).tril()):
                out[r] = [torch.nonzero(row).flatten() for row in mask]
        return out


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
    if plain and (window == 0 or window >= batch.max_s):
        # Every row -- decode, chain verification, tree node, prefill -- computed alone.
        _attend_rows_alone(query, key_cache, value_cache, out, batch, scale, block_table,
                           masks)
        return
    _attend_padded(query, key_cache, value_cache, out, batch, scale, block_table,
                   window, softcap, alibi_slopes, s_aux, masks)


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


@dataclass
class _Call:
    """One batched call of :func:`_attend_units` over U units of R rows and P keys
    (a multiple of KEY_TILE): ``tok`` [U, R] each unit row's query token (-1: none);
    ``rows`` [U * kv_heads * P] each key's row in a cache viewed as ``[rows, head]``
    (see :func:`_cache_rows`); ``hidden`` [U, M, P] the keys each product row does not
    see (M = R * group, zero rows up to MIN_MATMUL_ROWS); ``pad`` the padding keys'
    rows among the gathered ``[U * kv_heads * P]`` (their slots hold whatever another
    request left, maybe NaN), or None."""

    tok: torch.Tensor
    rows: torch.Tensor
    hidden: torch.Tensor
    pad: torch.Tensor | None


@dataclass
class _RowsPlan:
    calls: list[_Call]


def _plan_rows(batch: _Batch, block_table: torch.Tensor, block_size: int, group: int,
               masks: QueryMasks | None, strides: tuple[int, ...], head_size: int,
               cdt: torch.dtype) -> _RowsPlan:
    """Split the call's rows into units. A tree row is a unit of one row with its own
    keys (the context, then the query rows its mask lets it see, in slot order --
    exactly the keys of the chain ending there). A causal request's rows share its keys
    in units of up to ``MAX_UNIT_M // group`` consecutive rows where
    :func:`rows_share_products` says a row's bits do not depend on its place in a
    product; elsewhere each row of a request of at most ROWS_ALONE rows (decoding, a
    chain's verification, a short prefill chunk) is a unit of one row -- computed
    exactly as a lone one-token decode, at the price of a copy of its keys per row --
    and longer prefill chunks still go in shared units."""
    wide = max(1, MAX_UNIT_M // group)
    shared = rows_share_products(group, head_size, cdt)
    units: list[tuple[list[int], list[int], torch.Tensor]] = []  # tokens, lims, slots
    trees = masks.tree_rows if masks is not None else {}
    qsl, q_lens, s_lens = batch.qsl.tolist(), batch.q_lens.tolist(), batch.s_lens.tolist()
    causal = batch.req_causal.tolist()
    for r in range(batch.num_reqs):
        n, s, first = q_lens[r], s_lens[r], qsl[r]
        if n == 0 or s == 0:
            continue
        n_blk = (s + block_size - 1) // block_size
        blocks = block_table[r, :n_blk].to(torch.int64)
        slots = (blocks[:, None] * block_size + torch.arange(block_size)).flatten()[:s]
        ctx = s - n
        seen_rows = trees.get(r)
        if seen_rows is not None:
            for i, seen in enumerate(seen_rows):
                units.append(([first + i], [ctx + seen.shape[0]],
                              torch.cat((slots[:ctx], slots[ctx + seen]))))
            continue
        step = wide if n > ROWS_ALONE or shared else 1
        for a in range(0, n, step):
            rows = list(range(a, min(a + step, n)))
            lims = [ctx + i + 1 for i in rows] if causal[r] else [s] * len(rows)
            units.append(([first + i for i in rows], lims, slots[:max(lims)]))
    # Units of one width, sorted by key tiles, batched into calls of at most
    # MAX_CALL_TILES tiles (a call pads its units' keys to its longest: no bit changes).
    units.sort(key=lambda u: (len(u[0]), u[2].shape[0]))
    calls, at = [], 0
    while at < len(units):
        width = len(units[at][0])
        tiles = -(-units[at][2].shape[0] // KEY_TILE)
        end = at + 1
        while end < len(units) and len(units[end][0]) == width:
            t = -(-units[end][2].shape[0] // KEY_TILE)
            if (end + 1 - at) * t > MAX_CALL_TILES:
                break
            tiles, end = t, end + 1
        part, keys = units[at:end], tiles * KEY_TILE
        tok = torch.full((len(part), width), -1, dtype=torch.int64)
        lims = torch.ones(len(part), width, dtype=torch.int64)
        slot = torch.full((len(part), keys), -1, dtype=torch.int64)
        for u, (toks, lim, sl) in enumerate(part):
            tok[u, :len(toks)] = torch.tensor(toks)
            lims[u, :len(lim)] = torch.tensor(lim)
            slot[u, :sl.shape[0]] = sl
        calls.append(_make_call(tok, lims, slot, block_size, group, strides))
        at = end
    return _RowsPlan(calls)


def _make_call(tok: torch.Tensor, lims: torch.Tensor, slot: torch.Tensor, block_size: int,
               group: int, strides: tuple[int, ...]) -> _Call:
    num, width = tok.shape
    num_kv_heads = strides[3]
    s_blk, s_head, s_off = strides[:3]
    valid = slot >= 0
    slot = slot.clamp(min=0)
    heads = torch.arange(num_kv_heads)[None, :, None]
    rows = ((slot // block_size)[:, None, :] * s_blk + heads * s_head
            + (slot % block_size)[:, None, :] * s_off).flatten()
    m = max(width * group, MIN_MATMUL_ROWS)
    row_lims = lims.repeat_interleave(group, dim=1)
    if m > width * group:
        row_lims = torch.cat((row_lims, row_lims.new_ones(num, m - width * group)), dim=1)
    hidden = torch.arange(slot.shape[1])[None, None, :] >= row_lims[:, :, None]
    pad = None
    if not bool(valid.all()):  # the padding keys' rows in the gathered [U * kv * P] rows
        pad = torch.nonzero((~valid)[:, None, :].expand(-1, num_kv_heads, -1).flatten())
        pad = pad.flatten()
    return _Call(tok, rows, hidden, pad)


@functools.cache
def _probe_rows_share_products(group: int, head_size: int, cdt: torch.dtype,
                               threads: int) -> bool:
    """Whether this CPU's matrix kernels give a query row the same bits wherever it sits
    in a product of up to MAX_UNIT_M rows (see :func:`rows_share_products`): each row
    group of random ``[w * group, D] @ [D, 2 * KEY_TILE]`` and ``[w * group, KEY_TILE] @
    [KEY_TILE, D]`` products against the same rows alone in a lone decode's product. A
    kernel takes its path from the shapes, not the values, so random values show it."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(head_size, 2 * KEY_TILE, generator=gen, dtype=cdt)
    values = torch.randn(KEY_TILE, head_size, generator=gen, dtype=cdt)
    lone_m = max(group, MIN_MATMUL_ROWS)
    for width in range(1, max(1, MAX_UNIT_M // group) + 1):
        m = max(width * group, MIN_MATMUL_ROWS)
        q = torch.randn(m, head_size, generator=gen, dtype=cdt)
        p = torch.rand(m, KEY_TILE, generator=gen, dtype=cdt)
        scores, ctx = q @ keys, p @ values
        for i in range(width):
            rows = slice(i * group, (i + 1) * group)
            lone_q = q.new_zeros(lone_m, head_size)
            lone_q[:group] = q[rows]
            lone_p = p.new_zeros(lone_m, KEY_TILE)
            lone_p[:group] = p[rows]
            if not (torch.equal((lone_q @ keys)[:group], scores[rows])
                    and torch.equal((lone_p @ values)[:group], ctx[rows])):
                return False
    return True


def rows_share_products(group: int, head_size: int, cdt: torch.dtype) -> bool:
    """Whether a request's query rows may share one product over its keys (units of up
    to ``MAX_UNIT_M // group`` rows) and still get each row's lone-decode bits. True on
    this project's AVX-512/AMX host; False under AVX2 kernels (MKL computes a 1-3 row
    remainder past a 6-row block another way), where every decode and verification row
    gets its own product and copy of its keys (exact, but a chain's keys are copied once
    per row). Probed once per (shape, dtype, torch threads): a CPU is not guessed from
    its name (MKL may run AVX2 kernels on an AVX-512 CPU of another vendor)."""
    return _probe_rows_share_products(group, head_size, cdt, torch.get_num_threads())


# The last plan and what it was made from: every layer of a forward calls the op with the
# same batch, so the plan is made once per forward (checked by content, not identity).
_PLAN_CACHE: list = []


def _cache_rows(cache: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """A ``[blocks, kv_heads, block, head]`` cache (vLLM's view into its KV tensor) as
    ``[rows, head]`` rows of the same memory, and the row strides of block, kv head and
    offset: one ``index_select`` then gathers any keys in any order."""
    num_blocks, num_kv_heads, block_size, head_size = cache.shape
    st = cache.stride()
    if st[3] != 1 or any(x % head_size for x in st[:3]):
        cache = cache.contiguous()
        st = cache.stride()
    strides = (st[0] // head_size, st[1] // head_size, st[2] // head_size)
    last = (num_blocks - 1) * strides[0] + (num_kv_heads - 1) * strides[1] + (
        block_size - 1) * strides[2]
    return cache.as_strided((last + 1, head_size), (head_size, 1)), strides


def _rows_plan(batch: _Batch, block_table: torch.Tensor, block_size: int, group: int,
               masks: QueryMasks | None, strides: tuple[int, ...], head_size: int,
               cdt: torch.dtype) -> _RowsPlan:
    n_blk = (batch.max_s + block_size - 1) // block_size
    table = block_table[:batch.num_reqs, :n_blk]
    if _PLAN_CACHE:
        (qsl, s_lens, causal, tab, key, m), plan = _PLAN_CACHE
        if (m is masks and key == (block_size, group, strides, head_size, cdt)
                and tab.shape == table.shape
                and qsl.shape == batch.qsl.shape and torch.equal(qsl, batch.qsl)
                and torch.equal(s_lens, batch.s_lens)
                and torch.equal(causal, batch.req_causal) and torch.equal(tab, table)):
            return plan
    plan = _plan_rows(batch, block_table, block_size, group, masks, strides, head_size, cdt)
    _PLAN_CACHE[:] = [(batch.qsl.clone(), batch.s_lens.clone(), batch.req_causal.clone(),
                       table.clone(), (block_size, group, strides, head_size, cdt), masks),
                     plan]
    return plan


def _attend_rows_alone(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    batch: _Batch,
    scale: float,
    block_table: torch.Tensor,
    masks: QueryMasks | None,
) -> None:
    """Batch-invariant attention (no ALiBi, softcap, sinks or key-cutting window): a
    decode, chain-verification or tree row's bits depend only on its query and the keys
    it sees, in their order -- not on the other requests of the batch, on how many query
    rows its own request has, or on the longest request: each is bit for bit the lone
    one-token decode at its position (so is a row of a prefill chunk of at most
    ROWS_ALONE rows; longer chunks, see below).

    Why this takes care: CPU matrix kernels (MKL, oneDNN) choose their summation order
    from a product's shape, so one product over keys padded to the batch's longest
    request (or masked siblings' zero weights between a tree node's ancestors) changes
    the last bit of ``probs @ V``, and a last-bit change flips near-ties of a greedy
    argmax: speculation (and any batching) would stop being exactly lossless. Probed on
    this project's hosts (one torch thread, as engines run): AVX-512/AMX kernels give a
    row the same bits whatever the row count of its product (from 4 rows) but not
    whatever its key count; AVX2 kernels (MKL) also compute rows differently by their
    position in the product (a remainder of 1-3 rows past a 6-row block, or more than
    8 columns, takes another path). The batch count of a batched product changes no
    element's bits on either. So:

    * every product has a shape fixed by its unit alone: ``[M, D] @ [D, P]`` (scores;
      a key's score has the same bits whatever P, probed for P a multiple of KEY_TILE
      up to 2048 on AVX-512 and AVX2 kernels)
      and ``[M, KEY_TILE] @ [KEY_TILE, D]`` batched over (unit, kv head, key tile),
      ``M`` = the unit's rows x the kv head's query heads, zero rows up to at least
      MIN_MATMUL_ROWS; a one-row unit's query heads sit in the rows of a lone decode's
      product, so its bits are the lone decode's on any kernel, and units of several
      rows are used only where :func:`rows_share_products` found the same bits;
    * keys are cut into tiles of KEY_TILE, each row's keys in its own chain's order from
      index 0 (a tree node's: context, then its ancestors and itself), zero past them;
    * the softmax runs over the unit's tiles with the keys a row does not see at -inf
      (trailing: the vectorised max and sum add only zeros for them, from 16 keys on);
    * the tiles' partial ``probs @ V`` are summed in tile order by ``cumsum`` (sequential,
      and a trailing all-zero tile adds exactly zero).

    Where rows may not share products (AVX2 kernels), prefill chunks of more than
    ROWS_ALONE rows still go in shared units (one row per unit would copy a long
    prompt's keys once per row): independent of the other requests and of the batch's
    longest request, but a long prompt's rows can depend on how the scheduler cut it
    into chunks there.

    The units are planned once per forward (:func:`_rows_plan`)."""
    _, num_kv_heads, block_size, head_size = key_cache.shape
    num_heads = query.shape[1]
    group = num_heads // num_kv_heads
    cdt = _compute_dtype(query.dtype)
    key_rows, strides = _cache_rows(key_cache)
    value_rows, v_strides = _cache_rows(value_cache)
    if v_strides != strides:  # not vLLM's layout: a copy with the keys' layout
        value_rows, v_strides = _cache_rows(value_cache.contiguous())
        key_rows, strides = _cache_rows(key_cache.contiguous())
    plan = _rows_plan(batch, block_table, block_size, group, masks,
                      (*strides, num_kv_heads), head_size, cdt)
    for call in plan.calls:
        rows = _attend_units(query, key_rows, value_rows, call, scale, num_kv_heads, cdt)
        valid = call.tok >= 0
        if bool(valid.all()):
            out[call.tok.flatten()] = rows.reshape(-1, num_heads, head_size).to(out.dtype)
        else:
            out[call.tok[valid]] = rows[valid].to(out.dtype)


def _attend_units(
    query: torch.Tensor, key_rows: torch.Tensor, value_rows: torch.Tensor, call: _Call,
    scale: float, num_kv_heads: int, cdt: torch.dtype,
) -> torch.Tensor:
    """One batched call over units (see :func:`_attend_rows_alone`): returns ``[U, R,
    heads, head]``, the attention of each unit row (rows of ``tok`` -1 are garbage)."""
    num, width = call.tok.shape
    _, num_heads, head_size = query.shape
    group = num_heads // num_kv_heads
    keys = call.hidden.shape[2]
    tiles = keys // KEY_TILE
    # [U, R, heads, D] -> [U, kv, R * group, D], zero rows up to MIN_MATMUL_ROWS
    q = query[call.tok.clamp(min=0)].to(cdt)
    q = q.view(num, width, num_kv_heads, group, head_size).transpose(1, 2)
    q = q.reshape(num, num_kv_heads, width * group, head_size)
    m = call.hidden.shape[1]
    if m > width * group:
        q = torch.cat((q, q.new_zeros(num, num_kv_heads, m - width * group, head_size)),
                      dim=2)
    # [U, kv, P, D] each; a padding key's value is zeroed (its slot may hold NaN)
    k = key_rows.index_select(0, call.rows).view(num, num_kv_heads, keys, head_size)
    k = k.to(cdt)
    v = value_rows.index_select(0, call.rows).view(num, num_kv_heads, keys, head_size)
    v = v.to(cdt)
    if call.pad is not None:
        v.view(-1, head_size).index_fill_(0, call.pad, 0.0)
    # [U, kv, M, D] @ [U, kv, D, P]: one product over all keys (a key's score does not
    # depend on P: probed on both kernel kinds)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores.masked_fill_(call.hidden[:, None], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    # [U, kv, tiles, M, T] @ [U, kv, tiles, T, D]: the key count of each product fixed
    probs = probs.view(num, num_kv_heads, m, tiles, KEY_TILE).transpose(2, 3)
    parts = torch.matmul(probs, v.view(num, num_kv_heads, tiles, KEY_TILE, head_size))
    ctx = parts[:, :, 0] if tiles == 1 else parts.cumsum(dim=2)[:, :, -1]
    # [U, kv, R * group, D] -> [U, R, heads, D]
    ctx = ctx[:, :, :width * group].reshape(num, num_kv_heads, width, group, head_size)
    return ctx.transpose(1, 2).reshape(num, width, num_heads, head_size)


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
    depends on the shape (rows that must be bit for bit plain decoding -- every tree row
    without ALiBi, softcap or sinks -- go through :func:`_attend_rows_alone` instead;
    this keys-first softmax is what the rest keep). ``allowed``
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
