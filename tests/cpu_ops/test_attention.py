"""Paged CPU attention vs. dense attention with explicit per-request masks.

The ops are called through vLLM's own wrappers in ``vllm._custom_ops`` (the call
sites the engine uses), on ragged batches whose requests span several 32-token blocks
placed at shuffled positions of a cache whose unused blocks hold NaN.
"""

from __future__ import annotations

import math

import pytest
import torch

BLOCK = 32
HEAD = 32


def _reference(
    q: torch.Tensor,  # [q_len, H, D]
    k: torch.Tensor,  # [S, Hkv, D]
    v: torch.Tensor,
    *,
    scale: float,
    causal: bool,
    window: int,
    softcap: float,
    alibi: torch.Tensor | None,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """Attention for one request, one query and one head at a time, in float64."""
    q_len, num_heads, _ = q.shape
    seq_len, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads
    out = torch.zeros(q.shape, dtype=torch.float64)
    for i in range(q_len):
        pos = seq_len - q_len + i if causal else i
        for h in range(num_heads):
            kv_h = h // group
            logits = []
            for key in range(seq_len):
                if causal and key > pos:
                    continue
                if window > 0 and pos - key >= window:
                    continue
                if window > 0 and not causal and key - pos >= window:
                    continue
                s = scale * float(q[i, h].double() @ k[key, kv_h].double())
                if softcap > 0:
                    s = softcap * math.tanh(s / softcap)
                if alibi is not None:
                    s += float(alibi[h]) * (key - pos)
                logits.append((s, key))
            extra = [float(sinks[h])] if sinks is not None else []
            top = max([s for s, _ in logits] + extra)
            denom = sum(math.exp(s - top) for s, _ in logits) + sum(
                math.exp(e - top) for e in extra
            )
            for s, key in logits:
                out[i, h] += math.exp(s - top) / denom * v[key, kv_h].double()
    return out


def _batch(q_lens, seq_lens, num_heads, num_kv_heads, seed):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(-(-s // BLOCK) for s in seq_lens) + 5
    # Shuffled physical blocks; every request gets a distinct set.
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    max_blocks = max(-(-s // BLOCK) for s in seq_lens) + 2
    block_table = torch.zeros((len(seq_lens), max_blocks), dtype=torch.int32)
    unused = perm.pop()  # table padding points at a poisoned block
    block_table.fill_(unused)
    reqs = []
    for r, (ql, sl) in enumerate(zip(q_lens, seq_lens)):
        n = -(-sl // BLOCK)
        ids = [perm.pop() for _ in range(n)]
        block_table[r, :n] = torch.tensor(ids, dtype=torch.int32)
        reqs.append(
            dict(
                q=torch.randn(ql, num_heads, HEAD, generator=gen),
                k=torch.randn(sl, num_kv_heads, HEAD, generator=gen),
                v=torch.randn(sl, num_kv_heads, HEAD, generator=gen),
            )
        )
    return reqs, block_table, num_blocks


def _run(
    q_lens,
    seq_lens,
    *,
    num_heads=4,
    num_kv_heads=2,
    causal=True,
    window=-1,
    softcap=0.0,
    alibi=False,
    sinks=False,
    dynamic_causal=None,
    seed=0,
):
    from vllm import _custom_ops as ops

    reqs, block_table, num_blocks = _batch(q_lens, seq_lens, num_heads, num_kv_heads, seed)
    # vLLM's CPU_ATTN layout: [blocks, kv_heads, block, 2 * head] viewed and split.
    kv_cache = torch.full((num_blocks, num_kv_heads, BLOCK, 2 * HEAD), float("nan"))
    key_cache, value_cache = kv_cache.view(num_blocks, num_kv_heads, 2 * BLOCK, HEAD).chunk(
        2, dim=2
    )
    # Write every request's whole history into the cache, plus one padding slot (-1).
    keys = torch.cat([r["k"] for r in reqs] + [torch.zeros(1, num_kv_heads, HEAD)])
    values = torch.cat([r["v"] for r in reqs] + [torch.zeros(1, num_kv_heads, HEAD)])
    slots = []
    for r, sl in enumerate(seq_lens):
        for p in range(sl):
            slots.append(int(block_table[r, p // BLOCK]) * BLOCK + p % BLOCK)
    slots.append(-1)
    ops.cpu_attn_reshape_and_cache(
        keys, values, key_cache, value_cache, torch.tensor(slots, dtype=torch.int64), "vec"
    )
    query = torch.cat([r["q"] for r in reqs])
    qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    sl_t = torch.tensor(seq_lens, dtype=torch.int32)
    gen = torch.Generator().manual_seed(seed + 1)
    alibi_t = torch.rand(num_heads, generator=gen) * 0.5 if alibi else None
    sinks_t = torch.randn(num_heads, generator=gen) if sinks else None
    dyn = None if dynamic_causal is None else torch.tensor(dynamic_causal, dtype=torch.int32)
    scale = HEAD**-0.5
    metadata = ops.cpu_attn_get_scheduler_metadata(
        len(q_lens),
        num_heads,
        num_kv_heads,
        HEAD,
        sl_t,
        torch.float32,
        qsl,
        causal,
        window,
        "vec",
        False,
        dyn,
    )
    output = torch.full((query.shape[0], num_heads * HEAD), float("nan"))
    ops.cpu_attention_with_kv_cache(
        query,
        key_cache,
        value_cache,
        output.view(-1, num_heads, HEAD),
        qsl,
        sl_t,
        scale,
        causal,
        alibi_t,
        window,
        block_table,
        softcap,
        metadata,
        sinks_t,
        dyn,
    )
    start = 0
    for r, req in enumerate(reqs):
        req_causal = causal or (dynamic_causal is not None and bool(dynamic_causal[r]))
        want = _reference(
            req["q"],
            req["k"],
            req["v"],
            scale=scale,
            causal=req_causal,
            window=window,
            softcap=softcap,
            alibi=alibi_t,
            sinks=sinks_t,
        )
        got = output[start : start + q_lens[r]].view(q_lens[r], num_heads, HEAD)
        torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=1e-4)
        start += q_lens[r]


# Mixed batch: long prefill, chunked prefill continuing a cached prefix, decode rows,
# a speculative-decode-like 4-token verify row; each spans several blocks.
Q_LENS = [70, 20, 1, 4, 1]
SEQ_LENS = [70, 90, 33, 100, 64]


@pytest.mark.usefixtures("reference_ops")
class TestPagedAttention:
    def test_causal_gqa_ragged(self):
        _run(Q_LENS, SEQ_LENS)

    def test_mha(self):
        _run(Q_LENS, SEQ_LENS, num_heads=2, num_kv_heads=2, seed=3)

    def test_sliding_window(self):
        _run(Q_LENS, SEQ_LENS, window=40, seed=1)

    def test_softcap_alibi_sinks(self):
        _run(Q_LENS, SEQ_LENS, softcap=5.0, alibi=True, sinks=True, seed=2)

    def test_non_causal_encoder(self):
        _run([40, 65], [40, 65], causal=False, seed=4)

    def test_non_causal_window(self):
        _run([40, 65], [40, 65], causal=False, window=9, seed=5)

    def test_dynamic_causal(self):
        # The builder passes causal=False with a per-request flag tensor.
        _run([40, 3], [40, 50], causal=False, dynamic_causal=[0, 1], seed=6)

    def test_single_request(self):
        # One request without ALiBi/softcap/sinks takes the op's few-op path (the batch-1
        # decoding and verification step): decode, verify, prefill, encoder, a window
        # longer than the context; a window that cuts the keys takes the padded path.
        for case, (q_lens, seq_lens, kw) in enumerate([
            ([1], [70], {}), ([4], [100], {}), ([33], [33], {}),
            ([40], [40], {"causal": False}), ([3], [50], {"window": 64}),
            ([3], [50], {"window": 20}), ([5], [64], {"num_heads": 2, "num_kv_heads": 2}),
        ]):
            _run(q_lens, seq_lens, seed=10 + case, **kw)

    def test_cache_write_layout_and_padding_slot(self):
        from vllm import _custom_ops as ops

        kv_cache = torch.zeros(3, 2, BLOCK, 2 * HEAD)
        key_cache, value_cache = kv_cache.view(3, 2, 2 * BLOCK, HEAD).chunk(2, dim=2)
        key = torch.randn(3, 2, HEAD)
        value = torch.randn(3, 2, HEAD)
        slots = torch.tensor([2 * BLOCK + 5, -1, 7])
        ops.cpu_attn_reshape_and_cache(key, value, key_cache, value_cache, slots, "vec")
        # The raw layout: per (block, kv head), BLOCK key rows then BLOCK value rows.
        raw = kv_cache.view(3, 2, 2 * BLOCK, HEAD)
        torch.testing.assert_close(raw[2, :, 5], key[0])
        torch.testing.assert_close(raw[2, :, BLOCK + 5], value[0])
        torch.testing.assert_close(raw[0, :, 7], key[2])
        torch.testing.assert_close(raw[0, :, BLOCK + 7], value[2])
        written = torch.zeros(3, 2 * BLOCK, dtype=torch.bool)
        written[2, 5] = written[2, BLOCK + 5] = written[0, 7] = written[0, BLOCK + 7] = True
        assert (raw.abs().sum(dim=(1, 3))[~written] == 0).all()  # slot -1 wrote nothing

    def test_rejects_fp8_kv_cache(self):
        from vllm import _custom_ops as ops

        kv = torch.zeros(1, 1, BLOCK, 2 * HEAD)
        k, v = kv.view(1, 1, 2 * BLOCK, HEAD).chunk(2, dim=2)
        with pytest.raises(NotImplementedError, match="kv_cache_dtype"):
            ops.cpu_attn_reshape_and_cache(
                torch.zeros(1, 1, HEAD),
                torch.zeros(1, 1, HEAD),
                k,
                v,
                torch.zeros(1, dtype=torch.int64),
                "vec",
                kv_cache_dtype="fp8",
            )


@pytest.mark.parametrize("num_reqs", [1, 3])
def test_a_query_row_does_not_depend_on_how_many_rows_are_verified(num_reqs):
    # Greedy speculative decoding verifies K + 1 query rows where plain decoding runs one:
    # the last row must come out bit for bit the same (bfloat16 would turn a last-bit
    # difference into a different token now and then). One request takes the op's
    # few-op path, several the padded one.
    from vllm_specx.cpu_ops.attention import cpu_attention_with_kv_cache

    gen = torch.Generator().manual_seed(3)
    num_heads, num_kv_heads, seq_len, blocks_per_req = 9, 3, 100, 4
    # float32 in and out: the op's own float32 arithmetic shows every last-bit change.
    kv = torch.randn(num_reqs * blocks_per_req, num_kv_heads, 2 * BLOCK, HEAD, generator=gen)
    key_cache, value_cache = kv.chunk(2, dim=2)
    table = torch.arange(num_reqs * blocks_per_req, dtype=torch.int32).view(num_reqs, -1)
    query = torch.randn(num_reqs * 9, num_heads, HEAD, generator=gen)

    def last_rows(n: int) -> torch.Tensor:
        # Each request verifies its last n query rows at positions seq_len - n ..
        q = torch.cat([query[r * 9 + 9 - n: r * 9 + 9] for r in range(num_reqs)])
        out = torch.empty_like(q)
        qsl = torch.arange(num_reqs + 1, dtype=torch.int32) * n
        cpu_attention_with_kv_cache(
            q, key_cache, value_cache, out, qsl,
            torch.full((num_reqs,), seq_len, dtype=torch.int32), HEAD**-0.5, True, None,
            -1, table, 0.0, torch.zeros(1), None, None)
        return out.view(num_reqs, n, num_heads, HEAD)[:, -1]

    one = last_rows(1)
    for n in (2, 3, 4, 5, 9):
        assert torch.equal(last_rows(n), one), n
