"""MLA decode over the latent cache (``mla_decode_kvcache``) vs. a per-token loop.

Called through vLLM's own wrapper ``vllm._custom_ops.mla_decode_kvcache_cpu`` (the call
the ``CPU_MLA`` backend makes), on a ragged batch whose requests own shuffled 16-token
blocks of a cache whose other rows hold NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

BLOCK = 16
LATENT = 512
ROPE = 64


def _reference(q: torch.Tensor, rows: torch.Tensor, scale: float) -> torch.Tensor:
    """One request: q [H, 576], rows [S, 576] -> [H, 512], one head at a time in float64."""
    out = torch.zeros(q.shape[0], LATENT, dtype=torch.float64)
    for h in range(q.shape[0]):
        logits = [scale * float(q[h].double() @ rows[s].double()) for s in range(rows.shape[0])]
        top = max(logits)
        weights = [math.exp(x - top) for x in logits]
        total = sum(weights)
        for s, w in enumerate(weights):
            out[h] += w / total * rows[s, :LATENT].double()
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 3e-2)])
def test_mla_decode_matches_per_token_reference(reference_ops, dtype, tol):
    from vllm import _custom_ops as ops

    gen = torch.Generator().manual_seed(0)
    seq_lens = [1, 16, 17, 40]  # one token, a full block, a block + 1, several blocks
    num_heads = 3
    blocks_needed = sum(-(-s // BLOCK) for s in seq_lens)
    num_blocks = blocks_needed + 4
    cache = torch.full((num_blocks, BLOCK, LATENT + ROPE), float("nan"), dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(-(-s // BLOCK) for s in seq_lens) + 1
    poisoned = perm.pop()
    table = torch.full((len(seq_lens), max_blocks), poisoned, dtype=torch.int32)
    per_request_rows = []
    for r, length in enumerate(seq_lens):
        rows = torch.randn(length, LATENT + ROPE, generator=gen).to(dtype)
        for b in range(-(-length // BLOCK)):
            block = perm.pop()
            table[r, b] = block
            chunk = rows[b * BLOCK : (b + 1) * BLOCK]
            cache[block, : chunk.shape[0]] = chunk
        per_request_rows.append(rows)
    query = torch.randn(len(seq_lens), num_heads, LATENT + ROPE, generator=gen).to(dtype)
    scale = 1 / math.sqrt(192)
    out = torch.full((len(seq_lens), num_heads, LATENT), float("nan"), dtype=dtype)

    ops.mla_decode_kvcache_cpu(
        out, query, cache, scale, table, torch.tensor(seq_lens, dtype=torch.int32)
    )

    assert not torch.isnan(out).any()
    for r, rows in enumerate(per_request_rows):
        want = _reference(query[r], rows, scale)
        torch.testing.assert_close(out[r].double(), want, atol=tol, rtol=tol)


def test_mla_decode_is_registered_with_the_tables_schema(reference_ops):
    from vllm_specx.cpu_ops import registered_release
    from vllm_specx.cpu_ops.schemas import RELEASES

    schema = str(torch.ops._C.mla_decode_kvcache.default._schema)
    assert schema.startswith("_C::mla_decode_kvcache(Tensor(a0!) out, Tensor query")
    assert "mla_decode_kvcache" in RELEASES[registered_release()].ops
