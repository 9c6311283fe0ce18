"""The cuda backend's Triton tree attention (issue 34) equals the CPU references.

Random ragged batches mix draft-tree requests (random parent shapes, 0-64 nodes) with
causal ones (decodes, chain verifications, chunked-prefill pieces), over a paged KV
cache in vLLM's Triton layout (one ``[..., 2 * head_size]`` tensor split into K and V
views, blocks in shuffled order, NHD and HND physical orders), with GQA. Each output row
must equal:

* the slow reference below: the row's visible keys listed one by one (the context, then
  for a tree row the root-to-node path, i.e. the path recomputed as a causal chain),
  softmax in float64;
* the project's CPU tree attention (``cpu_ops.attention`` with ``QueryMasks``), the op
  the CPU engine runs, on the same cache.

The kernel runs in a child process under ``TRITON_INTERPRET=1`` (``triton_call``), or on
CUDA tensors when a GPU is present.
"""

from __future__ import annotations

import random

import pytest
import torch

from vllm_specx.cpu_ops.attention import QueryMasks
from vllm_specx.cpu_ops.attention import cpu_attention_with_kv_cache as cpu_attention

pytest.importorskip("triton")

from vllm_specx.backends.triton_tree_attention import TreeMasks  # noqa: E402


def random_parents(rng: random.Random, n: int) -> list[int]:
    """A random tree of ``n`` nodes in BFS-compatible order (a parent before its child);
    shapes range from chains to stars."""
    style = rng.random()
    parents = []
    for i in range(n):
        if style < 0.2:
            parents.append(i - 1)  # a chain
        elif style < 0.4:
            parents.append(rng.randrange(-1, min(i, 2)) if i else -1)  # wide and shallow
        else:
            parents.append(rng.randrange(-1, i))
    return parents


def ancestor_mask(parents: list[int]) -> torch.Tensor:
    """[root, nodes...] x [root, nodes...]: a row sees the root, its ancestors, itself."""
    q = len(parents) + 1
    mask = torch.zeros(q, q, dtype=torch.bool)
    mask[:, 0] = True
    for n in range(len(parents)):
        node = n
        while node >= 0:
            mask[n + 1, node + 1] = True
            node = parents[node]
    return mask


def path_rows(parents: list[int], row: int) -> list[int]:
    """The query rows of row ``row``'s root-to-node path, root first."""
    rows, node = [], row - 1
    while node >= 0:
        rows.append(node + 1)
        node = parents[node]
    return [0, *reversed(rows)]


def make_batch(seed: int, block_size: int, num_heads: int, num_kv_heads: int, head: int,
               layout: str, max_nodes: int = 64, dtype=torch.float32) -> dict:
    """A random mixed batch: its tensors (vLLM's Triton cache layout) and per request
    (context length, parents or None for a causal request)."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    spec = []
    for _ in range(rng.randint(1, 6)):
        kind = rng.random()
        ctx = rng.choice([0, 1, rng.randint(2, 20), rng.randint(20, 90)])
        if kind < 0.55:
            spec.append((ctx, random_parents(rng, rng.choice([0, 1, rng.randint(2, max_nodes),
                                                               max_nodes]))))
        else:
            spec.append((ctx, rng.choice([1, 1, 4, rng.randint(5, 40)])))  # causal q rows
    if not any(isinstance(p, list) and len(p) == max_nodes for _, p in spec):
        # Every batch holds a tree of the largest size, somewhere in the batch.
        spec.insert(rng.randrange(len(spec) + 1), (rng.randint(0, 40),
                                                   random_parents(rng, max_nodes)))
    q_lens = [len(p) + 1 if isinstance(p, list) else p for _, p in spec]
    seq_lens = [ctx + q for (ctx, _), q in zip(spec, q_lens, strict=True)]
    n_blk = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(n_blk) + 2
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.full((len(spec), max(n_blk) + 1), perm.pop(), dtype=torch.int32)
    if layout == "NHD":  # physical [blocks, block, kv heads, 2 * head], logical view below
        kv = torch.randn(num_blocks, block_size, num_kv_heads, 2 * head, generator=gen)
        kv = kv.to(dtype).permute(0, 2, 1, 3)
    else:  # HND: physical = logical [blocks, kv heads, block, 2 * head]
        kv = torch.randn(num_blocks, num_kv_heads, block_size, 2 * head, generator=gen).to(dtype)
    # vLLM's TritonAttentionImpl: (B, H, N, 2 hs) -> (B, N, H, 2 hs) -> K and V views.
    key_cache, value_cache = kv.transpose(1, 2).split(head, dim=-1)
    for r in range(len(spec)):
        table[r, : n_blk[r]] = torch.tensor([perm.pop() for _ in range(n_blk[r])])
    query = torch.randn(sum(q_lens), num_heads, head, generator=gen).to(dtype)
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    trees = {r: ancestor_mask(p) for r, (_, p) in enumerate(spec) if isinstance(p, list)}
    return dict(spec=spec, q_lens=q_lens, query=query, kv=kv, key_cache=key_cache,
                value_cache=value_cache, qsl=qsl, table=table, trees=trees,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32), scale=head ** -0.5)


def slow_reference(b: dict) -> torch.Tensor:
    """Row by row: list the keys the row sees (context, then its path's rows for a tree
    row or all earlier rows for a causal one), gather them through the block table, and
    softmax in float64."""
    query, key_cache, value_cache = b["query"], b["key_cache"], b["value_cache"]
    num_heads = query.shape[1]
    group = num_heads // key_cache.shape[2]
    out = torch.empty(query.shape, dtype=torch.float64)
    block_size = key_cache.shape[1]
    for r, (ctx, parents) in enumerate(b["spec"]):
        for i in range(b["q_lens"][r]):
            rows = path_rows(parents, i) if isinstance(parents, list) else list(range(i + 1))
            keys = list(range(ctx)) + [ctx + j for j in rows]
            blocks = b["table"][r, [k // block_size for k in keys]].long()
            slots = torch.tensor([k % block_size for k in keys])
            k = key_cache[blocks, slots].double()  # [keys, kv heads, head]
            v = value_cache[blocks, slots].double()
            q = query[int(b["qsl"][r]) + i].double()  # [heads, head]
            for h in range(num_heads):
                w = torch.softmax(k[:, h // group] @ q[h] * b["scale"], dim=0)
                out[int(b["qsl"][r]) + i, h] = w @ v[:, h // group]
    return out


def run_kernel(triton_call, b: dict, masks: TreeMasks | None) -> torch.Tensor:
    out = torch.full_like(b["query"], float("nan"))
    return triton_call("triton_tree_attention:tree_attention", b["query"], b["key_cache"],
                       b["value_cache"], out, b["qsl"], b["seq_lens"], b["table"],
                       max(b["q_lens"]), b["scale"], masks)


def cpu_tree_attention(b: dict) -> torch.Tensor:
    """The CPU engine's op on the same cache (its layout: [blocks, kv heads, block, head]
    views of the same memory) with the step's ``QueryMasks``."""
    from vllm_specx.cpu_ops.attention import query_masks

    out = torch.full_like(b["query"], float("nan"))
    with query_masks(QueryMasks.causal_except(b["q_lens"], b["trees"])):
        cpu_attention(b["query"], b["key_cache"].permute(0, 2, 1, 3),
                      b["value_cache"].permute(0, 2, 1, 3), out, b["qsl"], b["seq_lens"],
                      b["scale"], True, None, -1, b["table"], 0.0, torch.empty(0), None, None)
    return out


# (block size, heads, kv heads, head size, physical layout): GQA groups 4, 3 and 1, head
# sizes that are and are not powers of 2.
SHAPES = [(16, 8, 2, 32, "NHD"), (32, 6, 2, 40, "HND"), (64, 4, 4, 16, "NHD")]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"bs{s[0]}-h{s[1]}kv{s[2]}-d{s[3]}")
def test_kernel_equals_path_as_chain_and_the_cpu_tree_attention(triton_call, shape) -> None:
    """One random mixed batch per shape (a 64-node tree in each: the interpreter is slow)."""
    block_size, heads, kv_heads, head, layout = shape
    b = make_batch(1000 * block_size, block_size, heads, kv_heads, head, layout)
    assert max(b["q_lens"][r] for r in b["trees"]) == 65
    got = run_kernel(triton_call, b, TreeMasks.build(b["q_lens"], b["trees"]))
    torch.testing.assert_close(got.double(), slow_reference(b), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(got, cpu_tree_attention(b), atol=2e-5, rtol=2e-5)
    # The masks matter: the same batch, all causal, differs on a branching tree's rows ...
    branching = [r for r, (_, p) in enumerate(b["spec"])
                 if isinstance(p, list) and any(p[i] != i - 1 for i in range(len(p)))]
    assert branching
    causal = run_kernel(triton_call, b, None)
    start = int(b["qsl"][branching[0]])
    rows = slice(start, start + b["q_lens"][branching[0]])
    assert not torch.allclose(causal[rows], got[rows], atol=1e-3)
    # ... and the causal requests of the batch are the same either way: bit for bit under
    # the interpreter; on a GPU the masked and unmasked kernels are two compilations whose
    # float32 rounding may differ in the last bit (seen on an H200: 6e-8).
    tol = 0.0 if got.device.type == "cpu" else 1e-6
    for r, (_, p) in enumerate(b["spec"]):
        if not isinstance(p, list):
            rows = slice(int(b["qsl"][r]), int(b["qsl"][r + 1]))
            torch.testing.assert_close(causal[rows], got[rows], atol=tol, rtol=tol)


def test_float16_and_query_masks_conversion(triton_call) -> None:
    """Half precision within half-precision rounding of the float64 reference, with the
    masks converted from the CPU op's QueryMasks as the tree step builds them."""
    b = make_batch(6, 16, 8, 2, 64, "NHD", max_nodes=14, dtype=torch.float16)
    masks = TreeMasks.from_query_masks(QueryMasks.causal_except(b["q_lens"], b["trees"]))
    # Chains (a 0-node tree is one causal row) are stored as causal; branching trees are not.
    branching = [r for r, m in b["trees"].items() if not torch.equal(m, m.new_ones(m.shape).tril())]
    assert branching and (masks.first_row >= 0).nonzero().flatten().tolist() == branching
    got = run_kernel(triton_call, b, masks)
    assert got.dtype == torch.float16
    torch.testing.assert_close(got.double(), slow_reference(b), atol=4e-3, rtol=4e-3)


def test_masks_are_checked() -> None:
    with pytest.raises(ValueError, match="no later row"):
        TreeMasks.build([2], {0: torch.ones(2, 2, dtype=torch.bool)})
    with pytest.raises(ValueError, match="for 3 query rows"):
        TreeMasks.build([3], {0: ancestor_mask([-1])})
    with pytest.raises(ValueError, match="at most 65"):
        TreeMasks.build([66], {0: ancestor_mask(list(range(-1, 64)))})
    masks = TreeMasks.build([1, 3, 5], {1: ancestor_mask([-1, -1])})
    assert masks.first_row.tolist() == [-1, 0, -1]
    assert masks.rows.tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 1]]
