"""Tree-masked paged attention (issue 37): a draft tree's query rows, attended in ONE call
with the ancestor-only query masks, give each node exactly what recomputing its
root-to-node path as an ordinary causal chain gives.

The tree call and the chain calls go through vLLM's own op wrappers (``vllm._custom_ops``),
as the engine calls them; the masks reach the op through ``attention.query_masks``.
"""

from __future__ import annotations

import pytest
import torch

BLOCK = 16
HEAD = 16


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """Query rows [root, node 0, node 1, ...]: a row sees itself, the root and the rows of
    its ancestors (the slow, obviously-correct way: walk up the parents)."""
    q = len(parents) + 1
    mask = torch.zeros(q, q, dtype=torch.bool)
    mask[:, 0] = True
    for n in range(len(parents)):
        row, node = n + 1, n
        while node >= 0:
            mask[row, node + 1] = True
            node = parents[node]
    return mask


def path_rows(parents: list[int], node: int) -> list[int]:
    """Query rows of the root-to-node path (root first); node -1 is the root itself."""
    rows = []
    while node >= 0:
        rows.append(node + 1)
        node = parents[node]
    return [0, *reversed(rows)]


def _attend(reqs: list[dict], num_heads: int, num_kv_heads: int, masks=None,
            head: int = HEAD) -> torch.Tensor:
    """One paged attention call over ``reqs`` (each: q [q_len, H, D], k/v [seq, Hkv, D],
    the last q_len keys being its query rows'); returns the output rows."""
    from vllm import _custom_ops as ops

    from vllm_specx.cpu_ops.attention import query_masks

    gen = torch.Generator().manual_seed(7)
    seq_lens = [r["k"].shape[0] for r in reqs]
    n_blk = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(n_blk) + 3
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    block_table = torch.full((len(reqs), max(n_blk) + 1), perm.pop(), dtype=torch.int32)
    kv_cache = torch.full((num_blocks, num_kv_heads, BLOCK, 2 * head), float("nan"))
    key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, 2 * BLOCK, head).chunk(
        2, dim=2)
    slots = []
    for r, s in enumerate(seq_lens):
        ids = [perm.pop() for _ in range(n_blk[r])]
        block_table[r, : n_blk[r]] = torch.tensor(ids, dtype=torch.int32)
        slots += [ids[p // BLOCK] * BLOCK + p % BLOCK for p in range(s)]
    ops.cpu_attn_reshape_and_cache(
        torch.cat([r["k"] for r in reqs]), torch.cat([r["v"] for r in reqs]), key_cache,
        value_cache, torch.tensor(slots, dtype=torch.int64), "vec")
    q_lens = [r["q"].shape[0] for r in reqs]
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    sl_t = torch.tensor(seq_lens, dtype=torch.int32)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        len(reqs), num_heads, num_kv_heads, head, sl_t, torch.float32, qsl, True, -1, "vec",
        False, None)
    query = torch.cat([r["q"] for r in reqs])
    output = torch.full((query.shape[0], num_heads * head), float("nan"))
    with query_masks(masks):
        ops.cpu_attention_with_kv_cache(
            query, key_cache, value_cache, output.view(-1, num_heads, head), qsl, sl_t,
            head**-0.5, True, None, -1, block_table, 0.0, metadata, None, None)
    return output


def _requests(spec, num_heads: int, num_kv_heads: int, rand):
    """Random requests for ``spec`` ((context length, parents or None for an ordinary
    causal request of 5 query rows) each): the requests, their trees' ancestor masks, and
    per tree node ``(request, query row, root-to-node rows, the node's keys)``."""
    reqs, trees, nodes = [], {}, []
    for r, (ctx, parents) in enumerate(spec):
        q_len = 5 if parents is None else len(parents) + 1
        reqs.append(dict(q=rand(q_len, num_heads, HEAD), k=rand(ctx + q_len, num_kv_heads, HEAD),
                         v=rand(ctx + q_len, num_kv_heads, HEAD)))
        if parents is None:
            continue
        trees[r] = ancestor_mask(parents)
        for node in range(-1, len(parents)):
            rows = path_rows(parents, node)
            nodes.append((r, node + 1, rows, list(range(ctx)) + [ctx + i for i in rows]))
    return reqs, trees, nodes


# Trees as parent lists (index within the request, -1 = child of the root), BFS order.
TREES = [
    [-1, -1, 0, 0, 1, 2, 2, 5],  # two beams' worth of branching, depth 4
    [-1, 0, 1, 2],  # a chain: the mask is the causal one
    [-1, -1, -1, 0, 1, 2],  # three siblings, one child each
]


@pytest.mark.usefixtures("reference_ops")
@pytest.mark.parametrize("layout", ["one_tree", "mixed_batch"])
def test_tree_rows_equal_root_to_node_chains(layout):
    from vllm_specx.cpu_ops.attention import QueryMasks

    num_heads, num_kv_heads = 4, 2
    gen = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    # (context length, parents or None for an ordinary causal request with q rows)
    if layout == "one_tree":
        spec = [(21, TREES[0])]
    else:
        spec = [(21, TREES[0]), (9, None), (40, TREES[1]), (1, TREES[2]), (33, None)]
    reqs, trees, nodes = _requests(spec, num_heads, num_kv_heads, rand)
    chains = [dict(q=reqs[r]["q"][rows], k=reqs[r]["k"][keep], v=reqs[r]["v"][keep])
              for r, _, rows, keep in nodes]
    expect = [(r, row, c) for c, (r, row, _, _) in enumerate(nodes)]
    q_lens = [r["q"].shape[0] for r in reqs]
    masks = QueryMasks.causal_except(q_lens, trees)
    tree_out = _attend(reqs, num_heads, num_kv_heads, masks)
    chain_out = _attend(chains, num_heads, num_kv_heads)
    # The plain causal call on the same batch: what the tree rows must NOT give.
    causal_out = _attend(reqs, num_heads, num_kv_heads)
    req_start = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    chain_end = torch.tensor([c["q"].shape[0] for c in chains]).cumsum(0) - 1
    differs = 0
    for r, row, c in expect:
        got = tree_out[req_start[r] + row]
        torch.testing.assert_close(got, chain_out[int(chain_end[c])], atol=1e-5, rtol=1e-5)
        differs += int(not torch.allclose(got, causal_out[req_start[r] + row], atol=1e-4))
    assert differs > 0  # TREES[0] branches: a sibling's row would leak into the causal one
    # Causal requests in the batch are untouched by the masks.
    for r, (_, parents) in enumerate(spec):
        if parents is None:
            rows = slice(req_start[r], req_start[r + 1])
            torch.testing.assert_close(tree_out[rows], causal_out[rows])


@pytest.mark.usefixtures("reference_ops")
def test_masks_are_scoped_and_checked():
    from vllm_specx.cpu_ops import attention
    from vllm_specx.cpu_ops.attention import QueryMasks, query_masks

    masks = QueryMasks.causal_except([3], {0: ancestor_mask([-1, -1])})
    with query_masks(masks):
        assert attention.active_query_masks() is masks
        with pytest.raises(RuntimeError, match="already set"), query_masks(masks):
            pass
    assert attention.active_query_masks() is None
    # A forward of another shape (say, a draft pass) under the target's masks: refused.
    gen = torch.Generator().manual_seed(1)
    req = dict(q=torch.randn(2, 2, HEAD, generator=gen),
               k=torch.randn(6, 2, HEAD, generator=gen), v=torch.randn(6, 2, HEAD, generator=gen))
    with pytest.raises(RuntimeError, match="query lengths"):
        _attend([req], 2, 2, masks)
    assert attention.active_query_masks() is None
    with pytest.raises(ValueError, match="no later row"):
        QueryMasks.causal_except([2], {0: torch.ones(2, 2, dtype=torch.bool)})


@pytest.mark.usefixtures("reference_ops")
def test_copy_slots_moves_the_accepted_path_and_nothing_else():
    """The accepted path of a tree (nodes 1, 4, 7 of TREES[0]: depths 1-3), written at the
    slots of their flat indices, lands in the contiguous slots after the root; K and V
    both move, every other slot keeps its bytes; and a query attending over the compacted
    cache sees what it sees over the path computed as a chain."""
    from vllm import _custom_ops as ops

    from vllm_specx.cpu_ops.attention import cpu_attn_copy_slots

    num_blocks, heads, ctx = 6, 2, 13  # the root at slot ctx: a block boundary is crossed
    gen = torch.Generator().manual_seed(3)
    kv_cache = torch.randn(num_blocks, heads, BLOCK, 2 * HEAD, generator=gen)
    key_cache, value_cache = kv_cache.view(num_blocks, heads, 2 * BLOCK, HEAD).chunk(2, dim=2)
    table = [4, 1, 5, 0]  # request's blocks, out of order

    def slot(pos: int) -> int:
        return table[pos // BLOCK] * BLOCK + pos % BLOCK

    path = [1, 4, 7]
    src = torch.tensor([slot(ctx + 1 + n) for n in path])
    dst = torch.tensor([slot(ctx + 1 + d) for d in range(len(path))])
    want_k = key_cache[src // BLOCK, :, src % BLOCK].clone()
    want_v = value_cache[src // BLOCK, :, src % BLOCK].clone()
    before = kv_cache.clone()
    cpu_attn_copy_slots(kv_cache, src, dst)
    torch.testing.assert_close(key_cache[dst // BLOCK, :, dst % BLOCK], want_k, rtol=0, atol=0)
    torch.testing.assert_close(value_cache[dst // BLOCK, :, dst % BLOCK], want_v, rtol=0,
                               atol=0)
    touched = torch.zeros(num_blocks, BLOCK, dtype=torch.bool)
    touched[dst // BLOCK, dst % BLOCK] = True
    k_same = (key_cache == before.view(num_blocks, heads, 2 * BLOCK, HEAD)[:, :, :BLOCK])
    v_same = (value_cache == before.view(num_blocks, heads, 2 * BLOCK, HEAD)[:, :, BLOCK:])
    assert bool(k_same.all(dim=(1, 3))[~touched].all())
    assert bool(v_same.all(dim=(1, 3))[~touched].all())

    # The next step's query over [context, root, path] reads the path from the cache.
    q = torch.randn(1, heads, HEAD, generator=gen)
    seq = ctx + 1 + len(path)
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    out = torch.empty(1, heads, HEAD)
    ops.cpu_attention_with_kv_cache(
        q, key_cache, value_cache, out, qsl, torch.tensor([seq], dtype=torch.int32),
        HEAD**-0.5, True, None, -1, torch.tensor([table], dtype=torch.int32), 0.0,
        torch.zeros(1, dtype=torch.int8), None, None)
    keep = torch.tensor([slot(p) for p in range(ctx + 1)] + src.tolist())
    k = before.view(num_blocks, heads, 2 * BLOCK, HEAD)[:, :, :BLOCK]
    v = before.view(num_blocks, heads, 2 * BLOCK, HEAD)[:, :, BLOCK:]
    k_path = k[keep // BLOCK, :, keep % BLOCK]  # [seq, heads, head]
    v_path = v[keep // BLOCK, :, keep % BLOCK]
    w = torch.softmax(torch.einsum("hd,shd->hs", q[0], k_path) * HEAD**-0.5, dim=-1)
    torch.testing.assert_close(out[0], torch.einsum("hs,shd->hd", w, v_path), atol=1e-5,
                               rtol=1e-5)


@pytest.mark.usefixtures("reference_ops")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("layout", ["one_tree", "mixed_batch", "trees_only"])
def test_tree_rows_are_bitwise_plain_decoding(layout, dtype):
    """Greedy tree decoding is exactly lossless only if every node's row is BIT-equal to
    what plain decoding computes at that position (one query token over the context and
    the node's path): a last-bit difference flips near-ties of the target's argmax in
    bfloat16 (seen on the real pair before the softmax compacted each row's keys)."""
    from vllm_specx.cpu_ops.attention import QueryMasks

    num_heads, num_kv_heads = 9, 3
    gen = torch.Generator().manual_seed(1)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    spec = [(300, TREES[0])]
    if layout == "mixed_batch":
        # past ~500 keys AVX-512 kernels block the sums too; the last tree is not in BFS
        # order (its depths interleave)
        spec += [(9, None), (530, TREES[2]), (40, [-1, 0, -1, 2, 1])]
    elif layout == "trees_only":  # no causal request: the padded pass is skipped
        spec += [(77, TREES[2]), (5, TREES[0])]
    reqs, trees, nodes = _requests(spec, num_heads, num_kv_heads, rand)
    singles = [(r, row, dict(q=reqs[r]["q"][rows[-1:]], k=reqs[r]["k"][keep],
                             v=reqs[r]["v"][keep])) for r, row, rows, keep in nodes]
    q_lens = [x["q"].shape[0] for x in reqs]
    out = _attend(reqs, num_heads, num_kv_heads, QueryMasks.causal_except(q_lens, trees))
    start = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    for r, row, single in singles:
        decoded = _attend([single], num_heads, num_kv_heads)[0]
        assert torch.equal(out[start[r] + row], decoded), (r, row)



def _subject(kind: str, ctx: int, rand, num_heads: int, num_kv_heads: int, head: int):
    """One request's step of ``kind`` over ``ctx`` cached keys: the request, its tree mask
    (or None) and per query row its lone one-token decode (the chain of keys it sees)."""
    q_len = {"decode": 1, "chain": 4, "tree": len(TREES[0]) + 1, "prefill": 16,
             "long_prefill": 40}[kind]
    req = dict(q=rand(q_len, num_heads, head), k=rand(ctx + q_len, num_kv_heads, head),
               v=rand(ctx + q_len, num_kv_heads, head))
    mask = ancestor_mask(TREES[0]) if kind == "tree" else None
    lone = []
    for row in range(q_len):
        seen = (torch.nonzero(mask[row]).flatten().tolist() if mask is not None
                else list(range(row + 1)))
        keep = list(range(ctx)) + [ctx + i for i in seen]
        lone.append(dict(q=req["q"][row:row + 1], k=req["k"][keep], v=req["v"][keep]))
    return req, mask, lone


@pytest.mark.usefixtures("reference_ops", "one_torch_thread")  # as engines run
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_rows_are_batch_invariant(dtype):
    """Issue 37, batch > 1: a request's decode, chain-verification, tree and (short)
    prefill rows give the same bits alone and inside batches of other requests of other
    lengths (short, past many 32-key tiles, past 512 keys; decodes, chains, trees and a
    long prefill chunk), and each row is bit for bit the lone one-token decode at its
    position, under AVX-512/AMX kernels and AVX2 ones alike. Before the fix a
    batch's plain rows came from one product padded to its longest request and differed
    in the last bit (greedy trees then differed from no speculation at batch 8)."""
    from vllm_specx.cpu_ops.attention import QueryMasks

    num_heads, num_kv_heads, head = 9, 3, 64  # the real pair's attention shapes
    gen = torch.Generator().manual_seed(5)

    def rand(*shape):
        return torch.randn(*shape, generator=gen).to(dtype)

    others = [_subject(kind, ctx, rand, num_heads, num_kv_heads, head)[:2] for kind, ctx in
              [("decode", 9), ("decode", 700), ("chain", 300), ("tree", 530),
               ("long_prefill", 0), ("chain", 20)]]
    mixes = [[], others[:2], others[2:4], others]  # alone, decodes, chain + tree, all
    seen_differ = False
    for kind, ctx in [("decode", 37), ("chain", 260), ("tree", 600), ("prefill", 250)]:
        req, mask, lone = _subject(kind, ctx, rand, num_heads, num_kv_heads, head)
        want = torch.cat([_attend([x], num_heads, num_kv_heads, head=head) for x in lone])
        for mix in mixes:
            batch = [*mix[:len(mix) // 2], (req, mask), *mix[len(mix) // 2:]]
            at = len(mix) // 2
            q_lens = [r["q"].shape[0] for r, _ in batch]
            trees = {i: m for i, (_, m) in enumerate(batch) if m is not None}
            masks = QueryMasks.causal_except(q_lens, trees) if trees else None
            out = _attend([r for r, _ in batch], num_heads, num_kv_heads, masks, head=head)
            first = sum(q_lens[:at])
            got = out[first:first + q_lens[at]]
            assert torch.equal(got, want), (kind, ctx, len(mix), (got != want).nonzero()[:3])
            # A float64 recomputation differs somewhere: the test compares real roundings.
            seen_differ |= not torch.equal(got, _attend_float64(lone, num_heads, head))
    assert seen_differ


def _attend_float64(lone: list[dict], num_heads: int, head: int) -> torch.Tensor:
    """The lone decodes in float64, rounded to float32 (the slow obviously-correct way)."""
    rows = []
    for x in lone:
        q, k, v = (x[n].double() for n in ("q", "k", "v"))
        k = k.repeat_interleave(num_heads // k.shape[1], dim=1)
        v = v.repeat_interleave(num_heads // v.shape[1], dim=1)
        w = torch.softmax(torch.einsum("hd,shd->hs", q[0], k) * head**-0.5, dim=-1)
        rows.append(torch.einsum("hs,shd->hd", w, v).reshape(1, -1))
    return torch.cat(rows).float()
