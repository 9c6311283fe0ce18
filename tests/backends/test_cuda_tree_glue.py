"""The CUDA tree step's glue (``glue/cuda_tree_attention.py``), against vLLM's real
Triton attention backend objects: the kernel arguments taken from a real
``TritonAttentionImpl`` and ``TritonAttentionMetadata`` give the tree attention of the
path-as-chain reference (kernel under ``TRITON_INTERPRET=1``), CUDA-graph padding rows
are left alone, layer features the kernel lacks are refused in one line, and the
accepted path's K/V moves in the Triton cache layout.
"""

from __future__ import annotations

import pytest
import torch
from test_tree_attention_kernel import make_batch, slow_reference

from vllm_specx.glue.cuda_tree_attention import copy_slots, tree_forward_args, tree_forward_refusal

pytest.importorskip("triton")

from vllm_specx.backends.triton_tree_attention import TreeMasks  # noqa: E402


def _impl(**overrides):
    from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

    args = dict(num_heads=8, head_size=32, scale=32 ** -0.5, num_kv_heads=2,
                alibi_slopes=None, sliding_window=None, kv_cache_dtype="auto")
    args.update(overrides)
    return TritonAttentionImpl(**args)


def test_args_from_vllms_triton_backend_give_the_tree_attention(triton_call) -> None:
    from vllm.v1.attention.backends.triton_attn import TritonAttentionMetadata

    b = make_batch(1016, 16, 8, 2, 32, "HND", max_nodes=20)
    impl = _impl()
    n = b["query"].shape[0]
    pad = 3  # CUDA-graph padding rows past num_actual_tokens: never written
    query = torch.cat([b["query"], torch.randn(pad, 8, 32)])
    output = torch.full((n + pad, 8 * 32), float("nan"))
    scratch = torch.empty(0)
    metadata = TritonAttentionMetadata(
        num_actual_tokens=n, max_query_len=max(b["q_lens"]), query_start_loc=b["qsl"],
        max_seq_len=int(b["seq_lens"].max()), seq_lens=b["seq_lens"], block_table=b["table"],
        slot_mapping=scratch, seq_threshold_3D=0, num_par_softmax_segments=16,
        softmax_segm_output=scratch, softmax_segm_max=scratch, softmax_segm_expsum=scratch,
        causal=True)
    masks = TreeMasks.build(b["q_lens"], b["trees"])
    args = tree_forward_args(impl, query, b["kv"], metadata, output, masks)
    got = triton_call("triton_tree_attention:tree_attention", **args)
    assert got.shape == (n, 8, 32)
    torch.testing.assert_close(got.double(), slow_reference(b), atol=2e-5, rtol=2e-5)
    assert args["out"].data_ptr() == output.data_ptr()  # the layer's own output rows
    assert args["query"].shape[0] == n  # padding rows are not attended, nor written


@pytest.mark.parametrize("overrides, fragment", [
    ({}, None),
    ({"sliding_window": 8}, "sliding window"),
    ({"alibi_slopes": [0.5] * 8}, "ALiBi"),
    ({"logits_soft_cap": 30.0}, "soft-capping"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'fp8'"),
])
def test_layer_features_the_kernel_lacks_are_refused(overrides, fragment) -> None:
    reason = tree_forward_refusal(_impl(**overrides))
    if fragment is None:
        assert reason is None
    else:
        assert reason is not None and fragment in reason and "\n" not in reason
        with pytest.raises(NotImplementedError, match="tree attention on CUDA"):
            tree_forward_args(_impl(**overrides), None, None, None, None, None)


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_copy_slots_moves_the_path_in_the_triton_layout(layout) -> None:
    """The accepted path (nodes 1, 4, 7 at slots ctx + 2, ctx + 5, ctx + 8) lands in the
    slots after the root; K and V both move, every other slot keeps its bytes."""
    b = make_batch(5, 16, 8, 2, 32, layout)
    kv, key_cache, value_cache = b["kv"], b["key_cache"], b["value_cache"]
    table, ctx = b["table"][0].tolist(), b["spec"][0][0]

    def slot(pos: int) -> int:
        return table[pos // 16] * 16 + pos % 16

    src = torch.tensor([slot(ctx + 1 + node) for node in (1, 4, 7)])
    dst = torch.tensor([slot(ctx + 1 + d) for d in range(3)])
    want_k = key_cache[src // 16, src % 16].clone()
    want_v = value_cache[src // 16, src % 16].clone()
    before = kv.clone()
    copy_slots(kv, src, dst)
    assert torch.equal(key_cache[dst // 16, dst % 16], want_k)
    assert torch.equal(value_cache[dst // 16, dst % 16], want_v)
    same = (kv == before).all(dim=1).all(dim=-1)  # [blocks, block]
    touched = torch.zeros_like(same)
    touched[dst // 16, dst % 16] = True
    assert bool(same[~touched].all()) and not bool(same[touched].all())
