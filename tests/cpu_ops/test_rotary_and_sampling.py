"""``rotary_embedding`` vs. vLLM's native rotary; ``greedy_argmax``/``fused_gumbel_argmax``."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.usefixtures("reference_ops")


def _rope(head_size: int, rotary_dim: int, is_neox: bool, dtype=torch.float32):
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import RotaryEmbedding

    with set_current_vllm_config(VllmConfig()):
        return RotaryEmbedding(head_size, rotary_dim, 512, 10000.0, is_neox, dtype)


@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("rotary_dim", [64, 32])  # full and partial rotation
def test_rotary_matches_vllm_native(is_neox: bool, rotary_dim: int):
    from vllm import _custom_ops as ops

    rope = _rope(64, rotary_dim, is_neox)
    gen = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 512, (9,), generator=gen)
    query = torch.randn(9, 4 * 64, generator=gen)
    key = torch.randn(9, 2 * 64, generator=gen)
    want_q, want_k = rope.forward_native(positions, query.clone(), key.clone())
    # In place, on a non-contiguous query slice like the model's qkv split.
    qkv = torch.cat([query, key], dim=1)
    q_view, k_view = qkv[:, : 4 * 64], qkv[:, 4 * 64 :]
    ops.rotary_embedding(positions, q_view, k_view, 64, rope.cos_sin_cache, is_neox)
    torch.testing.assert_close(q_view, want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k_view, want_k, atol=1e-5, rtol=1e-5)


def test_rotary_without_key_and_3d_layout():
    from vllm import _custom_ops as ops

    rope = _rope(64, 64, True)
    positions = torch.arange(5)
    query = torch.randn(5, 3, 64)
    want_q, _ = rope.forward_native(positions, query.clone(), None)
    ops.rotary_embedding(positions, query, None, 64, rope.cos_sin_cache, True)
    torch.testing.assert_close(query, want_q.view(5, 3, 64), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("is_neox", [True, False])
def test_rotary_offset_and_inverse(is_neox: bool):
    """``rope_dim_offset`` rotates the *last* dims of a head (DeepSeek style) and
    ``inverse`` undoes the rotation."""
    from vllm import _custom_ops as ops

    rope = _rope(48, 16, is_neox)
    positions = torch.randint(0, 512, (6,))
    query = torch.randn(6, 2, 48)
    original = query.clone()
    ops.rotary_embedding(positions, query, None, 48, rope.cos_sin_cache, is_neox, 32)
    torch.testing.assert_close(query[..., :32], original[..., :32], atol=0, rtol=0)
    want_tail, _ = type(rope).forward_static(
        positions, original[..., 32:].contiguous(), None, 16, 16, rope.cos_sin_cache, is_neox
    )
    torch.testing.assert_close(query[..., 32:], want_tail.view(6, 2, 16), atol=1e-5, rtol=1e-5)
    ops.rotary_embedding(positions, query, None, 48, rope.cos_sin_cache, is_neox, 32, True)
    torch.testing.assert_close(query, original, atol=1e-5, rtol=1e-5)


def test_greedy_argmax_lowest_index_on_ties():
    logits = torch.randn(6, 50)
    logits[2, 7] = logits[2, 30] = 100.0
    got = torch.ops._C.greedy_argmax(logits)
    assert got.dtype == torch.int64
    assert got.tolist() == [int(row.argmax()) for row in logits]
    assert int(got[2]) == 7


def test_gumbel_argmax_reproducible_and_respects_masks():
    logits = torch.randn(64, 300)
    logits[:, 100:] = float("-inf")
    seeds = torch.arange(64, dtype=torch.int64) * 7919
    a = torch.ops._C.fused_gumbel_argmax(logits, seeds)
    b = torch.ops._C.fused_gumbel_argmax(logits, seeds)
    assert torch.equal(a, b)
    assert (a < 100).all()
    other = torch.ops._C.fused_gumbel_argmax(logits, seeds + 1)
    assert not torch.equal(a, other)  # the seed matters
    all_masked = torch.full((1, 10), float("-inf"))
    assert torch.ops._C.fused_gumbel_argmax(all_masked, seeds[:1]).tolist() == [0]


def test_gumbel_argmax_samples_softmax_distribution():
    from scipy.stats import chisquare

    vocab, draws = 8, 40_000
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0, float("-inf")])
    seeds = torch.arange(draws, dtype=torch.int64)
    got = torch.ops._C.fused_gumbel_argmax(logits.expand(draws, vocab).contiguous(), seeds)
    counts = torch.bincount(got, minlength=vocab)
    assert counts[-1] == 0
    probs = torch.softmax(logits.double(), dim=0)[:-1]
    expected = probs / probs.sum() * draws
    result = chisquare(counts[:-1].double().numpy(), expected.numpy())
    assert result.pvalue > 1e-3, result


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("rows", "vocab"), [(1, 49152), (8, 300), (19, 1000)])
def test_gumbel_argmax_is_the_reference_draw_bit_for_bit(rows, vocab, dtype):
    """The op (chunks of ``ROWS_PER_CHUNK`` rows in reused buffers, a partial last chunk
    at 19 rows) draws what the reference formula draws: ``argmax(logits.double() +
    gumbel_noise(seeds))``, row for row, with masked tokens and a tied row; called twice
    (the buffers reused) and after a call of another vocabulary size."""
    from vllm_specx.cpu_ops.sampling import gumbel_noise

    g = torch.Generator().manual_seed(rows * vocab)
    logits = (3 * torch.randn(rows, vocab, generator=g)).to(dtype)
    logits[:, ::5] = float("-inf")
    logits[0, 1::5] = 0.0  # one row of many equal logits: the noise alone decides
    seeds = torch.randint(0, 2**31, (rows,), generator=g)
    reference = (logits.double() + gumbel_noise(seeds, vocab)).argmax(dim=-1)
    first = torch.ops._C.fused_gumbel_argmax(logits, seeds)
    torch.ops._C.fused_gumbel_argmax(torch.randn(3, 77), seeds[:1].expand(3))
    again = torch.ops._C.fused_gumbel_argmax(logits, seeds)
    assert torch.equal(first, reference) and torch.equal(again, reference)
